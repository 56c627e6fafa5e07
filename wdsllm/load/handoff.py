"""One short batch per rank: workers hand their tails to their rank's last worker.

A rank's part of the epoch is split among its DataLoader workers, and a worker's batches end
where its share ends: left alone, every worker would end the epoch with its own short batch (with
2 workers and ``batch_size=8``: 8, 1 and 1 rows). Fixed batches avoid it by planning the shares
in whole batches (``plan.consumer_shares``, ``unit``); where a batch is counted in tokens or rows
(token budgets, pack, concat) no share boundary can promise that. So every worker but a rank's
last runs its mode's ``Batcher.handing()``, which yields only full batches, and the items those
leave out (its tail: ``Batcher.tail``) are read by the rank's last worker after its own share.

Nothing crosses between the worker processes: a worker's batches are a pure function of its
share's lengths and its random key, so the last worker finds every other worker's tail from
lengths.npy (or a count sidecar), as the counts do, and the counts, ``len()``, positions and
the elastic remainder all see the same slices through ``slices_for`` and ``batcher_for``.
Where items' lengths are unknown (raw text without a count sidecar) every worker keeps its own
short batch, and the loader merges those (``tails.py``). A worker that hands its tail over and
loses a unit (``on_error="skip"``) still makes exactly its planned batches: the unit's items stay
in its stream as holes (``holes.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from . import plan as planmod
from .batching import COUNT_BY_ITEMS, Batcher
from .plan import Slice
from .sources.protocol import Source
from .stream import (
    PlanLabels,
    StreamSpec,
    has_lengths,
    inverse_shuffle,
    plan_labels,
    shuffle_lengths,
    slice_item_counts,
    slice_item_lengths,
)

if TYPE_CHECKING:
    from .config import Config
    from .counts import EpochPlan


def hands_tails(source: Source, cfg: Config, spec: StreamSpec) -> bool:
    """Whether the workers of ``spec``'s rank hand their tails to its last worker: a batched
    epoch of several workers whose items' lengths are known before reading. An endless stream's
    epochs (``epochs=None``, ``steps_per_epoch``) are planned as finite ones are, so each epoch
    boundary costs a rank one short batch; resampled streams draw without epochs, so no batch
    there is short."""
    return spec.workers > 1 and not cfg.unbatched and not spec.resample and has_lengths(source)


def hands_over(source: Source, cfg: Config, spec: StreamSpec) -> bool:
    """Whether (rank, worker) of ``spec`` yields only full batches and hands over its tail."""
    return spec.worker < spec.workers - 1 and hands_tails(source, cfg, spec)


def batcher_for(source: Source, cfg: Config, spec: StreamSpec, own: list[Slice] | None = None) -> Batcher:
    """The batcher (rank, worker) runs: the mode's, or its ``handing()`` form (``hands_over``).
    ``own``: the worker's share; where it is whole batches of items (``Config.share_unit``) the
    mode's own batcher makes the same batches, and a stream that lost a unit (``on_error="skip"``)
    still yields its last, short one."""
    batcher = cfg.make_batcher()
    if not hands_over(source, cfg, spec):
        return batcher
    if own is not None and batcher.count_by == COUNT_BY_ITEMS:
        counts = slice_item_counts(source, own, spec)
        if counts is not None and sum(counts) % cfg.batch_size == 0:
            return batcher
    return batcher.handing()


def slices_for(source: Source, cfg: Config, spec: StreamSpec, plan: EpochPlan | None = None) -> list[Slice]:
    """The slices (rank, worker) reads in ``spec.epoch``: its share (``plan.slices_for``), and
    for a rank's last worker then every other worker's tail, in worker order."""
    return stream_slices(source, cfg, spec, plan).whole()


def with_tails(
    source: Source, cfg: Config, spec: StreamSpec, share: Callable[[StreamSpec], list[Slice]]
) -> list[Slice]:
    """(rank, worker)'s slices: ``share(spec)``, its own share, and for a rank's last worker
    then the tail of each other worker of the rank (``share`` of that worker's spec)."""
    return _with_tails(source, cfg, spec, share).whole()


def stream_slices(source: Source, cfg: Config, spec: StreamSpec, plan: EpochPlan | None = None) -> StreamSlices:
    """``slices_for``, with the tails found only when they are reached (``StreamSlices``)."""
    return _with_tails(source, cfg, spec, functools.partial(_own_share, source, cfg, plan))


def _own_share(source: Source, cfg: Config, plan: EpochPlan | None, spec: StreamSpec) -> list[Slice]:
    return planmod.slices_for(source, cfg, spec, plan)


def _with_tails(
    source: Source, cfg: Config, spec: StreamSpec, share: Callable[[StreamSpec], list[Slice]]
) -> StreamSlices:
    own = share(spec)
    if spec.worker != spec.workers - 1 or not hands_tails(source, cfg, spec):
        return StreamSlices(own)
    return StreamSlices(own, functools.partial(_tails, source, cfg, spec, share))


def _tails(source: Source, cfg: Config, spec: StreamSpec, share: Callable[[StreamSpec], list[Slice]]) -> list[Slice]:
    """The tails of every worker of ``spec``'s rank but its last, in worker order."""
    out: list[Slice] = []
    for worker in range(spec.workers - 1):
        other = replace(spec, worker=worker)
        out.extend(worker_tail(source, cfg, other, share(other)))
    return out


@dataclass
class StreamSlices:
    """What a worker's stream reads: its own share, then (a rank's last worker) the other
    workers' tails, found only when the stream reaches them (``__iter__``) or when asked for
    whole: the first batch never waits for a pass over the other workers' lengths."""

    own: list[Slice]
    tails: Callable[[], list[Slice]] | None = None
    _found: list[Slice] | None = field(default=None, repr=False)

    def found_tails(self) -> list[Slice]:
        if self._found is None:
            self._found = self.tails() if self.tails is not None else []
        return self._found

    def whole(self) -> list[Slice]:
        return self.own + self.found_tails() if self.tails is not None else self.own

    def __iter__(self) -> Iterator[Slice]:
        yield from self.own
        yield from self.found_tails()


def worker_tail(source: Source, cfg: Config, spec: StreamSpec, slices: list[Slice]) -> list[Slice]:
    """The tail of (rank, worker) of ``spec`` reading ``slices``, as slices that pick its items
    (the one a concat row cut first, with its ``lead``; then the others in plan order)."""
    counts = slice_item_counts(source, slices, spec)
    in_plan, lead = tail_positions(source, cfg, spec, slices, counts)
    if not len(in_plan):
        return []
    out = []
    if lead:
        out = [replace(sl, lead=lead) for sl in picked_slices(slices, counts, in_plan[:1])]
        in_plan = in_plan[1:]
    return out + picked_slices(slices, counts, np.sort(in_plan))


def tail_positions(
    source: Source, cfg: Config, spec: StreamSpec, slices: list[Slice], counts: list[int] | None = None
) -> tuple[np.ndarray, int]:
    """(plan positions of the tail of (rank, worker) of ``spec`` reading ``slices``, in
    shuffled-stream order; tokens of the first that its own batches hold). ``counts``: the
    slices' item counts, where the caller has them (``slice_item_counts`` reads lengths)."""
    batcher = cfg.make_batcher()
    if counts is None:
        counts = slice_item_counts(source, slices, spec)
    if batcher.count_by == COUNT_BY_ITEMS and sum(counts) % cfg.batch_size == 0:
        return np.zeros(0, np.int64), 0  # whole batches of items (``Config.share_unit``): none left out
    if not batcher.needs_lengths:  # the tail follows from the count: only its blocks' orders are made
        n = int(sum(counts))
        positions, lead = batcher.tail(np.broadcast_to(np.int64(0), (n,)), spec)
        labels = PlanLabels.of(source, slices, spec, counts)
        window = None if labels is None else labels.window
        return inverse_shuffle(np.asarray(positions, np.int64), n, spec, source.mixing, window), lead
    lengths = slice_item_lengths(source, slices, spec)
    labels = plan_labels(source, slices, spec)
    shuffled = shuffle_lengths(lengths, spec, source.mixing, labels)
    positions, lead = batcher.tail(shuffled, spec)
    in_plan = inverse_shuffle(np.asarray(positions, np.int64), len(lengths), spec, source.mixing, labels)
    return in_plan, lead


def picked_slices(slices: Sequence[Slice], counts: list[int], positions: np.ndarray) -> list[Slice]:
    """Slices that hold only the items at plan ``positions`` (ascending) of ``slices`` (only the
    slices that hold them are looked at)."""
    positions = np.asarray(positions, np.int64)
    ends = np.cumsum(np.asarray(counts, np.int64))
    positions = positions[positions < (ends[-1] if len(ends) else 0)]
    holding = np.searchsorted(ends, positions, side="right")
    found, firsts = np.unique(holding, return_index=True)
    out = []
    for i, local in zip(found.tolist(), np.split(positions, firsts[1:])):
        sl = slices[i]
        local = local - (ends[i] - counts[i])
        lead = sl.lead if local[0] == 0 else 0
        out.append(replace(sl, pick=local if sl.pick is None else sl.pick[local], lead=lead))
    return out
