"""Batch counts from the index alone: per worker, per rank, and the equal-batches decision.

Everything a worker does in an epoch is decided by (seed, epoch, rank, worker) and the index, so
the number of batches every (rank, worker) will produce is known before any shard is read. With
equal batches each rank stops after the same count N, and because each worker knows how many of
the rank's first N batches are its own (DataLoader takes them round-robin), the cap works inside
the workers: a plain ``torch.utils.data.DataLoader`` also yields exactly N batches per rank, and
no rank waits on another. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .catalog import Catalog
from .config import Config
from .plan import Slice
from .stream import StreamSpec, epoch_slices, shuffle_lengths, slice_item_counts, slice_item_lengths


class EpochPlan(Protocol):
    """A plan that replaces an epoch's normal one (the remainder of an interrupted epoch)."""

    def slices_for(
        self, catalog: Catalog, cfg: Config, rank: int, world: int, worker: int, workers: int
    ) -> list[Slice]:
        """The slices (rank, worker) reads, in reading order."""
        ...


def slices_for(catalog: Catalog, cfg: Config, spec: StreamSpec, plan: EpochPlan | None = None) -> list[Slice]:
    """The slices (rank, worker) reads in spec.epoch: the normal plan, or ``plan``'s."""
    if plan is None:
        return epoch_slices(catalog, spec)
    return plan.slices_for(catalog, cfg, spec.rank, spec.world, spec.worker, spec.workers)


def worker_batch_count(catalog: Catalog, cfg: Config, spec: StreamSpec, plan: EpochPlan | None = None) -> int | None:
    """Batches (rank, worker) yields in the epoch, from the index alone; None if unknown."""
    slices = slices_for(catalog, cfg, spec, plan)
    batcher = cfg.make_batcher()
    counts = slice_item_counts(catalog, slices, spec)
    if counts is None:
        return None
    lengths = None
    if batcher.needs_lengths:
        lengths = slice_item_lengths(catalog, slices, spec)
        if lengths is None:
            return None
        lengths = shuffle_lengths(lengths, spec)
    return batcher.count(int(sum(counts)), lengths)


def batch_counts(
    catalog: Catalog, cfg: Config, epoch: int, world: int, workers: int, plan: EpochPlan | None = None
) -> np.ndarray | None:
    """[world, workers] batch counts for a finite epoch, or None when the index cannot say."""
    workers = max(1, workers)
    out = np.zeros((world, workers), np.int64)
    for r in range(world):
        for w in range(workers):
            c = worker_batch_count(catalog, cfg, cfg.spec(epoch, r, world, w, workers), plan)
            if c is None:
                return None
            out[r, w] = c
    return out


def round_robin_share(counts: np.ndarray, total: int) -> np.ndarray:
    """How many of the first ``total`` batches, taken round-robin over workers that still have
    batches (DataLoader's order), come from each worker."""
    counts = np.asarray(counts, np.int64)
    if total >= counts.sum():
        return counts.copy()
    lo, hi = 0, int(counts.max())
    while lo < hi:  # the most full rounds that fit
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, mid).sum() <= total:
            lo = mid
        else:
            hi = mid - 1
    share = np.minimum(counts, lo)
    rest = total - int(share.sum())
    for w in np.nonzero(counts > lo)[0][:rest]:
        share[w] += 1
    return share


def equalised(counts: np.ndarray) -> np.ndarray:
    """[world, workers] counts capped so that every rank yields the smallest rank's total."""
    per_rank = int(counts.sum(axis=1).min())
    return np.stack([round_robin_share(c, per_rank) for c in counts])


@dataclass
class EpochLimits:
    """The equal-batches decision for one epoch."""

    per_rank: int  # batches every rank yields
    per_worker: np.ndarray  # [workers] of this rank's share
    dropped_batches: int  # this rank's batches beyond per_rank


def epoch_limits(
    catalog: Catalog, cfg: Config, epoch: int, rank: int, world: int, workers: int, plan: EpochPlan | None = None
) -> EpochLimits | None:
    """Where this rank's workers stop so that every rank yields the same count; None when the
    index cannot count the batches."""
    counts = batch_counts(catalog, cfg, epoch, world, workers, plan)
    if counts is None:
        return None
    mine = counts[rank]
    per_rank = int(counts.sum(axis=1).min())
    return EpochLimits(
        per_rank=per_rank, per_worker=round_robin_share(mine, per_rank), dropped_batches=int(mine.sum()) - per_rank
    )
