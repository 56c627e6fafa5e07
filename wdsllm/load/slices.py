"""A consumer's slices: what one (rank, worker) reads of an epoch, in reading order.

A share of an epoch of a million shards is a million slices. Held as ``Slice`` objects they
cost seconds to make and hundreds of megabytes; held as ``Slices`` they are three int64 columns
(shard, start, stop) and a ``Slice`` is made only when the stream reaches it. The few slices
that are not plain ranges (a pick, a stride, a lead, an open end) are kept whole beside the
columns, by position; a mixture's part (``group``) is a fourth column.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

#: slices made into objects at a time while iterating ``Slices``
ITER_CHUNK = 4096


@dataclass(eq=False)
class Slice:
    """Items [start, stop) of one shard, every ``stride``-th one from ``start`` (stop None: to the end).

    ``pick`` (sorted positions within the slice's item sequence, pieces counted) keeps only those
    items: how the remainder of an interrupted epoch is re-planned for a new layout, and how a
    share starts or stops inside a split document. ``group`` numbers the part of a mixture's
    epoch (between schedule points) the slice belongs to: a shuffle block never interleaves two
    parts, so a weight change takes effect where it says. ``lead``: tokens of the slice's first
    item that an earlier row already holds (the tail a worker hands to its rank's last worker
    may start inside a document that a concat row cut).
    """

    shard: int
    start: int = 0
    stop: int | None = None
    stride: int = 1
    pick: np.ndarray | None = None
    group: int = 0
    lead: int = 0

    @property
    def count(self) -> int | None:
        if self.pick is not None:
            return len(self.pick)
        if self.stop is None:
            return None
        return max(0, (self.stop - self.start + self.stride - 1) // self.stride)

    def key(self) -> tuple:
        return (
            self.shard,
            self.start,
            self.stop,
            self.stride,
            None if self.pick is None else tuple(self.pick.tolist()),
            self.lead,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Slice) and self.key() == other.key()

    def is_range(self) -> bool:
        """Whether the slice is items [start, stop) of a part of the epoch and nothing more (a
        column entry of ``Slices``)."""
        return self.pick is None and self.stop is not None and self.stride == 1 and self.lead == 0


class Slices(Sequence):
    """Slices in reading order: plain ranges as int64 columns, any other slice kept whole in
    ``special`` (position -> Slice; its column entry holds its shard, an empty range and its
    group). ``groups`` (None: all 0) is each slice's part of a mixture's epoch. Compares equal
    to any sequence of the same slices."""

    def __init__(
        self,
        shards: np.ndarray,
        starts: np.ndarray,
        stops: np.ndarray,
        special: dict[int, Slice] | None = None,
        groups: np.ndarray | None = None,
    ):
        self.shards = np.asarray(shards, np.int64)
        self.starts = np.asarray(starts, np.int64)
        self.stops = np.asarray(stops, np.int64)
        self.special = special or {}
        self.groups = None if groups is None or not np.any(groups) else np.asarray(groups, np.int64)
        self._listed: np.ndarray | None = None  # the special positions, sorted (``is_special``)

    def group_column(self) -> np.ndarray:
        """Each slice's part of the epoch."""
        return np.zeros(len(self.shards), np.int64) if self.groups is None else self.groups

    @classmethod
    def of(cls, slices: Iterable[Slice]) -> Slices:
        """``slices`` as Slices (itself when it is one)."""
        if isinstance(slices, Slices):
            return slices
        listed = list(slices)
        columns = np.zeros((4, len(listed)), np.int64)
        special = {}
        for i, sl in enumerate(listed):
            if sl.is_range():
                columns[:, i] = (sl.shard, sl.start, sl.stop, sl.group)
            else:
                columns[:, i] = (sl.shard, sl.start, sl.start, sl.group)
                special[i] = sl
        return cls(columns[0], columns[1], columns[2], special, columns[3])

    @classmethod
    def join(cls, parts: Iterable[Iterable[Slice]]) -> Slices:
        """The parts one after the other."""
        runs = [cls.of(p) for p in parts]
        special: dict[int, Slice] = {}
        base = 0
        for run in runs:
            special.update({base + i: sl for i, sl in run.special.items()})
            base += len(run)

        def column(name: str) -> np.ndarray:
            return np.concatenate([getattr(r, name) for r in runs]) if runs else np.zeros(0, np.int64)

        groups = None
        if any(r.groups is not None for r in runs):
            groups = np.concatenate([r.group_column() for r in runs])
        return cls(column("shards"), column("starts"), column("stops"), special, groups)

    def take(self, order: np.ndarray) -> Slices:
        """The slices at positions ``order`` (each at most once), in that order."""
        order = np.asarray(order, np.int64)
        special = {}
        if self.special:  # a look at each taken position, not at every slice
            special = {j: self.special[int(order[j])] for j in np.flatnonzero(self.is_special(order)).tolist()}
        groups = None if self.groups is None else self.groups[order]
        return Slices(self.shards[order], self.starts[order], self.stops[order], special, groups)

    def is_special(self, positions: np.ndarray) -> np.ndarray:
        """Whether each of ``positions`` holds a slice kept whole (a search in the sorted special
        positions, made once: no hashing of ``positions``)."""
        if not self.special:
            return np.zeros(len(positions), bool)
        if self._listed is None or len(self._listed) != len(self.special):
            self._listed = np.sort(np.fromiter(self.special, np.int64, len(self.special)))
        at = np.minimum(np.searchsorted(self._listed, positions), len(self._listed) - 1)
        return self._listed[at] == positions

    def ranges(self) -> np.ndarray:
        """Positions of the plain ranges (every slice not in ``special``)."""
        if not self.special:
            return np.arange(len(self.shards))
        keep = np.ones(len(self.shards), bool)
        keep[list(self.special)] = False
        return np.flatnonzero(keep)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, i):
        if isinstance(i, slice):
            picked = range(len(self))[i]
            if picked.step != 1:
                return [self[j] for j in picked]
            a, b = picked.start, picked.stop
            special = {k - a: sl for k, sl in self.special.items() if a <= k < b}
            groups = None if self.groups is None else self.groups[a:b]
            return Slices(self.shards[a:b], self.starts[a:b], self.stops[a:b], special, groups)
        i = range(len(self))[i]
        found = self.special.get(i)
        if found is not None:
            return found
        group = 0 if self.groups is None else int(self.groups[i])
        return Slice(int(self.shards[i]), int(self.starts[i]), int(self.stops[i]), group=group)

    def __iter__(self) -> Iterator[Slice]:
        special = self.special
        groups = self.group_column()
        for at in range(0, len(self), ITER_CHUNK):
            rows = zip(
                self.shards[at : at + ITER_CHUNK].tolist(),
                self.starts[at : at + ITER_CHUNK].tolist(),
                self.stops[at : at + ITER_CHUNK].tolist(),
                groups[at : at + ITER_CHUNK].tolist(),
            )
            for k, (shard, start, stop, group) in enumerate(rows, at):
                yield special[k] if k in special else Slice(shard, start, stop, group=group)

    def __add__(self, other: Iterable[Slice]) -> Slices:
        return Slices.join([self, other])

    def __radd__(self, other: Iterable[Slice]) -> Slices:
        return Slices.join([other, self])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Slices({len(self)} slices, {len(self.special)} not plain ranges)"
