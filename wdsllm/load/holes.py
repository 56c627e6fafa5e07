"""Holes: the items of a unit lost under ``on_error="skip"``, kept in their planned places.

A worker's batches and positions are functions of its plan: a worker that hands its tail to its
rank's last worker (``handoff.py``) must yield exactly the batches its plan makes, since the last
worker reads the items those leave out, found from lengths alone; and a resume starts a worker at
the plan position of its next batch. Were a lost unit's items simply missing, every later item
would move: the full batches would no longer be the planned ones (part of the planned tail lost,
part twice) and a saved position would name other items. So, where items' lengths are known,
every worker's stream puts a hole of the planned length in each lost item's place, its batcher
makes the planned batches, and the holes are taken out of each batch (``drop_holes``) before it is
sent: only the lost unit's items are missing. A batch of holes only is not sent; it keeps its
number, and the hint of the worker's next batch counts it (``LOST_KEY``), so a resume counts it
out of the batches handed out and into the repeats owed under equal batches.
"""

from __future__ import annotations

import logging

import numpy as np

from .block import Block

#: the id of a hole (real ids are >= 0; -1 marks a segment of no known document)
HOLE_ID = -2

log = logging.getLogger(__name__)


def hole_block(lengths: np.ndarray, dtype: np.dtype, packed: bool) -> Block:
    """Holes of the given planned ``lengths`` (zero tokens; ``packed``: rows with no segments)."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    starts = np.cumsum(lengths) - lengths
    block = Block(np.zeros(int(lengths.sum()), dtype), starts, lengths.copy(), np.full(n, HOLE_ID, np.int64))
    if packed:
        block.doc_first = np.full(n, HOLE_ID, np.int64)
        block.doc_next = np.full(n, HOLE_ID, np.int64)
        block.doc_count = np.zeros(n, np.int64)
        z = np.zeros(0, np.int64)
        block.set_segments(np.zeros(n + 1, np.int64), z, z, z)
    return block


def drop_holes(block: Block) -> Block:
    """``block`` without its holes: hole items left out, and hole segments cut out of rows made
    of several items (pack, concat), rows left empty dropped."""
    keep = block.ids != HOLE_ID
    if not keep.all():
        block = block.take(np.flatnonzero(keep))
    if block.seg_lo is None or not len(block):
        return block
    counts, src = block.segments()
    if not np.any(block.seg_ids[src] == HOLE_ID):
        return block
    return _rows_without_holes(block, counts, src)


def _rows_without_holes(block: Block, counts: np.ndarray, src: np.ndarray) -> Block:
    """Rows rebuilt from their segments that are not holes (segments in row order: ``src``)."""
    row = np.repeat(np.arange(len(block)), counts)
    seg_start = block.seg_starts[src]
    seg_end = np.append(seg_start[1:], 0)
    ends = np.cumsum(counts) - 1
    held = counts > 0
    seg_end[ends[held]] = block.lengths[held]
    keep = block.seg_ids[src] != HOLE_ID
    row, seg_start, seg_len = row[keep], seg_start[keep], (seg_end - seg_start)[keep]
    at = block.starts[row] + seg_start
    before = np.cumsum(seg_len) - seg_len
    total = int(seg_len.sum())
    tokens = block.tokens[np.repeat(at - before, seg_len) + np.arange(total)]
    row_len = np.bincount(row, weights=seg_len, minlength=len(block)).astype(np.int64)
    rows = np.flatnonzero(row_len)
    new_counts = np.bincount(row, minlength=len(block))[rows]
    row_starts = np.cumsum(row_len[rows]) - row_len[rows]
    out = Block(
        tokens,
        row_starts,
        row_len[rows],
        block.ids[rows],
        None if block.pieces is None else block.pieces[rows],
    )
    return out.set_segments(
        np.concatenate([[0], np.cumsum(new_counts)]).astype(np.int64),
        before - np.repeat(row_starts, new_counts),
        block.seg_ids[src][keep],
        seg_len,
    )


class HoleCut:
    """Holes cut out of one worker task's batches (``drop_holes``), and what they cost, logged
    once per task (``report``) beside the unit's own warning and its count in
    ``loader.skipped_shards``. A batch that held holes comes smaller, and one of holes only is
    not sent: filling them from the following items would move every later item off its planned
    place (the tail handoff and positions need those), and filling them with repeats would break
    exactly-once for the readable units."""

    def __init__(self) -> None:
        self.batches = 0  # batches that held holes
        self.holes = 0  # their items, or their rows' segments, cut out

    def cut(self, block: Block) -> Block:
        holes = _holes_in(block)
        if not holes:
            return block
        self.batches += 1
        self.holes += holes
        return drop_holes(block)

    def report(self, worker: int, rank: int, epoch: int) -> None:
        if self.batches:
            log.warning(
                "worker %d of rank %d, epoch %d: %d batch(es) lost %d item(s) or row segment(s) of unreadable units "
                "and come smaller (on_error='skip')",
                worker,
                rank,
                epoch,
                self.batches,
                self.holes,
            )


def _holes_in(block: Block) -> int:
    """Hole items of ``block``, or hole segments of its rows."""
    holes = int(np.count_nonzero(block.ids == HOLE_ID))
    if block.seg_lo is not None and len(block):
        holes += int(np.count_nonzero(block.seg_ids[block.segments()[1]] == HOLE_ID))
    return holes


#: the hint key of the batches of a worker's epoch so far that held holes only (numbered, never
#: sent): a resume counts them into the worker's end (its refills) and out of its batches handed out
LOST_KEY = "lost"


def lost_batches(hint: dict | None) -> int:
    """Batches of holes only before the position whose hint this is (0 without a note)."""
    return int(hint[LOST_KEY]) if hint and LOST_KEY in hint else 0


def without_lost(hint: dict | None) -> dict | None:
    """``hint`` without its count of lost batches."""
    if not hint or LOST_KEY not in hint:
        return hint
    rest = {k: v for k, v in hint.items() if k != LOST_KEY}
    return rest or None


def with_lost(hint: dict | None, lost: int) -> dict | None:
    """``hint`` noting ``lost`` batches of holes only before it (nothing noted for none)."""
    return {**(hint or {}), LOST_KEY: lost} if lost else hint
