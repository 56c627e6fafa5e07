"""One worker's item stream for one epoch: plan -> read -> split long documents -> shuffle.

Positions are what make resumption exact and cheap. The *plan stream* is the worker's items in
plan order (after load-time splitting, pieces count as items), numbered 0, 1, ...; the *shuffled
stream* permutes consecutive blocks of ``shuffle_buffer`` plan positions with a generator keyed by
(seed, epoch, rank, worker, block). Position p of the shuffled stream therefore depends only on
block p // shuffle_buffer, and a stream can start at any p by reading from that block's first
plan position: no state but an integer, and at most one buffer re-read.

The shuffle is blockwise (as infinibatch's): each buffer of items is drawn in a random order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from . import plan as planmod
from .catalog import Catalog
from .items import Block, ReadOptions, concat_blocks, read_slice
from .plan import Slice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSpec:
    """Everything that decides a worker's stream in one epoch."""

    seed: int
    epoch: int
    rank: int
    world: int
    worker: int
    workers: int
    shuffle: bool = True  # shuffle the shard order
    shuffle_buffer: int = 0  # items per shuffled block; 0 or 1 keeps plan order
    max_len: int | None = None
    max_len_mode: str = "split"  # or "truncate"
    resample: bool = False

    @property
    def consumer(self) -> int:
        return self.rank * self.workers + self.worker


def epoch_slices(catalog: Catalog, spec: StreamSpec) -> list[Slice]:
    return planmod.plan_epoch(
        catalog.items_per_shard,
        len(catalog.urls),
        seed=spec.seed,
        epoch=spec.epoch,
        rank=spec.rank,
        world=spec.world,
        worker=spec.worker,
        workers=spec.workers,
        shuffle=spec.shuffle,
    )


def _splits(spec: StreamSpec, catalog: Catalog) -> bool:
    return spec.max_len is not None and spec.max_len_mode == "split" and catalog.mode == "docs"


def slice_item_lengths(catalog: Catalog, slices: list[Slice], spec: StreamSpec) -> np.ndarray | None:
    """Token lengths of the plan stream's items (pieces after splitting), in plan order; None
    without an index. This is how counts are known before any shard is read."""
    if catalog.mode == "packed":
        if catalog.shard_entries is None:
            return None
        seq_len = catalog.index.seq_len
        out = []
        for sl in slices:
            e = catalog.shard_entries[sl.shard]
            rows = np.full(e.rows, seq_len, np.int64)
            if e.rows:
                rows[-1] = e.tokens - seq_len * (e.rows - 1)
            out.append(rows[sl.start : sl.stop : sl.stride])
        return np.concatenate(out) if out else np.zeros(0, np.int64)
    by_shard = catalog.lengths_by_shard()
    if by_shard is None:
        return None
    parts = [by_shard[sl.shard][sl.start : sl.stop : sl.stride] for sl in slices]
    lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if spec.max_len is not None and catalog.mode == "docs":
        m = spec.max_len
        if spec.max_len_mode == "split":
            counts = (lengths + m - 1) // m
            reps = np.repeat(lengths, counts)
            piece = np.arange(len(reps)) - np.repeat(np.cumsum(counts) - counts, counts)
            lengths = np.minimum(m, reps - piece * m)
        else:
            lengths = np.minimum(lengths, m)
    return lengths


def shuffle_lengths(lengths: np.ndarray, spec: StreamSpec) -> np.ndarray:
    """Plan-order lengths in shuffled-stream order: the same block permutations as the stream."""
    size = spec.shuffle_buffer
    if size <= 1 or len(lengths) == 0:
        return lengths
    out = np.empty_like(lengths)
    for k, a in enumerate(range(0, len(lengths), size)):
        block = lengths[a : a + size]
        perm = planmod.rng(spec.seed, planmod.STREAM_SAMPLE_SHUFFLE, spec.epoch, spec.rank, spec.worker, k).permutation(len(block))
        out[a : a + len(block)] = block[perm]
    return out


def slice_item_counts(catalog: Catalog, slices: list[Slice], spec: StreamSpec) -> list[int] | None:
    """Items of each slice in the plan stream (pieces counted)."""
    if not _splits(spec, catalog):
        counts = [sl.count for sl in slices]
        return None if any(c is None for c in counts) else counts
    by_shard = catalog.lengths_by_shard()
    if by_shard is None:
        return None
    m = spec.max_len
    return [int(((by_shard[sl.shard][sl.start : sl.stop : sl.stride] + m - 1) // m).sum()) for sl in slices]


def _apply_max_len(block: Block, spec: StreamSpec) -> tuple[Block, int]:
    """Split (or truncate) items longer than max_len; returns the block and truncated tokens."""
    m = spec.max_len
    if m is None or len(block) == 0 or int(block.lengths.max()) <= m:
        return block, 0
    if spec.max_len_mode == "truncate":
        cut = int(np.maximum(block.lengths - m, 0).sum())
        out = Block(block.tokens, block.starts, np.minimum(block.lengths, m), block.ids, block.pieces, block.seg_ptr, block.seg_starts, block.seg_ids)
        return out, cut
    counts = (block.lengths + m - 1) // m
    item = np.repeat(np.arange(len(block)), counts)
    piece = np.arange(len(item)) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = block.starts[item] + piece * m
    lengths = np.minimum(m, block.lengths[item] - piece * m)
    base_piece = block.pieces[item] if block.pieces is not None else 0
    return Block(block.tokens, starts, lengths, block.ids[item], (base_piece + piece).astype(np.int64)), 0


class StreamStats:
    """Tallies a worker reports with its batches (tokens cut by max_len='truncate')."""

    def __init__(self) -> None:
        self.truncated_tokens = 0


def plan_items(
    catalog: Catalog,
    slices: list[Slice] | Iterator[Slice],
    spec: StreamSpec,
    *,
    start: int = 0,
    options: ReadOptions | None = None,
    stats: StreamStats | None = None,
) -> Iterator[Block]:
    """The plan stream from plan position ``start``: blocks of items in plan order.

    With counts from the index, slices before ``start`` are not opened and the slice holding it
    is entered by skipping groups; without them the items before ``start`` are read and dropped.
    """
    counts = slice_item_counts(catalog, slices, spec) if isinstance(slices, list) else None
    split = _splits(spec, catalog)
    pos = 0  # plan position of the current slice's first item
    for k, sl in enumerate(slices):
        n = counts[k] if counts is not None else None
        if n is not None and pos + n <= start:
            pos += n
            continue
        skip_items = max(0, start - pos)
        skip_docs, drop = 0, 0
        if skip_items and n is None:
            drop = skip_items
        elif skip_items and split:
            # an item offset counts pieces: convert it into whole documents plus pieces
            lengths = catalog.lengths_by_shard()[sl.shard][sl.start : sl.stop : sl.stride]
            pieces_through = np.cumsum((lengths + spec.max_len - 1) // spec.max_len)
            skip_docs = int(np.searchsorted(pieces_through, skip_items, side="right"))
            drop = skip_items - (int(pieces_through[skip_docs - 1]) if skip_docs else 0)
        else:
            skip_docs = skip_items
        seen = skip_docs if not split else skip_items - drop
        for block in read_slice(catalog, sl, skip=skip_docs, options=options):
            if catalog.mode == "docs":
                block, cut = _apply_max_len(block, spec)
                if stats is not None:
                    stats.truncated_tokens += cut
            seen += len(block)
            if drop:
                take = min(drop, len(block))
                drop -= take
                block = block.slice(take, len(block))
            if len(block):
                yield block
        pos += n if n is not None else seen


def shuffled_items(
    blocks_from,
    spec: StreamSpec,
    *,
    start: int = 0,
) -> Iterator[tuple[int, Block]]:
    """(shuffled position of the block's first item, block) from shuffled position ``start``.

    ``blocks_from(plan_position)`` opens the plan stream at a plan position.
    """
    size = spec.shuffle_buffer
    if size <= 1:
        pos = start
        for block in blocks_from(start):
            yield pos, block
            pos += len(block)
        return
    k = start // size
    skip = start - k * size
    pending: list[Block] = []
    have = 0
    src = blocks_from(k * size)

    def emit(blocks: list[Block], n: int, k: int):
        buf = concat_blocks(blocks)
        perm = planmod.rng(spec.seed, planmod.STREAM_SAMPLE_SHUFFLE, spec.epoch, spec.rank, spec.worker, k).permutation(n)
        return buf.take(perm)

    for block in src:
        while len(block):
            take = min(size - have, len(block))
            pending.append(block.slice(0, take) if take < len(block) else block)
            block = block.slice(take, len(block)) if take < len(block) else block.slice(0, 0)
            have += take
            if have == size:
                out = emit(pending, size, k)
                if skip:
                    out = out.slice(skip, size)
                yield k * size + skip, out
                skip = 0
                k += 1
                pending, have = [], 0
    if have:
        out = emit(pending, have, k)
        if skip < have:
            yield k * size + skip, out.slice(skip, have)
