"""Documents' lengths unit by unit (``protocol.DocumentLengths``): from an index's lengths.npy,
from raw text's count sidecar, or a mixture's sources' end to end. Pure numpy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...format.side import SideArray
from .protocol import DocumentLengths


def doc_range(docs: np.ndarray, starts: np.ndarray, unit: int, start: int, stop: int | None) -> tuple[int, int]:
    """Where documents [start, stop) of ``unit`` are in a file of every document's length
    (``docs``: documents per unit, ``starts``: where each unit's begin)."""
    n = int(docs[unit])
    stop = n if stop is None else min(int(stop), n)
    base = int(starts[unit])
    return base + max(0, int(start)), base + stop


class IndexLengths:
    """lengths.npy as the units' lengths: a checked, memory-mapped side file read in ranges (each
    range checked once per process), never held whole in Python objects.

    ``docs``/``starts``: the source's units' documents and where they begin in lengths.npy;
    ``every_unit``: the source is the whole index, in index order, so ``whole`` is the map itself.
    """

    def __init__(self, side: SideArray, docs: np.ndarray, starts: np.ndarray, every_unit: bool):
        self.side = side
        self.docs = docs
        self.starts = starts
        self.every_unit = every_unit

    def of_unit(self, unit: int, start: int = 0, stop: int | None = None, *, check: bool = True) -> np.ndarray:
        a, b = doc_range(self.docs, self.starts, unit, start, stop)
        return self.side.read(a, b, check=check).astype(np.int64)

    def sums(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, list]:
        first = self.starts[units]
        a = first + np.asarray(starts, np.int64)
        b = first + np.asarray(stops, np.int64)
        read = [(lo, hi) for lo, hi in zip(a.tolist(), b.tolist()) if hi > lo]
        return self.side.range_sums(a, b), read

    def check(self, read: list) -> None:
        for a, b in read:
            self.side.check_range(a, b)

    def whole(self) -> np.ndarray:
        """The uint32 map of lengths.npy itself when the source is the whole index (never widened,
        never copied: processes share its pages), else the source's units' parts joined."""
        if self.every_unit:
            return self.side.array()
        parts = [self.of_unit(i).astype(np.uint32) for i in range(len(self.docs))]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)


class CountedLengths:
    """A count sidecar's lengths (raw text): an array checked whole when the sidecar was read, so
    nothing read from it is left to check."""

    def __init__(self, lengths: np.ndarray, docs: np.ndarray, starts: np.ndarray):
        self.lengths = lengths
        self.docs = docs
        self.starts = starts
        self._running: np.ndarray | None = None  # running sums, made on the first ``sums``

    def of_unit(self, unit: int, start: int = 0, stop: int | None = None, *, check: bool = True) -> np.ndarray:
        a, b = doc_range(self.docs, self.starts, unit, start, stop)
        return self.lengths[a:b].astype(np.int64)

    def sums(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, list]:
        if self._running is None:
            self._running = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        first = self.starts[units]
        a = first + np.asarray(starts, np.int64)
        b = first + np.asarray(stops, np.int64)
        return self._running[b] - self._running[a], []

    def check(self, read: list) -> None:
        """Nothing to check: ``sums`` reads nothing unchecked."""

    def whole(self) -> np.ndarray:
        return self.lengths


class JoinedLengths:
    """A mixture's lengths: its sources' units end to end (source s owns units [bases[s], bases[s+1]))."""

    def __init__(self, parts: Sequence[DocumentLengths], bases: np.ndarray):
        self.parts = list(parts)
        self.bases = np.asarray(bases, np.int64)

    def _part(self, unit: int) -> int:
        return int(np.searchsorted(self.bases, unit, side="right")) - 1

    def of_unit(self, unit: int, start: int = 0, stop: int | None = None, *, check: bool = True) -> np.ndarray:
        s = self._part(unit)
        return self.parts[s].of_unit(unit - int(self.bases[s]), start, stop, check=check)

    def sums(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, list]:
        """Each source's sums over its own units; what was read is kept by source."""
        units = np.asarray(units, np.int64)
        owner = np.searchsorted(self.bases, units, side="right") - 1
        out = np.zeros(len(units), np.int64)
        read = []
        for s in np.unique(owner).tolist():
            at = np.flatnonzero(owner == s)
            part = self.parts[s]
            sums, got = part.sums(units[at] - self.bases[s], np.asarray(starts)[at], np.asarray(stops)[at])
            out[at] = sums
            read.append((s, got))
        return out, read

    def check(self, read: list) -> None:
        for s, got in read:
            self.parts[s].check(got)

    def whole(self) -> np.ndarray:
        parts = [p.whole() for p in self.parts]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)
