"""The plan of an epoch after a change made while it ran: the rest of the epoch, re-planned.

A change that alters what is read (``exclude``, ``set_weights``) takes effect at a planned step:
what every consumer had consumed by then is worked out as an elastic resume works it out (their
batch counts at that step, re-planned over lengths), and the rest of the epoch is planned again
with the change applied: excluded shards, documents or rows (and a mixture's sources) left out,
and a mixture's remaining documents taken in the new proportions as far as they go (the sources
whose share rose set how far: what the others had planned beyond is left for a later pass, and
counted). The epochs after it plan normally, minus what is excluded, with the new weights. No torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import SteeringError
from ..block import ID_SHIFT, pieces_per_doc
from ..plan import Slice
from ..resume import RemainderPlan
from ..runs import Run
from ..slices import Slices
from ..stream import StreamSpec, slice_doc_lengths, slice_item_lengths

#: the most item ids one exclusion may name (each is in every state saved after it)
MAX_EXCLUDED_ITEMS = 1 << 20


@dataclass(frozen=True)
class Leaving:
    """What the rest of the run leaves out, and the weights a re-planned mixture epoch follows:
    ``sources`` (a mixture's, by index), ``shards`` (numbered end to end, as item ids name them),
    ``items`` (item ids: documents, or rows of a packed dataset; sorted)."""

    sources: tuple[int, ...] = ()
    shards: tuple[int, ...] = ()
    items: tuple[int, ...] = ()
    weights: tuple[float, ...] | None = None

    @property
    def empty(self) -> bool:
        return not (self.sources or self.shards or self.items) and self.weights is None

    def excludes(self) -> bool:
        return bool(self.sources or self.shards or self.items)

    def joined(self, other: Leaving) -> Leaving:
        """Both exclusions; the later weights."""
        return Leaving(
            tuple(sorted({*self.sources, *other.sources})),
            tuple(sorted({*self.shards, *other.shards})),
            tuple(sorted({*self.items, *other.items})),
            other.weights if other.weights is not None else self.weights,
        )

    def to_json(self) -> dict:
        out: dict[str, Any] = {"sources": list(self.sources), "shards": list(self.shards), "items": list(self.items)}
        out["weights"] = None if self.weights is None else list(self.weights)
        return out

    @classmethod
    def from_json(cls, d: Any) -> Leaving:
        if not isinstance(d, dict):
            raise SteeringError("a plan's 'leaving' must be an object")
        lists = []
        for key in ("sources", "shards", "items"):
            value = d.get(key)
            if not isinstance(value, list) or len(value) > MAX_EXCLUDED_ITEMS:
                raise SteeringError(f"a plan's 'leaving.{key}' must be a list of at most {MAX_EXCLUDED_ITEMS:,}")
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
                raise SteeringError(f"a plan's 'leaving.{key}' holds something that is not a count")
            lists.append(tuple(sorted(set(value))))
        weights = d.get("weights")
        if weights is not None:
            if not isinstance(weights, list) or not all(_weight(w) for w in weights) or sum(weights) <= 0:
                raise SteeringError("a plan's 'leaving.weights' must be non-negative numbers, not all zero")
            weights = tuple(float(w) for w in weights)
        return cls(*lists, weights)


def units_per_item(source: Any) -> list[float]:
    """A mixture's mean units (tokens, or 1 for items) per item of each source (its planner's sizes)."""
    planner = source.planner
    if planner.mixture.unit != "tokens":
        return [1.0] * len(planner.streams)
    return [size / max(1, stream.size) for size, stream in zip(planner.sizes, planner.streams)]


def _weight(w: Any) -> bool:
    return isinstance(w, (int, float)) and not isinstance(w, bool) and np.isfinite(w) and w >= 0


def _ordinals(source: Any, sl: Slice, spec: StreamSpec) -> np.ndarray:
    """The in-shard ordinal of the document (or row) of each of a slice's items, in plan order."""
    stop = sl.stop if sl.stop is not None else int(source.items_per_shard[sl.shard])
    docs = np.arange(sl.start, stop, sl.stride, dtype=np.int64)
    if source.mode != "packed" and spec.splits(source.mode):
        docs = np.repeat(docs, pieces_per_doc(slice_doc_lengths(source, sl), spec.max_len))
    return docs if sl.pick is None else docs[sl.pick]


def leave_out(source: Any, slices: Sequence[Slice], counts: Sequence[int], leaving: Leaving, spec: StreamSpec):
    """The slices (and their counts) less what ``leaving`` excludes, and (items, tokens) it took
    out. Whole shards (and a mixture's sources) go as columns; only the slices of shards that
    hold an excluded item are looked at one by one."""
    if not leaving.excludes():
        return slices, counts, (0, 0)
    run = Slices.of(slices)
    counts = np.asarray(counts, np.int64)
    shards = np.asarray(leaving.shards, np.int64)
    if leaving.sources and source.mixing is not None:
        of_source = source.mixing.sources_of_shards(run.shards)
        shards = np.union1d(shards, run.shards[np.isin(of_source, np.asarray(leaving.sources, np.int64))])
    items = np.asarray(leaving.items, np.int64)
    dropped = np.isin(run.shards, shards) & (counts > 0)
    gone = [int(counts[dropped].sum()), sum(_tokens(source, run[i], spec) for i in np.flatnonzero(dropped).tolist())]
    keep_counts = counts.copy()
    special: dict[int, Slice] = {}
    for i in np.flatnonzero(~dropped & (counts > 0) & np.isin(run.shards, items >> ID_SHIFT)).tolist():
        sl, n = run[i], int(counts[i])
        ids = (np.int64(sl.shard) << ID_SHIFT) | _ordinals(source, sl, spec)
        hit = np.isin(ids, items)
        keep = np.flatnonzero(~hit)
        if len(keep) < n:
            gone[0], gone[1] = gone[0] + n - len(keep), gone[1] + _tokens(source, sl, spec, hit)
            pick = keep if sl.pick is None else sl.pick[keep]
            special[i] = Slice(sl.shard, sl.start, sl.stop, sl.stride, pick, sl.group, sl.lead)
            keep_counts[i] = len(keep)
    kept = np.flatnonzero(~dropped & (keep_counts > 0))
    out = run.take(kept)  # a copy: ``slices`` may be a plan's, kept
    for i, sl in special.items():
        j = int(np.searchsorted(kept, i))
        out.special[j] = sl
        out.stops[j] = out.starts[j]
    return out, keep_counts[kept].tolist(), (gone[0], gone[1])


def _tokens(source: Any, sl: Slice, spec: StreamSpec, which: np.ndarray | None = None) -> int:
    """Tokens of a slice's items (those ``which`` marks), from the index (0 without lengths)."""
    lengths = slice_item_lengths(source, [sl], spec)
    if lengths is None:
        return 0
    return int(lengths.sum() if which is None else lengths[which].sum())


def reweighted(strands: list[list[Run]], weights: tuple[float, ...], per_item: list[float]) -> list[list[Run]]:
    """Each source's remaining strands cut to the new weights' proportions as far as they go:
    the source that runs out first (for its weight) sets the rest's size, in the mixture's unit
    (``per_item``: each source's mean units an item)."""
    left = [sum(strand[s].total for strand in strands) for s in range(len(weights))]
    total = sum(weights)
    room = min(
        (left[s] * per_item[s] / (weights[s] / total) for s in range(len(weights)) if weights[s] > 0), default=0.0
    )
    quota = [
        min(left[s], int(room * weights[s] / total / per_item[s] + 0.5)) if weights[s] > 0 else 0
        for s in range(len(weights))
    ]
    out = []
    for part in strands:
        kept = []
        for s, strand in enumerate(part):
            take = min(quota[s], strand.total)
            quota[s] -= take
            kept.append(strand.first(take))
        out.append(kept)
    return out


@dataclass
class SteeredPlan(RemainderPlan):
    """Epoch ``epoch`` after a change at the step where the consumers had consumed ``consumed``
    batches of ``base`` (the epoch's plan before it): the rest, less what ``leaving`` excludes and,
    for a mixture, in its weights (see the module's docstring)."""

    leaving: Leaving = field(default_factory=Leaving)
    #: (items, tokens) the exclusions took out of the rest of the epoch, once it was planned
    left_out: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    #: this rank's batches of the rest, where counted ahead of the change's step (steer/ahead.py)
    own_total: int | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {**super().to_json(), "leaving": self.leaving.to_json()}

    def sequence(self, source: Any, cfg: Any):
        if self._sequence is not None:
            return self._sequence
        slices, counts = super().sequence(source, cfg)
        *kept, self.left_out = leave_out(source, slices, counts, self.leaving, cfg.spec(self.epoch, 0, 1, 0, 1))
        self._sequence = tuple(kept)
        return self._sequence

    def excluded(self) -> tuple[int, int]:
        """(items, tokens) the exclusions took out of this epoch so far (of the plans made)."""
        base = super().excluded()
        mine = self.left_out or (0, 0)
        return base[0] + mine[0], base[1] + mine[1]

    def strands(self, source: Any, cfg: Any, slices: list[Slice], counts: list[int]) -> list[list[Run]]:
        parts = super().strands(source, cfg, slices, counts)
        if self.leaving.weights is None:
            return parts
        return reweighted(parts, self.leaving.weights, units_per_item(source))


def excluding_plan(leaving: Leaving, epoch: int) -> SteeredPlan:
    """An epoch planned afresh, less what ``leaving`` excludes (nothing consumed of it yet)."""
    return SteeredPlan(epoch, 1, 1, [[0]], None, leaving=Leaving(leaving.sources, leaving.shards, leaving.items))


def exclusions_of(log: Any, catalog: Any) -> Leaving:
    """Everything the log excludes, as plans name it (sources by index, shards end to end)."""
    names = list(catalog.mixture.names) if catalog.mixing is not None else []
    out = Leaving()
    for ex in log.exclusions:
        out = out.joined(Leaving(tuple(names.index(n) for n in ex.sources), ex.shards, ex.items))
    return out


def steer_plans(log: Any, catalog: Any, epochs: Any = None) -> None:
    """Make ``epochs`` (a ``dataset.EpochSource``; None: a mixture's planner alone, for stats) and
    a mixture's planner plan what the log says for the epochs it shapes from their start:
    exclusions left out, weights from their epoch on."""
    if epochs is not None:
        leaving = exclusions_of(log, catalog)
        epochs.exclude_from(functools.partial(excluding_plan, leaving) if leaving.excludes() else None)
    if catalog.mixing is not None:
        names = list(catalog.mixture.names)
        excluded = [(ex.epoch, names.index(n)) for ex in log.exclusions for n in ex.sources]
        catalog.planner.steer([(w.epoch, w.weights) for w in log.weight_changes], excluded)
        catalog.planner.noted = ()
        for w in log.weight_changes:
            catalog.planner.note(w.point, w.weights)


__all__ = ["Leaving", "SteeredPlan", "excluding_plan", "exclusions_of", "leave_out", "reweighted", "steer_plans"]
