"""Documents' lengths unit by unit (``protocol.DocumentLengths``): from an index's lengths.npy,
from raw text's count sidecar, or a mixture's sources' end to end. Pure numpy."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import xxhash

from ...format.side import SideArray
from ..block import pieces_per_doc
from .protocol import DocumentLengths

#: lengths looked at at a time by ``range_pieces``
PIECES_STEP = 1 << 22


def doc_range(docs: np.ndarray, starts: np.ndarray, unit: int, start: int, stop: int | None) -> tuple[int, int]:
    """Where documents [start, stop) of ``unit`` are in a file of every document's length
    (``docs``: documents per unit, ``starts``: where each unit's begin)."""
    n = int(docs[unit])
    stop = n if stop is None else min(int(stop), n)
    base = int(starts[unit])
    return base + max(0, int(start)), base + stop


def doc_ranges(
    docs: np.ndarray, starts: np.ndarray, units: np.ndarray, first: np.ndarray, stop: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``doc_range`` of many (unit, start, stop) at once: where they are in the lengths file."""
    units = np.asarray(units, np.int64)
    base = starts[units]
    stop = np.minimum(np.asarray(stop, np.int64), docs[units])
    return base + np.maximum(0, np.asarray(first, np.int64)), base + stop


def range_pieces(
    chunks: Callable[[int, int], Iterator[tuple[int, np.ndarray]]], a: np.ndarray, b: np.ndarray, max_len: int
) -> np.ndarray:
    """``block.pieces_per_doc`` summed over the lengths [a[i], b[i]) of every range, in one pass
    over the positions the ranges cover (they may overlap or touch). A document of 1 to
    ``max_len`` tokens is one piece, so a range has as many pieces as documents, plus the extra
    pieces (-1 for an empty one) of the few documents that are not one piece: their running sum
    along the file, taken at the range's two ends. ``chunks(lo, hi)``: (first position, lengths)
    over positions [lo, hi), in order, checked."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    out = np.maximum(b - a, 0)
    ranged = np.flatnonzero(b > a)
    if not len(ranged):
        return out
    lo, hi = (a, b) if len(ranged) == len(a) else (a[ranged], b[ranged])
    if np.array_equal(lo[1:], hi[:-1]):  # one after another (a file's units, in order): one span
        [at] = _extra_before(chunks, [(int(lo[0]), int(hi[-1]))], [np.append(lo, hi[-1:])], max_len)
        out[ranged] += np.diff(at)
        return out
    at_lo, at_hi = _extra_before(chunks, _spans(lo, hi), [lo, hi], max_len)
    out[ranged] += at_hi - at_lo
    return out


def _sorting(x: np.ndarray) -> np.ndarray | None:
    """The order that sorts ``x`` (stable), or None where it is sorted already (the usual case:
    ranges asked in the file's order)."""
    return None if bool(np.all(x[1:] >= x[:-1])) else np.argsort(x, kind="stable")


def _spans(lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int]]:
    """The union of the ranges [lo[i], hi[i]) (none empty): its disjoint spans, in order."""
    by_start = _sorting(lo)
    if by_start is not None:
        lo, hi = lo[by_start], hi[by_start]
    reach = np.maximum.accumulate(hi)
    breaks = np.flatnonzero(lo[1:] > reach[:-1]) + 1  # a gap before range k: a new span
    starts, stops = lo[np.r_[0, breaks]], reach[np.r_[breaks - 1, len(lo) - 1]]
    return list(zip(starts.tolist(), stops.tolist()))


def _extra_before(
    chunks: Callable[[int, int], Iterator[tuple[int, np.ndarray]]],
    spans: list[tuple[int, int]],
    points: list[np.ndarray],
    max_len: int,
) -> list[np.ndarray]:
    """The extra pieces of the documents of ``spans`` before each position of each of ``points``
    (positions in a span or at its end), in the one pass over the lengths."""
    orders = [_sorting(p) for p in points]
    sorted_points = [p if o is None else p[o] for p, o in zip(points, orders)]
    found = [np.empty(len(p), np.int64) for p in points]
    mask = np.empty(0, bool)  # reused: a chunk's comparison allocates nothing
    running = 0
    for span_lo, span_hi in spans:
        done = span_lo
        for first, values in chunks(span_lo, span_hi):
            if len(mask) < len(values):
                mask = np.empty(len(values), bool)
            odd = _not_one_piece(values, max_len, mask[: len(values)])
            through = np.zeros(len(odd) + 1, np.int64)  # extra pieces of the first k odd documents
            np.cumsum(pieces_per_doc(values[odd].astype(np.int64), max_len) - 1, out=through[1:])
            done = first + len(values)
            for at, order, out in zip(sorted_points, orders, found):
                # the points in [first, done]: one at a chunk's end may be found again by the next, equal
                i, j = int(np.searchsorted(at, first, side="left")), int(np.searchsorted(at, done, side="right"))
                _put(out, order, i, j, running + through[np.searchsorted(odd, at[i:j] - first)])
            running += int(through[-1])
        for at, order, out in zip(sorted_points, orders, found):  # past the lengths ``chunks`` has: no documents
            i, j = int(np.searchsorted(at, done, side="right")), int(np.searchsorted(at, span_hi, side="right"))
            _put(out, order, i, j, running)
    return found


def _put(out: np.ndarray, order: np.ndarray | None, i: int, j: int, values: np.ndarray | int) -> None:
    """Sorted positions [i, j) of ``out`` (``order``: where the sorted ones are in it) set to ``values``."""
    if order is None:
        out[i:j] = values
    else:
        out[order[i:j]] = values


def _not_one_piece(values: np.ndarray, max_len: int, mask: np.ndarray) -> np.ndarray:
    """Where documents are not one piece: longer than ``max_len``, or empty (looked for only where
    a chunk has one). ``mask``: a buffer of len(values) for the comparison."""
    np.greater(values, max_len, out=mask)
    if len(values) and values.min() <= 0:
        mask |= values <= 0
    return np.flatnonzero(mask)


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
        self._pieces: tuple[tuple, np.ndarray] | None = None

    def of_unit(self, unit: int, start: int = 0, stop: int | None = None, *, check: bool = True) -> np.ndarray:
        a, b = doc_range(self.docs, self.starts, unit, start, stop)
        return self.side.read(a, b, check=check).astype(np.int64)

    def sums(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, list]:
        first = self.starts[units]
        a = first + np.asarray(starts, np.int64)
        b = first + np.asarray(stops, np.int64)
        ranged = np.flatnonzero(b > a)  # empty ranges (a whole shard's "other end") read nothing
        sums = np.zeros(len(a), np.int64)
        sums[ranged] = self.side.range_sums(a[ranged], b[ranged])
        return sums, list(zip(a[ranged].tolist(), b[ranged].tolist()))

    def pieces(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray, max_len: int) -> np.ndarray:
        # the last answer is kept: an epoch's blocks are counted for its counts and for its plan
        asked = [np.ascontiguousarray(x, np.int64) for x in (units, starts, stops)]
        key = (max_len, len(asked[0]), *(xxhash.xxh3_64_intdigest(x) for x in asked))
        if self._pieces is None or self._pieces[0] != key:
            a, b = doc_ranges(self.docs, self.starts, *asked)
            found = range_pieces(self.side.scan, a, b, max_len)
            self._pieces = (key, found)
        return self._pieces[1].copy()

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

    def pieces(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray, max_len: int) -> np.ndarray:
        def chunks(lo: int, hi: int) -> Iterator[tuple[int, np.ndarray]]:
            for at in range(lo, hi, PIECES_STEP):
                yield at, self.lengths[at : min(hi, at + PIECES_STEP)]

        a, b = doc_ranges(self.docs, self.starts, units, starts, stops)
        return range_pieces(chunks, a, b, max_len)

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

    def pieces(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray, max_len: int) -> np.ndarray:
        """Each source's pieces over its own units."""
        units = np.asarray(units, np.int64)
        owner = np.searchsorted(self.bases, units, side="right") - 1
        out = np.zeros(len(units), np.int64)
        for s in np.unique(owner).tolist():
            at = np.flatnonzero(owner == s)
            part = self.parts[s]
            out[at] = part.pieces(units[at] - self.bases[s], np.asarray(starts)[at], np.asarray(stops)[at], max_len)
        return out

    def check(self, read: list) -> None:
        for s, got in read:
            self.parts[s].check(got)

    def whole(self) -> np.ndarray:
        parts = [p.whole() for p in self.parts]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)
