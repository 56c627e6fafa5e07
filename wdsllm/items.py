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
from .format import FormatError
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
    """Items over one token buffer, with per-item arrays that selections index together.

    Packed rows carry the documents they hold in one or both of two forms:

    - ``doc_first``/``doc_count`` (rows of a packed dataset): the document holding the row's
      first token and how many documents the row holds. Packing at pack time is sequential, so
      they are that document and the ones after it in shard order (``doc_next`` is the second:
      the shard's first document when the row continues one of the previous shard).
    - a segment table (``seg_starts``: offset within the row, ``seg_ids``: document id), shared
      by selections and never permuted: row ``i``'s segments are entries ``seg_lo[i]:seg_hi[i]``
      (see ``segments`` for them in row order). Batchers that pack documents into rows make it,
      and reading makes it where segment offsets are needed (``boundaries``).
    """

    tokens: np.ndarray
    starts: np.ndarray  # int64 offset of each item in ``tokens``
    lengths: np.ndarray  # int64
    ids: np.ndarray  # int64 item identities
    pieces: np.ndarray | None = None  # docs mode: piece number after a load-time split
    seg_lo: np.ndarray | None = None  # packed rows: first table entry of each row
    seg_hi: np.ndarray | None = None  # packed rows: one past its last
    seg_starts: np.ndarray | None = None  # the segment table: offset of the segment in its row
    seg_ids: np.ndarray | None = None  # the segment table: document id
    doc_first: np.ndarray | None = None  # packed dataset rows: id of the document holding the first token
    doc_next: np.ndarray | None = None  # packed dataset rows: id of the document after that one
    doc_count: np.ndarray | None = None  # packed dataset rows: documents in the row

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def set_segments(self, seg_ptr: np.ndarray, seg_starts: np.ndarray, seg_ids: np.ndarray) -> "Block":
        """Segments given in row order: row i's are ``seg_ptr[i]:seg_ptr[i+1]``."""
        self.seg_lo, self.seg_hi = seg_ptr[:-1], seg_ptr[1:]
        self.seg_starts, self.seg_ids = seg_starts, seg_ids
        return self

    def segments(self) -> tuple[np.ndarray, np.ndarray]:
        """(segments per row, table index of every segment in row order)."""
        counts = self.seg_hi - self.seg_lo
        ends = np.cumsum(counts)
        total = int(ends[-1]) if len(ends) else 0
        return counts, np.repeat(self.seg_lo - (ends - counts), counts) + np.arange(total)

    def _select(self, sel) -> "Block":
        # every per-item array, spelled out (not a getattr loop: this runs for every batch)
        return Block(
            self.tokens, self.starts[sel], self.lengths[sel], self.ids[sel],
            None if self.pieces is None else self.pieces[sel],
            None if self.seg_lo is None else self.seg_lo[sel],
            None if self.seg_hi is None else self.seg_hi[sel],
            self.seg_starts, self.seg_ids,
            None if self.doc_first is None else self.doc_first[sel],
            None if self.doc_next is None else self.doc_next[sel],
            None if self.doc_count is None else self.doc_count[sel],
        )

    def take(self, idx: np.ndarray) -> "Block":
        """Items ``idx`` (a permutation or a selection), sharing the token buffer and the segment table."""
        return self._select(idx)

    def slice(self, a: int, b: int) -> "Block":
        """Items ``a:b`` as views."""
        return self._select(slice(a, b))

    def gather_tokens(self) -> np.ndarray:
        """The items' tokens concatenated in item order (a copy unless already contiguous)."""
        n = len(self)
        if n == 0:
            return self.tokens[:0]
        width = int(self.lengths[0])
        if n > 1 and width and self.lengths.min() == width == self.lengths.max():
            # equal lengths (packed rows): copy whole rows from a strided view, no per-token index
            return row_view(self.tokens, width)[self.starts].reshape(-1)
        first, total = int(self.starts[0]), int(self.lengths.sum())
        if n == 1 or np.array_equal(self.starts[1:], (self.starts + self.lengths)[:-1]):
            return self.tokens[first : first + total]
        if n <= 512:
            return np.concatenate([self.tokens[a : a + m] for a, m in zip(self.starts.tolist(), self.lengths.tolist())])
        idx = np.repeat(self.starts - (np.cumsum(self.lengths) - self.lengths), self.lengths) + np.arange(total)
        return self.tokens[idx]

    def compact(self, into: np.ndarray | None = None) -> "Block":
        """The same items over a fresh contiguous buffer (``into``, ``n_tokens`` long, when given)
        and a segment table of their own: frees the source buffers; what a worker sends."""
        if into is None:
            tokens = np.array(self.gather_tokens(), copy=True)
        else:
            tokens = into
            np.copyto(tokens, self.gather_tokens())
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64) if len(self) else self.starts
        out = replace(self, tokens=tokens, starts=starts)
        if self.seg_lo is not None:
            counts, src = self.segments()
            out.set_segments(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), self.seg_starts[src], self.seg_ids[src])
        return out


def row_view(tokens: np.ndarray, width: int) -> np.ndarray:
    """[len - width + 1, width] view of ``tokens`` whose row i starts at token i (no copy).

    Built with the ndarray constructor: ``as_strided`` costs several microseconds a call, which
    is a tenth of what gathering a batch of rows costs."""
    base = tokens if tokens.flags.c_contiguous else np.ascontiguousarray(tokens)
    step = base.itemsize
    return np.ndarray((max(0, len(base) - width + 1), width), base.dtype, buffer=base, strides=(step, step))


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
    if all(b.doc_first is not None for b in blocks):
        out.doc_first = np.concatenate([b.doc_first for b in blocks])
        out.doc_next = np.concatenate([b.doc_next for b in blocks])
        out.doc_count = np.concatenate([b.doc_count for b in blocks])
    if all(b.seg_lo is not None for b in blocks):
        # the blocks' segment tables, each once (slices of one block share it), end to end
        shift: dict[int, int] = {}
        tables: list[Block] = []
        for b in blocks:
            if id(b.seg_starts) not in shift:
                shift[id(b.seg_starts)] = sum(len(t.seg_starts) for t in tables)
                tables.append(b)
        out.seg_starts = tables[0].seg_starts if len(tables) == 1 else np.concatenate([t.seg_starts for t in tables])
        out.seg_ids = tables[0].seg_ids if len(tables) == 1 else np.concatenate([t.seg_ids for t in tables])
        out.seg_lo = np.concatenate([b.seg_lo + shift[id(b.seg_starts)] for b in blocks])
        out.seg_hi = np.concatenate([b.seg_hi + shift[id(b.seg_starts)] for b in blocks])
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
        b.set_segments(np.zeros(1, np.int64), z, z)
    return b


# ----------------------------------------------------------------------------------------------
# Reading


@dataclass
class ReadOptions:
    retry: storage.RetryPolicy | None = None
    cache: storage.ShardCache | None = None
    on_error: str = "raise"  # or "skip": a shard that cannot be read is logged, counted, skipped
    prefetch: bool = True
    row_docs: bool = True  # packed rows: each row's first document and document count (docs)
    segments: bool = True  # packed rows: the segment table with offsets within rows (boundaries)


def _group_block(group, shard: int, first: int, mode: str, seq_len: int | None, doc_base: int, prev_shard_doc: int,
                 row_docs: bool = True, segments: bool = True) -> Block:
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
    # packed rows: every row starts with a document starting there or with the continuation of
    # the one before it (from an earlier group, or from the previous shard)
    n_tok = len(tokens)
    n_rows = (n_tok + seq_len - 1) // seq_len
    starts = np.arange(0, n_rows * seq_len, seq_len, dtype=np.int64)
    lengths = np.minimum(seq_len, n_tok - starts)
    block = Block(tokens, starts, lengths, make_id(shard, np.arange(first, first + n_rows, dtype=np.int64)))
    if not (row_docs or segments):
        return block
    doc_starts = group.starts.astype(np.int64)
    through = np.searchsorted(doc_starts, starts, side="right")  # documents starting at or before each row
    if row_docs:
        first_ord = doc_base - 1 + through  # ordinal in the shard of the document holding the first token
        block.doc_first = np.where(first_ord >= 0, make_id(shard, first_ord), prev_shard_doc)
        block.doc_next = make_id(shard, first_ord + 1)
        block.doc_count = np.searchsorted(doc_starts, starts + lengths) - through + 1
    if segments:
        before = np.searchsorted(doc_starts, starts)  # documents starting before each row
        _set_group_segments(block, doc_starts, before, through == before, shard, doc_base, prev_shard_doc)
    return block


def _set_group_segments(block: Block, doc_starts, before, continues, shard: int, doc_base: int, prev_shard_doc: int) -> None:
    """The segment table of a group's rows: document starts and row continuations, both sorted,
    merged by position without a sort."""
    starts = block.starts
    n_docs = len(doc_starts)
    cont_rows = np.flatnonzero(continues)
    cont_at = before[cont_rows] + np.arange(len(cont_rows))  # places of the continuations among all segments
    n_seg = n_docs + len(cont_rows)
    is_doc = np.ones(n_seg, bool)
    is_doc[cont_at] = False
    seg_pos = np.empty(n_seg, np.int64)
    seg_pos[is_doc] = doc_starts
    seg_pos[cont_at] = starts[cont_rows]
    ordinal = np.empty(n_seg, np.int64)  # document ordinal in the shard of each segment
    ordinal[is_doc] = np.arange(doc_base, doc_base + n_docs)
    ordinal[cont_at] = before[cont_rows] + (doc_base - 1)
    seg_ids = np.where(ordinal >= 0, make_id(shard, ordinal), prev_shard_doc)
    seg_ptr = np.empty(len(starts) + 1, np.int64)
    seg_ptr[:-1] = before + np.cumsum(continues) - continues
    seg_ptr[-1] = n_seg
    block.set_segments(seg_ptr, seg_pos - np.repeat(starts, np.diff(seg_ptr)), seg_ids)


def open_kwargs(catalog: Catalog, shard: int, options: ReadOptions, start: GroupStart | None = None) -> dict:
    """How ``storage.open_stream`` opens shard ``shard``: with the index's size, with its sha256
    where a cache will keep the bytes (a cache entry must match the index's checksum), and at a
    group's offset for a ranged start."""
    entry = catalog.shard_entries[shard] if catalog.shard_entries else None
    cached = options.cache is not None and storage.is_remote(catalog.urls[shard])
    return dict(
        offset=start.offset if start else 0,
        length=start.length if start else None,
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


@dataclass(frozen=True)
class GroupStart:
    """Where a read enters a shard: a group's byte offset and the counts before it."""

    offset: int
    items: int  # items of the shard before the group
    documents: int  # documents of the shard before the group
    group_items: int  # items the group holds (checked against its metadata)
    length: int | None = None  # bytes to request: through the header of the group after the last one needed


def ranged_start(catalog: Catalog, sl: Slice, skip: int, options: ReadOptions) -> GroupStart | None:
    """Where a ranged read of a remote shard covers the slice (groups.npy, format 2): from the
    group holding its first wanted item to the first member header of the group after its last.
    A consumer whose share is a part of a shard then downloads only that part (and the groups it
    shares with its neighbours), not the shard up to its share and a read-ahead past it."""
    if options.cache is not None or not storage.is_remote(catalog.urls[sl.shard]) or sl.stride != 1:
        return None
    table = catalog.group_table(sl.shard)
    if table is None or not len(table):
        return None
    first_wanted = sl.start + skip
    g = max(0, int(np.searchsorted(table[:, 1], first_wanted, side="right")) - 1)
    after = len(table) if sl.stop is None else int(np.searchsorted(table[:, 1], sl.stop, side="left"))
    if g == 0 and after >= len(table):
        return None  # the whole shard: a plain read
    entry = catalog.shard_entries[sl.shard]
    end_items = int(table[g + 1, 1]) if g + 1 < len(table) else (entry.rows if catalog.mode == "packed" else entry.documents)
    # the reader sees a group end when the next member header names another key: include it
    length = int(table[after, 0]) + tario.BLOCK - int(table[g, 0]) if after < len(table) else None
    return GroupStart(int(table[g, 0]), int(table[g, 1]), int(table[g, 2]), end_items - int(table[g, 1]), length)


def read_slice(
    catalog: Catalog,
    sl: Slice,
    *,
    skip: int = 0,
    options: ReadOptions | None = None,
    stream=None,
    start: GroupStart | None = None,
) -> Iterator[Block]:
    """The items of one slice (after skipping ``skip`` of them), as blocks of one group each.

    ``start``: where to enter the shard (``ranged_start``); ``stream``: the shard already opened
    there (else it is opened here)."""
    options = options or ReadOptions()
    url = catalog.urls[sl.shard]
    mode = catalog.mode
    seq_len = catalog.index.seq_len if catalog.index else None
    if mode == "packed" and seq_len is None:
        raise ValueError("packed shards need their index (seq_len)")
    first_wanted = sl.start + skip * sl.stride
    stop = sl.stop
    own = stream is None
    state = {"ordinal": 0, "doc": 0} if start is None else {"ordinal": start.items, "doc": start.documents}
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

    if own:
        stream = storage.open_stream(url, **open_kwargs(catalog, sl.shard, options, start))
    source = tario.mapped(stream) or stream
    shard_tokens = None
    if isinstance(source, tario.MappedReader) and catalog.index is not None:
        dtype = np.dtype(catalog.index.dtype)
        if len(source.mm) % dtype.itemsize == 0:
            shard_tokens = np.frombuffer(source.mm, dtype=dtype)
    try:
        for raw in tario.iter_samples(source, url, wanted=wanted, base_offset=start.offset if start else 0):
            group = tario.decode_sample(raw, url)
            n = tario.group_items(raw.meta)
            if start is not None and raw.offset == start.offset and n != start.group_items:
                raise FormatError(f"{url}: the group at byte {raw.offset} holds {n} items, {catalog.index.groups_file['name']} says {start.group_items}")
            g0 = state["ordinal"] - n
            block = _group_block(group, sl.shard, g0, mode, seq_len, state["doc"], prev_shard_doc, options.row_docs, options.segments)
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
