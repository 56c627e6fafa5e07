"""Reading planned slices of shards into blocks: a group at a time, entered at a group's byte
offset where the index says where groups start, zero-copy over mapped local shards.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import format as fmt
from .. import storage
from ..errors import FormatError
from ..format import tar as tario
from ..format.shard import CheckedGroup, GroupRows, read_checked, sequential_fetch
from .block import Block, make_id
from .plan import Slice

if TYPE_CHECKING:
    from .sources.packed import PackedSource, ShardFacts

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


#: how many local shards' mappings a pass holds for its next slices (``read_slice``'s ``held``)
HELD_SHARDS = 8


def _mapped_again(facts: ShardFacts, held: dict | None) -> tario.MappedReader | None:
    """A local shard this process keeps mapped, found without opening it (``tario.mapped_again``);
    found once per pass where the pass ``held`` it for its next slices: the pass's first read of
    the shard is the one that sees a replaced file, as a read of the whole shard would."""
    if facts.local_path is None:
        return None
    key = facts.url  # a file: one mapping, whichever source of a mixture reads it
    mm = held.get(key) if held is not None else None
    if mm is not None:
        return tario.MappedReader(mm, 0)
    reader = tario.mapped_again(facts.local_path, facts.entry.bytes if facts.entry else None)
    if reader is not None and held is not None:
        if len(held) >= HELD_SHARDS:
            held.pop(next(iter(held)))
        held[key] = reader.mm
    return reader


def open_kwargs(dataset: PackedSource, shard: int, options: ReadOptions, start: GroupStart | None = None) -> dict:
    """How ``storage.open_stream`` opens shard ``shard``: with the index's size, with its sha256
    where a cache will keep the bytes (a cache entry must match the index's checksum), and at a
    group's offset for a ranged start."""
    facts = dataset.shard(shard)
    entry = facts.entry
    cached = options.cache is not None and facts.remote
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


def group_range(dataset: PackedSource, sl: Slice, skip: int) -> tuple[GroupRows, int, int] | None:
    """(the shard's group rows, first group, one past the last) holding items ``sl.start + skip``
    to ``sl.stop`` of the slice; None without groups.npy or for a slice dealt out by stride."""
    if sl.stride != 1:
        return None
    table = dataset.group_rows(sl.shard)
    if table is None or not len(table):
        return None
    items = table.items
    first = max(0, bisect.bisect_right(items, sl.start + skip) - 1)
    after = len(table) if sl.stop is None else bisect.bisect_left(items, sl.stop)
    return table, first, max(first, after)


def ranged_start(dataset: PackedSource, sl: Slice, skip: int, options: ReadOptions) -> GroupStart | None:
    """Where a ranged read of a remote shard covers the slice (groups.npy, format 2 on): from the
    group holding its first wanted item to the end of the group holding its last (format 3: the
    groups' sizes are known; format 2: through the first member header of the group after it, where
    the reader sees the group end). A consumer whose share is a part of a shard then downloads only
    that part (and the groups it shares with its neighbours), not the shard up to its share."""
    facts = dataset.shard(sl.shard)
    if options.cache is not None or not facts.remote:
        return None
    found = group_range(dataset, sl, skip)
    if found is None:
        return None
    table, g, after = found
    rows = table.rows
    if g == 0 and after >= len(rows):
        return None  # the whole shard: a plain read
    end_items = rows[g + 1][fmt.ITEMS] if g + 1 < len(rows) else facts.items
    if len(rows[g]) > fmt.BYTES:
        length = rows[after - 1][fmt.OFFSET] + rows[after - 1][fmt.BYTES] - rows[g][fmt.OFFSET]
    else:
        length = rows[after][fmt.OFFSET] + tario.BLOCK - rows[g][fmt.OFFSET] if after < len(rows) else None
    items_before = rows[g][fmt.ITEMS]
    return GroupStart(rows[g][fmt.OFFSET], items_before, rows[g][fmt.DOCS], end_items - items_before, length)


def read_slice(
    dataset: PackedSource,
    sl: Slice,
    *,
    skip: int = 0,
    options: ReadOptions | None = None,
    stream: Any = None,
    start: GroupStart | None = None,
    held: dict | None = None,
) -> Iterator[Block]:
    """The items of one slice (after skipping ``skip`` of them), as blocks of one group each.

    ``start``: where to enter the shard (``ranged_start``); ``stream``: the shard already opened
    there (else it is opened here); ``held``: the pass's local shards mapped by earlier slices.
    Datasets with group checksums (format 3) are read group by group through
    :func:`wdsllm.format.shard.read_checked`; older ones and shards read without an index are
    parsed as they stream (their content is unchecked)."""
    options = options or ReadOptions()
    facts = dataset.shard(sl.shard)
    url = facts.url
    if dataset.mode == "packed" and (dataset.index is None or dataset.index.seq_len is None):
        raise FormatError(f"{url}: packed shards need their index (seq_len)")
    source = _mapped_again(facts, held) if stream is None else None
    own = stream is None and source is None
    if own:
        stream = storage.open_stream(url, **open_kwargs(dataset, sl.shard, options, start))
    try:
        source = source or _in_place(stream, url) or stream
        checked = options.check_groups and dataset.index is not None and dataset.index.checks_groups
        groups = group_range(dataset, sl, skip) if checked else None
        if groups is not None:
            raw_groups = _checked_groups(dataset, facts, sl, source, groups, start, options)
        else:
            raw_groups = _streamed_groups(dataset, facts, sl, skip, source, start)
        yield from _blocks(dataset, facts, sl, skip, source, raw_groups, options)
    finally:
        if own:
            stream.close()


def _checked_groups(
    dataset: PackedSource,
    facts: ShardFacts,
    sl: Slice,
    source: Any,
    groups: tuple,
    start: GroupStart | None,
    options: ReadOptions,
) -> Iterator[CheckedGroup]:
    table, first, after = groups
    url, remote = facts.url, facts.remote
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

    return read_checked(
        fetch,
        table,
        first,
        after,
        items_total=facts.items,
        docs_total=facts.entry.documents,
        expect=dataset.expect(),
        where=url,
        on_retry=log.warning,
        edges=_edge_groups(table, first, after, sl, facts.items),
        buffer=source.spool.mm if isinstance(source, _SpooledShard) else None,
    )


def _edge_groups(table: GroupRows, first: int, after: int, sl: Slice, items_total: int) -> tuple[int, ...]:
    """The slice's first and last groups where it holds only part of them (a block of the epoch
    starts or stops inside)."""
    if after <= first:
        return ()
    edges = []
    items = table.items
    if items[first] < sl.start:
        edges.append(first)
    last_end = items[after] if after < len(items) else items_total
    if sl.stop is not None and last_end > sl.stop:
        edges.append(after - 1)
    return tuple(edges)


def _streamed_groups(
    dataset: PackedSource, facts: ShardFacts, sl: Slice, skip: int, source: Any, start: GroupStart | None
) -> Iterator[CheckedGroup]:
    """Groups parsed as the shard streams (no checksums): unwanted ones are skipped by their JSON."""
    url = facts.url
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

    end = facts.entry.bytes if facts.entry is not None else None
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
    dataset: PackedSource,
    facts: ShardFacts,
    sl: Slice,
    skip: int,
    source: Any,
    groups: Iterator[CheckedGroup],
    options: ReadOptions,
) -> Iterator[Block]:
    """The slice's items of each group, as blocks (over the whole mapped shard when it is one)."""
    mode = dataset.mode
    seq_len = dataset.index.seq_len if dataset.index else None
    first_wanted = sl.start + skip * sl.stride
    stop = sl.stop
    # a row that continues a document from the previous shard belongs to its last document
    prev_shard_doc = facts.prev_doc
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
