"""Blocks of items (documents, or packed rows) and reading them from planned slices.

Items move through the pipeline in blocks, never one by one: a block is a token buffer plus
per-item offsets, lengths and identities, so that selecting, permuting and batching are numpy
index operations. Per-item Python would cap the loader at a few hundred thousand items/s.

Identities: an item is ``(shard index << 32) | ordinal within the shard``, where the shard index
is the shard's position in the catalog (the index order). A document split at load time keeps
its id and gets a piece number.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from . import storage, tario
from .catalog import Catalog
from .plan import Slice

log = logging.getLogger(__name__)

ID_SHIFT = 32


def make_id(shard: int, ordinal) -> np.ndarray | int:
    return (np.int64(shard) << ID_SHIFT) | ordinal


def split_id(item_id: int) -> tuple[int, int]:
    """(shard index in the catalog, ordinal of the item within the shard)."""
    return int(item_id) >> ID_SHIFT, int(item_id) & ((1 << ID_SHIFT) - 1)


@dataclass
class Block:
    """Items over one token buffer. Packed rows also carry their document segments."""

    tokens: np.ndarray
    starts: np.ndarray  # int64 offset of each item in ``tokens``
    lengths: np.ndarray  # int64
    ids: np.ndarray  # int64 item identities
    pieces: np.ndarray | None = None  # docs mode: piece number after a load-time split
    # packed rows: segment j of item i is seg_starts[seg_ptr[i] + j] (offset within the row)
    seg_ptr: np.ndarray | None = None
    seg_starts: np.ndarray | None = None
    seg_ids: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def take(self, idx: np.ndarray) -> "Block":
        """Items ``idx`` (a permutation or a selection), sharing the token buffer."""
        out = Block(self.tokens, self.starts[idx], self.lengths[idx], self.ids[idx], None if self.pieces is None else self.pieces[idx])
        if self.seg_ptr is not None:
            counts = np.diff(self.seg_ptr)[idx]
            src = np.repeat(self.seg_ptr[:-1][idx] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(int(counts.sum()))
            out.seg_ptr = np.concatenate([[0], np.cumsum(counts)])
            out.seg_starts = self.seg_starts[src]
            out.seg_ids = self.seg_ids[src]
        return out

    def slice(self, a: int, b: int) -> "Block":
        return self.take(np.arange(a, min(b, len(self))))

    def gather_tokens(self) -> np.ndarray:
        """The items' tokens concatenated in item order (a copy unless already contiguous)."""
        n = len(self)
        if n == 0:
            return self.tokens[:0]
        first, total = int(self.starts[0]), int(self.lengths.sum())
        ends = self.starts + self.lengths
        if n == 1 or (np.all(self.starts[1:] == ends[:-1])):
            return self.tokens[first : first + total]
        width = int(self.lengths[0])
        if width and np.all(self.lengths == width):
            # equal lengths (packed rows): copy whole rows from a strided view, no per-token index
            windows = np.lib.stride_tricks.sliding_window_view(self.tokens, width)
            return windows[self.starts].reshape(-1)
        if n <= 512:
            return np.concatenate([self.tokens[a : a + m] for a, m in zip(self.starts.tolist(), self.lengths.tolist())])
        idx = np.repeat(self.starts - (np.cumsum(self.lengths) - self.lengths), self.lengths) + np.arange(total)
        return self.tokens[idx]

    def compact(self) -> "Block":
        """The same items over a fresh contiguous buffer (frees the source buffers)."""
        tokens = np.array(self.gather_tokens(), copy=True)
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64) if len(self) else self.starts
        return replace(self, tokens=tokens, starts=starts)


def concat_blocks(blocks: list[Block]) -> Block:
    """One block over the concatenated buffers of several (no copy when they share a buffer)."""
    if len(blocks) == 1:
        return blocks[0]
    lengths = np.concatenate([b.lengths for b in blocks])
    if all(b.tokens is blocks[0].tokens for b in blocks):
        tokens = blocks[0].tokens
        starts = np.concatenate([b.starts for b in blocks])
    else:
        tokens = np.concatenate([b.gather_tokens() for b in blocks])
        starts = np.zeros(len(lengths), np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1], out=starts[1:])
    ids = np.concatenate([b.ids for b in blocks])
    pieces = None
    if any(b.pieces is not None for b in blocks):
        pieces = np.concatenate([b.pieces if b.pieces is not None else np.zeros(len(b), np.int64) for b in blocks])
    out = Block(tokens, starts, lengths, ids, pieces)
    if blocks[0].seg_ptr is not None:
        counts = np.concatenate([np.diff(b.seg_ptr) for b in blocks])
        out.seg_ptr = np.concatenate([[0], np.cumsum(counts)])
        out.seg_starts = np.concatenate([b.seg_starts for b in blocks])
        out.seg_ids = np.concatenate([b.seg_ids for b in blocks])
    return out


def windows(blocks, size: int):
    """Consecutive windows of exactly ``size`` items over a stream of blocks (the last may be
    shorter): what shuffle buffers and bucketing/packing windows are cut from."""
    pending: list[Block] = []
    have = 0
    for block in blocks:
        while len(block):
            take = min(size - have, len(block))
            pending.append(block.slice(0, take) if take < len(block) else block)
            block = block.slice(take, len(block)) if take < len(block) else block.slice(0, 0)
            have += take
            if have == size:
                yield concat_blocks(pending)
                pending, have = [], 0
    if have:
        yield concat_blocks(pending)


def empty_block(dtype, packed: bool = False) -> Block:
    z = np.zeros(0, np.int64)
    b = Block(np.zeros(0, dtype), z, z, z)
    if packed:
        b.seg_ptr, b.seg_starts, b.seg_ids = np.zeros(1, np.int64), z, z
    return b


# ----------------------------------------------------------------------------------------------
# Reading


@dataclass
class ReadOptions:
    retry: storage.RetryPolicy | None = None
    cache: storage.ShardCache | None = None
    on_error: str = "raise"  # or "skip": a shard that cannot be read is logged, counted, skipped
    prefetch: bool = True


def _group_block(group, shard: int, first: int, mode: str, seq_len: int | None, doc_base: int, prev_shard_doc: int) -> Block:
    """Items of one decoded group. ``doc_base``: ordinal in the shard of the group's first
    document start; ``prev_shard_doc``: id of the previous shard's last document (or -1)."""
    tokens = group.tokens
    if mode == "docs":
        lengths = group.lengths.astype(np.int64)
        starts = np.zeros(len(lengths), np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], out=starts[1:])
        ids = make_id(shard, np.arange(first, first + len(lengths), dtype=np.int64))
        return Block(tokens, starts, lengths, ids)
    # packed rows
    n_tok = len(tokens)
    n_rows = (n_tok + seq_len - 1) // seq_len
    starts = np.arange(n_rows, dtype=np.int64) * seq_len
    lengths = np.minimum(seq_len, n_tok - starts)
    ids = make_id(shard, np.arange(first, first + n_rows, dtype=np.int64))
    doc_starts = group.starts.astype(np.int64)
    row_of_start = doc_starts // seq_len
    # Every row starts a segment: either a document starting there, or a continuation.
    row_begins = starts
    has_start_at_begin = np.zeros(n_rows, bool)
    at_begin = doc_starts[doc_starts % seq_len == 0] // seq_len
    has_start_at_begin[at_begin] = True
    cont_rows = np.nonzero(~has_start_at_begin)[0]
    # document ordinal (within shard) of each start, and of each continuation (the last start before it)
    start_ord = doc_base + np.arange(len(doc_starts), dtype=np.int64)
    cont_ord = doc_base + np.searchsorted(doc_starts, row_begins[cont_rows], side="right") - 1
    cont_ids = np.where(cont_ord >= 0, make_id(shard, np.maximum(cont_ord, 0)), prev_shard_doc)
    seg_pos = np.concatenate([doc_starts, row_begins[cont_rows]])
    seg_row = np.concatenate([row_of_start, cont_rows])
    seg_id = np.concatenate([make_id(shard, start_ord), cont_ids]).astype(np.int64)
    order = np.lexsort((seg_pos, seg_row))
    seg_pos, seg_row, seg_id = seg_pos[order], seg_row[order], seg_id[order]
    counts = np.bincount(seg_row, minlength=n_rows)
    block = Block(tokens, starts, lengths, ids)
    block.seg_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    block.seg_starts = seg_pos - seg_row * seq_len
    block.seg_ids = seg_id
    return block


def open_kwargs(catalog: Catalog, shard: int, options: ReadOptions) -> dict:
    """How ``storage.open_stream`` opens shard ``shard``: with the index's size, and with its
    sha256 where a cache will keep the bytes (a cache entry must match the index's checksum)."""
    entry = catalog.shard_entries[shard] if catalog.shard_entries else None
    cached = options.cache is not None and storage.is_remote(catalog.urls[shard])
    return dict(
        retry=options.retry,
        cache=options.cache,
        allow_pipe=catalog.user_urls,
        expected_size=entry.bytes if entry else None,
        expected_sha256=entry.sha256 if entry and cached else None,
    )


def _on_shard_buffer(block: Block, shard_tokens: np.ndarray) -> Block:
    """The block re-expressed over the whole mapped shard, so blocks of one shard share a buffer
    (and concat_blocks needs no copy)."""
    offset = block.tokens.__array_interface__["data"][0] - shard_tokens.__array_interface__["data"][0]
    size = shard_tokens.itemsize
    if block.tokens.dtype != shard_tokens.dtype or offset % size or not 0 <= offset < shard_tokens.nbytes:
        return block
    block.tokens = shard_tokens
    block.starts = block.starts + offset // size
    return block


def read_slice(
    catalog: Catalog,
    sl: Slice,
    *,
    skip: int = 0,
    options: ReadOptions | None = None,
    stream=None,
) -> Iterator[Block]:
    """The items of one slice (after skipping ``skip`` of them), as blocks of one group each."""
    options = options or ReadOptions()
    url = catalog.urls[sl.shard]
    mode = catalog.mode
    seq_len = catalog.index.seq_len if catalog.index else None
    if mode == "packed" and seq_len is None:
        raise ValueError("packed shards need their index (seq_len)")
    first_wanted = sl.start + skip * sl.stride
    stop = sl.stop
    state = {"ordinal": 0, "doc": 0}
    prev_shard_doc = -1
    if mode == "packed" and catalog.shard_entries is not None and sl.shard > 0:
        # a row that continues a document from the previous shard belongs to its last document
        prev_shard_doc = int(make_id(sl.shard - 1, catalog.shard_entries[sl.shard - 1].documents - 1))

    def wanted(meta: dict) -> bool:
        n = tario.group_items(meta)
        g0 = state["ordinal"]
        state["ordinal"] = g0 + n
        state["pending_docs"] = int(meta.get("documents", 0))
        keep = g0 + n > first_wanted and (stop is None or g0 < stop)
        if not keep:
            state["doc"] += state["pending_docs"]
        return keep

    own = stream is None
    if own:
        stream = storage.open_stream(url, **open_kwargs(catalog, sl.shard, options))
    source = tario.mapped(stream) or stream
    shard_tokens = None
    if isinstance(source, tario.MappedReader) and catalog.index is not None:
        dtype = np.dtype(catalog.index.dtype)
        if len(source.mm) % dtype.itemsize == 0:
            shard_tokens = np.frombuffer(source.mm, dtype=dtype)
    try:
        for raw in tario.iter_samples(source, url, wanted=wanted):
            group = tario.decode_sample(raw, url)
            n = tario.group_items(raw.meta)
            g0 = state["ordinal"] - n
            block = _group_block(group, sl.shard, g0, mode, seq_len, state["doc"], prev_shard_doc)
            if shard_tokens is not None:
                block = _on_shard_buffer(block, shard_tokens)
            state["doc"] += state["pending_docs"]
            lo = max(0, first_wanted - g0)
            hi = n if stop is None else min(n, stop - g0)
            if sl.stride > 1:
                idx = np.arange(lo, hi)
                idx = idx[(g0 + idx - sl.start) % sl.stride == 0]
                block = block.take(idx)
            elif lo > 0 or hi < n:
                block = block.take(np.arange(lo, hi))
            if len(block):
                yield block
            if stop is not None and state["ordinal"] >= stop:
                break
    finally:
        if own:
            stream.close()
