"""Best-fit-decreasing packing: windows of documents packed into rows of ``seq_len`` (Ding et al.
2024, "Fewer Truncations Improve Language Modeling"), rows shuffled per window, ``batch_size``
rows per batch."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ConfigError
from .. import plan as planmod
from ..block import Block, empty_block
from .protocol import (
    COUNT_BY_WINDOWS,
    ArrayLengths,
    Hint,
    ItemLengths,
    as_item_lengths,
    batches_of,
    item_windows,
)
from .rows import row_batches, rows_lower_bound

if TYPE_CHECKING:
    from ..stream import StreamSpec


class _OpenRooms:
    """The open bins of a count, grouped by their room left: how many bins have each room."""

    def __init__(self, counts: dict[int, int]):
        self.count = counts
        self.rooms = sorted(counts)  # distinct rooms > 0

    def add(self, room: int, c: int) -> None:
        if room <= 0 or c <= 0:
            return
        if room in self.count:
            self.count[room] += c
        else:
            self.count[room] = c
            bisect.insort(self.rooms, room)

    def remove(self, i: int, c: int) -> None:
        """Close ``c`` of the bins of the i-th smallest room (they move to another room)."""
        room = self.rooms[i]
        self.count[room] -= c
        if self.count[room] == 0:
            del self.count[room]
            self.rooms.pop(i)

    def place(self, length: int, k: int, capacity: int) -> int:
        """Place ``k`` items of ``length``, best fit first; returns the bins opened for them."""
        while k:
            i = bisect.bisect_left(self.rooms, length)
            if i == len(self.rooms):  # nothing fits: new bins, each taking q items
                q = capacity // length
                full, rest = divmod(k, q)
                self.add(capacity - q * length, full)
                if rest:
                    self.add(capacity - rest * length, 1)
                return full + (1 if rest else 0)
            room = self.rooms[i]
            c = self.count[room]
            q = room // length  # items of this length each such bin takes
            if k >= c * q:
                self.remove(i, c)
                self.add(room - q * length, c)
                k -= c * q
            else:
                m, rest = divmod(k, q)
                self.remove(i, m + (1 if rest else 0))
                self.add(room - q * length, m)
                if rest:
                    self.add(room - rest * length, 1)
                k = 0
        return 0


def bfd_count(lengths: np.ndarray, capacity: int) -> int:
    """How many bins ``best_fit_decreasing`` opens, from the lengths' histogram.

    Equal lengths are placed together: a bin keeps taking items of length L while its room is at
    least L (it stays the best fit), and which of several bins of equal room is chosen does not
    change the count. Items longer than half the capacity never share a bin with each other, so
    each opens its own, all at once. Python work per distinct length, not per item.
    """
    lengths = np.asarray(lengths, np.int64)
    over = int(np.count_nonzero(lengths > capacity))  # longer than a bin: one each, never shared
    hist = np.bincount(lengths[lengths <= capacity], minlength=capacity + 1)
    half = capacity // 2
    big = hist[half + 1 :]
    bins = over + int(big.sum())
    counts: dict[int, int] = {}
    for length in np.flatnonzero(big).tolist():
        room = capacity - (half + 1 + length)
        if room > 0:
            counts[room] = counts.get(room, 0) + int(big[length])
    open_bins = _OpenRooms(counts)
    small = np.flatnonzero(hist[1 : half + 1]) + 1
    for length, k in zip(small[::-1].tolist(), hist[small][::-1].tolist()):
        bins += open_bins.place(length, k, capacity)
    if hist[0] and not open_bins.rooms:  # empty items go into any bin with room; without one they open one
        bins += 1
    return bins


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, in insertion order) by best-fit decreasing.

    Items are placed longest first (stably), each into the fullest bin it fits in; an item that
    fits nowhere opens a bin. Bin keys pack (room, bin id) into one int so bisect stays cheap.
    """
    order = np.argsort(-lengths, kind="stable")
    shift = 32
    rooms: list[int] = []  # sorted keys: room << shift | bin
    bins: list[list[int]] = []
    for idx in order.tolist():
        need = int(lengths[idx])
        pos = bisect.bisect_left(rooms, need << shift)
        if pos < len(rooms):
            key = rooms.pop(pos)
            b, room = key & ((1 << shift) - 1), key >> shift
        else:
            b, room = len(bins), capacity
            bins.append([])
        bins[b].append(idx)
        room -= need
        if room > 0:
            bisect.insort(rooms, room << shift | b)
    return bins


def _rows_block(block: Block, rows: list[np.ndarray]) -> Block:
    """A block whose items are rows made of ``block``'s items (segments keep the document ids)."""
    if not rows:
        return empty_block(block.tokens.dtype, packed=True)
    flat = np.concatenate(rows)
    counts = np.array([len(r) for r in rows], np.int64)
    inner = block.take(flat)
    tokens = inner.gather_tokens()
    seg_len = inner.lengths
    row_len = np.add.reduceat(seg_len, np.concatenate([[0], np.cumsum(counts)[:-1]])) if len(counts) else counts
    out = Block(
        tokens,
        np.concatenate([[0], np.cumsum(row_len)[:-1]]).astype(np.int64),
        row_len.astype(np.int64),
        np.zeros(len(rows), np.int64),
    )
    seg_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    cum = np.cumsum(seg_len) - seg_len
    return out.set_segments(
        seg_ptr,
        (cum - np.repeat(cum[seg_ptr[:-1]], counts)).astype(np.int64),
        inner.ids.copy(),
        seg_len.astype(np.int64),
    )


class PackBatcher:
    """Best-fit-decreasing rows of ``seq_len`` from windows of whole documents (or pieces).

    Documents longer than ``seq_len`` arrive already split into ``seq_len`` pieces (the stream
    splits them), so no document at or under ``seq_len`` is ever cut and nothing is dropped.
    Rows of a window are shuffled; batches take ``batch_size`` rows and run across windows.
    """

    needs_lengths = True
    count_by = COUNT_BY_WINDOWS

    def __init__(self, window: int, seq_len: int, batch_size: int, drop_last: bool = False):
        self.window = window
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.drop_last = drop_last
        #: (lengths, rows per window) of the last ``rows_per_window`` call: resuming asks twice
        self._rows_cache: tuple[np.ndarray, list[int]] | None = None

    def rows_per_window(self, lengths: np.ndarray) -> list[int]:
        cached = self._rows_cache
        if cached is not None and cached[0] is lengths:
            return cached[1]
        rows = [bfd_count(w, self.seq_len) for w in ArrayLengths(lengths).windows(self.window)]
        self._rows_cache = (lengths, rows)
        return rows

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None) -> int:
        if lengths is None:
            raise ConfigError("pack batch counts need the documents' lengths (an index)")
        rows = sum(bfd_count(w, self.seq_len) for w in as_item_lengths(lengths).windows(self.window))
        return batches_of(rows, self.batch_size, self.drop_last)

    def lower_bound(self, items: np.ndarray, tokens: np.ndarray | None, longest: int) -> np.ndarray:
        """A row holds at most seq_len tokens."""
        return rows_lower_bound(items, tokens, self.seq_len, self.batch_size, self.drop_last)

    def start_position(self, batch: int, lengths: np.ndarray | None, hint: dict | None = None) -> int:
        if hint is not None:
            return hint["w"] * self.window
        if batch == 0 or lengths is None:
            return 0
        first_row = batch * self.batch_size
        done = 0
        for i, rows in enumerate(self.rows_per_window(lengths)):
            if done + rows > first_row:
                return i * self.window
            done += rows
        return len(lengths)

    def handing(self) -> PackBatcher:
        return PackBatcher(self.window, self.seq_len, self.batch_size, drop_last=True)

    def tail(self, lengths: np.ndarray, spec: StreamSpec) -> tuple[np.ndarray, int]:
        """The rows after the last full batch are the stream's last rows: only the windows that
        hold them are packed (the others are counted from their histograms, ``bfd_count``)."""
        k, b = self.window, self.batch_size
        rows = self.rows_per_window(lengths)
        need = sum(rows) % b
        out: list[np.ndarray] = []
        for i in range(len(rows) - 1, -1, -1):
            if need <= 0:
                break
            bins = self._window_bins(lengths[i * k : (i + 1) * k], spec, i)
            out.extend(i * k + r for r in bins[max(0, len(bins) - need) :])
            need -= len(bins)
        return (np.sort(np.concatenate(out)) if out else np.zeros(0, np.int64)), 0

    def _window_bins(self, lengths: np.ndarray, spec: StreamSpec, i: int) -> list[np.ndarray]:
        bins = best_fit_decreasing(lengths, self.seq_len)
        order = planmod.rng(spec.seed, planmod.STREAM_PACK, spec.epoch, spec.rank, spec.worker, i).permutation(
            len(bins)
        )
        return [np.asarray(bins[j], np.int64) for j in order]

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        k = self.window
        rows = [
            a + r
            for i, a in enumerate(range(0, len(lengths), k))
            for r in self._window_bins(lengths[a : a + k], spec, i)
        ]
        b = self.batch_size
        for a in range(0, len(rows), b):
            if self.drop_last and a + b > len(rows):
                return
            yield np.concatenate(rows[a : a + b])

    def window_rows(self, window: Block, spec: StreamSpec, i: int) -> Block:
        return _rows_block(window, self._window_bins(window.lengths, spec, i))

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_batch: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, dict]]:
        k = self.window
        start_window, skip_rows = 0, first_batch * self.batch_size
        if hint is not None:
            start_window, skip_rows = hint["w"], hint["skip"]
        elif first_batch and lengths is not None:
            done = 0
            for i, rows in enumerate(self.rows_per_window(lengths)):
                if done + rows > skip_rows:
                    start_window = i
                    break
                done += rows
            skip_rows -= done
        windows = enumerate(item_windows(shuffled, k), start_window)
        rows_stream = ((i, self.window_rows(w, spec, i)) for i, w in windows)
        yield from row_batches(rows_stream, self.batch_size, first_batch, skip_rows, self.drop_last)
