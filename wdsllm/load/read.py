"""Reading planned slices of shards into blocks: a group at a time, entered at a group's byte
offset where the index says where groups start, zero-copy over mapped local shards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import format as fmt
from .. import storage
from ..errors import FormatError
from ..format import tar as tario
from ..format.shard import CheckedGroup, expect_of, read_checked, sequential_fetch
from .block import Block, make_id
from .plan import Slice

if TYPE_CHECKING:
    from .sources.packed import PackedSource

log = logging.getLogger(__name__)


@dataclass
class ReadOptions:
    retry: storage.RetryPolicy | None = None
    cache: storage.ShardCache | None = None
    on_error: str = "raise"  # or "skip": a shard that cannot be read is logged, counted, skipped
    row_docs: bool = True  # packed rows: each row's first document and document count (docs)
    segments: bool = True  # packed rows: the segment table with offsets within rows (boundaries)
    check_groups: bool = True  # check every group against groups.npy (format 3) before decoding it
    #: remote shards downloaded by a fetch process (storage/offload.py); None: where the stream is
    #: read outside DataLoader workers (the training process itself), whose GIL it then spares
    fetch_process: bool | None = None


def _group_block(
    group,
    shard: int,
    first: int,
    mode: str,
    seq_len: int | None,
    doc_base: int,
    prev_shard_doc: int,
    row_docs: bool = True,
    segments: bool = True,
) -> Block:
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


def _set_group_segments(
    block: Block, doc_starts, before, continues, shard: int, doc_base: int, prev_shard_doc: int
) -> None:
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


class _SpooledShard(tario.MappedReader):
    """A remote shard (or share of one) downloading into a :class:`storage.SpooledRange`, read in
    place as a mapped local shard is: each read waits until its bytes have arrived."""

    def __init__(self, spool: storage.SpooledRange) -> None:
        super().__init__(spool.mm, spool.offset)
        self.spool = spool

    def read(self, n: int = -1) -> bytes | memoryview:
        self.spool.wait(self.spool.end if n < 0 else self.pos + n)
        return super().read(n)


def _in_place(stream: Any, url: str) -> tario.MappedReader | None:
    """The stream as a reader over a buffer (a mapped local file, a spooled remote one), or None."""
    if isinstance(stream, storage.SpooledRange):
        return _SpooledShard(stream)
    local = storage.local_path(url) if storage.scheme_of(url) == "file" else None
    return tario.mapped(stream, local)


def _mapped_again(dataset: PackedSource, shard: int, url: str) -> tario.MappedReader | None:
    """A local shard this process keeps mapped, found without opening it (``tario.mapped_again``)."""
    if storage.scheme_of(url) != "file":
        return None
    entry = dataset.shard_entries[shard] if dataset.shard_entries else None
    return tario.mapped_again(storage.local_path(url), entry.bytes if entry else None)


def open_kwargs(dataset: PackedSource, shard: int, options: ReadOptions, start: GroupStart | None = None) -> dict:
    """How ``storage.open_stream`` opens shard ``shard``: with the index's size, with its sha256
    where a cache will keep the bytes (a cache entry must match the index's checksum), and at a
    group's offset for a ranged start."""
    entry = dataset.shard_entries[shard] if dataset.shard_entries else None
    cached = options.cache is not None and storage.is_remote(dataset.urls[shard])
    return dict(
        offset=start.offset if start else 0,
        length=start.length if start else None,
        retry=options.retry,
        cache=options.cache,
        allow_pipe=dataset.user_urls,
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


def group_range(dataset: PackedSource, sl: Slice, skip: int) -> tuple[np.ndarray, int, int] | None:
    """(the shard's group table, first group, one past the last) holding items ``sl.start + skip``
    to ``sl.stop`` of the slice; None without groups.npy or for a slice dealt out by stride."""
    if sl.stride != 1:
        return None
    table = dataset.group_table(sl.shard)
    if table is None or not len(table):
        return None
    items = table[:, fmt.ITEMS]
    first = max(0, int(np.searchsorted(items, sl.start + skip, side="right")) - 1)
    after = len(table) if sl.stop is None else int(np.searchsorted(items, sl.stop, side="left"))
    return table, first, max(first, after)


def ranged_start(dataset: PackedSource, sl: Slice, skip: int, options: ReadOptions) -> GroupStart | None:
    """Where a ranged read of a remote shard covers the slice (groups.npy, format 2 on): from the
    group holding its first wanted item to the end of the group holding its last (format 3: the
    groups' sizes are known; format 2: through the first member header of the group after it, where
    the reader sees the group end). A consumer whose share is a part of a shard then downloads only
    that part (and the groups it shares with its neighbours), not the shard up to its share."""
    if options.cache is not None or not storage.is_remote(dataset.urls[sl.shard]):
        return None
    found = group_range(dataset, sl, skip)
    if found is None:
        return None
    table, g, after = found
    if g == 0 and after >= len(table):
        return None  # the whole shard: a plain read
    entry = dataset.shard_entries[sl.shard]
    end_items = int(table[g + 1, fmt.ITEMS]) if g + 1 < len(table) else _shard_items(dataset, entry)
    if table.shape[1] > fmt.BYTES:
        length = int(table[after - 1, fmt.OFFSET] + table[after - 1, fmt.BYTES] - table[g, fmt.OFFSET])
    else:
        length = int(table[after, 0]) + tario.BLOCK - int(table[g, 0]) if after < len(table) else None
    items_before = int(table[g, fmt.ITEMS])
    return GroupStart(int(table[g, 0]), items_before, int(table[g, fmt.DOCS]), end_items - items_before, length)


def _shard_items(dataset: PackedSource, entry: fmt.ShardEntry) -> int:
    return entry.rows if dataset.mode == "packed" else entry.documents


def read_slice(
    dataset: PackedSource,
    sl: Slice,
    *,
    skip: int = 0,
    options: ReadOptions | None = None,
    stream: Any = None,
    start: GroupStart | None = None,
) -> Iterator[Block]:
    """The items of one slice (after skipping ``skip`` of them), as blocks of one group each.

    ``start``: where to enter the shard (``ranged_start``); ``stream``: the shard already opened
    there (else it is opened here). Datasets with group checksums (format 3) are read group by
    group through :func:`wdsllm.format.shard.read_checked`; older ones and shards read without an
    index are parsed as they stream (their content is unchecked)."""
    options = options or ReadOptions()
    url = dataset.urls[sl.shard]
    if dataset.mode == "packed" and (dataset.index is None or dataset.index.seq_len is None):
        raise FormatError(f"{url}: packed shards need their index (seq_len)")
    source = _mapped_again(dataset, sl.shard, url) if stream is None else None
    own = stream is None and source is None
    if own:
        stream = storage.open_stream(url, **open_kwargs(dataset, sl.shard, options, start))
    try:
        source = source or _in_place(stream, url) or stream
        checked = options.check_groups and dataset.index is not None and dataset.index.checks_groups
        groups = group_range(dataset, sl, skip) if checked else None
        if groups is not None:
            raw_groups = _checked_groups(dataset, sl, source, groups, start, options)
        else:
            raw_groups = _streamed_groups(dataset, sl, skip, source, start)
        yield from _blocks(dataset, sl, skip, source, raw_groups, options)
    finally:
        if own:
            stream.close()


def _checked_groups(
    dataset: PackedSource, sl: Slice, source: Any, groups: tuple, start: GroupStart | None, options: ReadOptions
) -> Iterator[CheckedGroup]:
    table, first, after = groups
    url = dataset.urls[sl.shard]
    entry = dataset.shard_entries[sl.shard]
    index = dataset.index
    remote = storage.is_remote(url)
    position = start.offset if start is not None else 0

    def again(offset: int, length: int) -> bytes | None:
        """The bytes did not match: ask the store again (a local file would say the same)."""
        if not remote:
            return None
        with storage.open_stream(url, offset=offset, length=length, retry=options.retry) as fresh:
            return fresh.read(length)

    fetch = sequential_fetch(source, position, again)
    if isinstance(source, _SpooledShard):
        plain = fetch

        def fetch(offset: int, length: int, attempt: int) -> bytes | memoryview | None:
            if not attempt:
                source.spool.wait(offset + length)  # the group's bytes have arrived
            return plain(offset, length, attempt)

    items_total = _shard_items(dataset, entry)
    return read_checked(
        fetch,
        table,
        first,
        after,
        items_total=items_total,
        docs_total=entry.documents,
        expect=expect_of(index),
        where=url,
        on_retry=log.warning,
        edges=_edge_groups(table, first, after, sl, items_total),
        buffer=source.spool.mm if isinstance(source, _SpooledShard) else None,
    )


def _edge_groups(table: np.ndarray, first: int, after: int, sl: Slice, items_total: int) -> tuple[int, ...]:
    """The slice's first and last groups where it holds only part of them (a block of the epoch
    starts or stops inside)."""
    if after <= first:
        return ()
    edges = []
    if int(table[first, fmt.ITEMS]) < sl.start:
        edges.append(first)
    last_end = int(table[after, fmt.ITEMS]) if after < len(table) else items_total
    if sl.stop is not None and last_end > sl.stop:
        edges.append(after - 1)
    return tuple(edges)


def _streamed_groups(
    dataset: PackedSource, sl: Slice, skip: int, source: Any, start: GroupStart | None
) -> Iterator[CheckedGroup]:
    """Groups parsed as the shard streams (no checksums): unwanted ones are skipped by their JSON."""
    url = dataset.urls[sl.shard]
    first_wanted = sl.start + skip * sl.stride
    stop = sl.stop
    state = {"ordinal": 0, "doc": 0} if start is None else {"ordinal": start.items, "doc": start.documents}

    def wanted(meta: dict) -> bool:
        n = tario.group_items(meta, url)
        g0 = state["ordinal"]
        state["ordinal"] = g0 + n
        state["pending_docs"] = int(meta.get("documents", 0))
        keep = g0 + n > first_wanted and (stop is None or g0 < stop)
        if not keep:
            state["doc"] += state["pending_docs"]
        return keep

    end = dataset.shard_entries[sl.shard].bytes if dataset.shard_entries is not None else None
    for raw in tario.iter_samples(source, url, wanted=wanted, base_offset=start.offset if start else 0, end=end):
        group = tario.decode_sample(raw, url)
        n = tario.group_items(raw.meta, url)
        if start is not None and raw.offset == start.offset and n != start.group_items:
            raise FormatError(
                f"{url}: the group at byte {raw.offset} holds {n} items, {dataset.index.groups_file.name} says "
                f"{start.group_items}"
            )
        yield CheckedGroup(raw.offset, state["ordinal"] - n, state["doc"], n, group)
        state["doc"] += state["pending_docs"]
        if stop is not None and state["ordinal"] >= stop:
            return


def _blocks(
    dataset: PackedSource, sl: Slice, skip: int, source: Any, groups: Iterator[CheckedGroup], options: ReadOptions
) -> Iterator[Block]:
    """The slice's items of each group, as blocks (over the whole mapped shard when it is one)."""
    mode = dataset.mode
    seq_len = dataset.index.seq_len if dataset.index else None
    first_wanted = sl.start + skip * sl.stride
    stop = sl.stop
    prev_shard_doc = -1
    if mode == "packed" and dataset.shard_entries is not None and sl.shard > 0:
        # a row that continues a document from the previous shard belongs to its last document
        prev_shard_doc = int(make_id(sl.shard - 1, dataset.shard_entries[sl.shard - 1].documents - 1))
    shard_tokens = None
    if isinstance(source, tario.MappedReader) and dataset.index is not None:
        dtype = np.dtype(dataset.index.dtype)
        if len(source.mm) % dtype.itemsize == 0:
            shard_tokens = np.frombuffer(source.mm, dtype=dtype)
    for checked in groups:
        g0, n = checked.items_before, checked.items
        block = _group_block(
            checked.group,
            sl.shard,
            g0,
            mode,
            seq_len,
            checked.docs_before,
            prev_shard_doc,
            options.row_docs,
            options.segments,
        )
        if shard_tokens is not None:
            block = _on_shard_buffer(block, shard_tokens)
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
        if stop is not None and g0 + n >= stop:
            return
