"""Slices with their item counts, cut and dealt as columns.

A mixture's consumer reads each source's part of its share in rounds of a shuffle block: a
share of 1e8 documents over 1,000 sources is a million pieces of slices. Cutting them one
``Slice`` at a time took seconds at every plan and every re-plan (a resume, a change of
weights, an exclusion); here the cuts are numpy over the columns of ``Slices``, and only the
few slices that are not plain ranges (picks) are made one by one. Pure numpy, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .slices import Slice, Slices


@dataclass
class Run:
    """Slices in order with the items of each (pieces counted where documents split)."""

    slices: Slices
    counts: np.ndarray
    _ends: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def of(cls, slices: Sequence[Slice], counts: Sequence[int] | np.ndarray) -> Run:
        return cls(Slices.of(slices), np.asarray(counts, np.int64).reshape(-1))

    @property
    def ends(self) -> np.ndarray:
        if self._ends is None:
            self._ends = np.cumsum(self.counts)
        return self._ends

    @property
    def total(self) -> int:
        return int(self.ends[-1]) if len(self.counts) else 0

    def cut(self, a: int, b: int, split: bool) -> Slices:
        """Items [a, b) in order; a cut inside a slice becomes a range (or a pick where documents
        split, or the slice picks already)."""
        return self.pieces(np.asarray([a, b], np.int64), split)[0].slices

    def first(self, n: int) -> Run:
        """Its first ``n`` items (a slice cut there becomes a pick)."""
        if n >= self.total:
            return self
        return self.pieces(np.asarray([0, max(0, n)], np.int64), True)[0]

    def pieces(self, points: np.ndarray, split: bool) -> tuple[Run, np.ndarray]:
        """The items between the first and the last of the rising ``points``, cut at every point:
        the pieces (each inside one slice and one span between two points), and each piece's span."""
        points = np.clip(np.asarray(points, np.int64), 0, self.total)
        pieces, firsts = self._cut(points, split)
        return pieces, np.searchsorted(points, firsts, side="right") - 1

    def _cut(self, points: np.ndarray, split: bool) -> tuple[Run, np.ndarray]:
        """The items between the first and the last of ``points`` (rising, within the run), cut at
        every point and slice edge, and the first item of each piece."""
        if len(points) < 2 or points[-1] <= points[0]:
            return Run(_empty(), np.zeros(0, np.int64)), np.zeros(0, np.int64)
        ends = self.ends
        begins = ends - self.counts
        inside = begins[(self.counts > 0) & (begins > points[0]) & (begins < points[-1])]
        bounds = np.sort(np.concatenate([points, inside]), kind="stable")  # two sorted runs merged
        bounds = bounds[np.r_[True, bounds[1:] != bounds[:-1]]]
        p, q = bounds[:-1], bounds[1:]
        k = np.searchsorted(ends, p, side="right")  # the slice that holds item p (empty ones skipped)
        lo, hi = p - begins[k], q - begins[k]
        run = self.slices
        whole = (lo == 0) & (hi == self.counts[k])
        starts, stops = run.starts[k] + lo, run.starts[k] + hi
        starts[whole], stops[whole] = run.starts[k][whole], run.stops[k][whole]
        groups = None if run.groups is None else run.groups[k]
        special: dict[int, Slice] = {}
        odd = np.flatnonzero(~whole) if split else np.zeros(0, np.int64)
        if run.special:
            odd = np.union1d(odd, np.flatnonzero(run.is_special(k)))
        for i in odd.tolist():
            special[i] = _piece(run[int(k[i])], int(lo[i]), int(hi[i]), int(self.counts[k[i]]), split)
            starts[i] = stops[i] = run.starts[k[i]]
        return Run(Slices(run.shards[k], starts, stops, special, groups), hi - lo), p


def _empty() -> Slices:
    return Slices(*(np.zeros(0, np.int64),) * 3)


def _piece(sl: Slice, lo: int, hi: int, n: int, split: bool) -> Slice:
    """Items [lo, hi) of a slice of ``n`` items, made one by one (``Run.pieces``' odd cases)."""
    if lo == 0 and hi == n:
        return sl
    if sl.pick is not None:
        return Slice(sl.shard, sl.start, sl.stop, sl.stride, sl.pick[lo:hi], sl.group)
    if not split and sl.stride == 1 and sl.stop is not None:
        return Slice(sl.shard, sl.start + lo, sl.start + hi, group=sl.group)
    return Slice(sl.shard, sl.start, sl.stop, sl.stride, np.arange(lo, hi), sl.group)


def deal(runs: Sequence[Run], cuts: np.ndarray, split: bool) -> Slices:
    """Round after round, run after run inside a round: run s's items [cuts[s, r], cuts[s, r+1])
    in round r (``cuts``: [runs, rounds + 1], rising along each row). The runs are cut as one,
    end to end, so the work is numpy over every slice at once, not a pass per run."""
    if not len(runs):
        return _empty()
    totals = np.asarray([run.total for run in runs], np.int64)
    cuts = np.clip(np.asarray(cuts, np.int64), 0, totals[:, None])
    width = cuts.shape[1]
    points = (cuts + (np.cumsum(totals) - totals)[:, None]).ravel()  # rising: the runs end to end
    joined = Run(Slices.join([run.slices for run in runs]), np.concatenate([run.counts for run in runs]))
    pieces, firsts = joined._cut(points, split)
    at = np.searchsorted(points, firsts, side="right") - 1  # run at // width, round at % width
    taken = np.flatnonzero(at % width != width - 1)  # not between one run's last cut and the next's first
    order = taken[np.argsort((at[taken] % width) * len(runs) + at[taken] // width, kind="stable")]
    return pieces.slices.take(order)


def remaining(run: Run, consumed: np.ndarray) -> Slices:
    """The slices less the items at plan positions ``consumed`` (sorted, unique); a slice partly
    consumed keeps a pick of the rest, one wholly consumed is left out (an empty one is kept)."""
    consumed = np.asarray(consumed, np.int64)
    ends = run.ends
    begins = ends - run.counts
    gone = np.searchsorted(consumed, ends) - np.searchsorted(consumed, begins)
    kept = np.flatnonzero((gone == 0) | (gone < run.counts))
    out = run.slices.take(kept)
    for j in np.flatnonzero(gone[kept] > 0).tolist():
        i = int(kept[j])
        sl, n = run.slices[i], int(run.counts[i])
        lo, hi = np.searchsorted(consumed, [begins[i], ends[i]])
        keep = np.setdiff1d(np.arange(n), consumed[lo:hi] - begins[i], assume_unique=True)
        pick = keep if sl.pick is None else sl.pick[keep]
        out.special[j] = Slice(sl.shard, sl.start, sl.stop, sl.stride, pick, sl.group)
        out.stops[j] = out.starts[j]
    return out


def strands(run: Run, sources_of_shards, sources: int) -> list[list[Run]]:
    """Per part of the epoch (rising), per source (``sources_of_shards``: a shard's source): that
    source's slices and counts, in order."""
    groups = run.slices.group_column()
    parts = np.unique(groups)
    key = np.searchsorted(parts, groups) * sources + sources_of_shards(run.slices.shards)
    order = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[order], np.arange(len(parts) * sources + 1))
    out = []
    for g in range(len(parts)):
        row = []
        for s in range(sources):
            at = order[bounds[g * sources + s] : bounds[g * sources + s + 1]]
            row.append(Run(run.slices.take(at), run.counts[at]))
        out.append(row)
    return out


__all__ = ["Run", "deal", "remaining", "strands"]
