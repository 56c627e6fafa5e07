"""Batchers: turn a worker's shuffled item stream into batches, deterministically.

Every batcher is a pure function of the items' lengths and the random key (seed, epoch, rank,
worker): which items form batch j, and in what order batches come, never depends on anything
else. That gives three things at once:

- the number of batches can be computed from ``lengths.npy`` before any shard is read, so every
  rank can stop at the same count (equal batches, even for token budgets);
- a stream can be resumed at batch j by re-running the plan over lengths and reading only the
  window(s) that batch j needs;
- the work is numpy over index arrays, never Python per token.

Batchers:
- ``FixedBatcher``: consecutive items, ``batch_size`` per batch (random batches).
- ``BucketBatcher``: windows of ``window`` items sorted by length (stably, so the shuffle
  survives among equal lengths), cut into batches of a fixed size or a padded-token budget, the
  batches of a window shuffled. The partial batch at a window's end is carried into the next
  window (see ``_bucket_window``).
- ``PackBatcher``: windows of documents packed into rows of ``seq_len`` by best-fit decreasing
  (Ding et al. 2024, "Fewer Truncations Improve Language Modeling"); rows shuffled per window,
  ``batch_size`` rows per batch.
- ``ConcatBatcher``: the documents concatenated and cut into rows of ``seq_len`` (GPT-style).

A new batching mode is one class that keeps the :class:`Batcher` protocol and one
:class:`BatchingMode` entry in :data:`MODES`; the loader asks the entry everything else (what the
mode needs of the dataset, whether it makes rows, how documents reach it).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import ConfigError
from . import plan as planmod
from .block import Block, concat_blocks, empty_block, windows

if TYPE_CHECKING:
    from .stream import StreamSpec

#: A resume hint: the batcher's own note of where a worker's next batch starts (small, JSON-able)
Hint = dict


class ItemLengths(Protocol):
    """A stream's item lengths as far as counting needs them, without holding them: their sum,
    and each window's lengths. Counts by window need only each window's *multiset* of lengths
    (every windowed batcher sorts its window first), so a window may come in any order; this is
    what lets a count read lengths.npy in plan order, a window at a time, without a shuffle."""

    def total(self) -> int:
        """The items' tokens."""
        ...

    def windows(self, size: int) -> Iterator[np.ndarray]:
        """The lengths of items [i*size, (i+1)*size) of the shuffled stream, for i = 0, 1, ..."""
        ...


class ArrayLengths:
    """ItemLengths of lengths held in an array (in shuffled-stream order)."""

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths

    def total(self) -> int:
        return int(np.sum(self.lengths, dtype=np.int64))

    def windows(self, size: int) -> Iterator[np.ndarray]:
        for a in range(0, len(self.lengths), size):
            yield self.lengths[a : a + size]


def as_item_lengths(lengths: np.ndarray | ItemLengths | None) -> ItemLengths | None:
    return ArrayLengths(lengths) if isinstance(lengths, np.ndarray) else lengths


#: what a batcher's count needs of a stream: its number of items, its tokens, or its windows
COUNT_BY_ITEMS, COUNT_BY_TOKENS, COUNT_BY_WINDOWS = "items", "tokens", "windows"


class Batcher(Protocol):
    """Turns a worker's shuffled item stream into batches; a pure function of lengths and the key.

    ``count``, ``start_position`` and ``dry_batches`` work from the items' lengths alone (in
    shuffled-stream order), so counts are known and positions found without reading a token;
    ``batches`` does the same work on the items themselves, and must agree with them exactly.
    """

    #: whether start_position needs the items' lengths (else the number of items suffices)
    needs_lengths: bool
    #: what ``count`` needs: COUNT_BY_ITEMS (n_items), COUNT_BY_TOKENS (lengths.total()) or
    #: COUNT_BY_WINDOWS (lengths.windows(window))
    count_by: str

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None) -> int:
        """Batches the stream of ``n_items`` items (of these lengths) makes: the one counting
        formula of the mode, which equal batches, ``len``, stats and resumption all use."""
        ...

    def start_position(self, batch: int, lengths: np.ndarray | None, hint: Hint | None = None) -> int:
        """The shuffled-stream position to start reading at to produce batch ``batch``."""
        ...

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        """The shuffled-stream positions of each batch's items, from lengths alone."""
        ...

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_batch: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, Hint | None]]:
        """(batch number, items, hint for the batch after it) from batch ``first_batch`` on;
        ``shuffled`` starts at ``start_position(first_batch, ...)``."""
        ...


@dataclass(slots=True)
class Batch:
    """A batch in compact form: the items with their tokens gathered contiguously.

    This is what crosses from DataLoader workers to the main process (small: no padding), where
    ``collate`` turns it into tensors.
    """

    items: Block
    index: int  # batch number within the worker's epoch
    epoch: int
    worker: int
    hint: dict | None = None  # the batcher's resume hint: where the worker's next batch starts
    stats: dict = field(default_factory=dict)
    mix: Any = None  # a mixture's [sources, 2] tokens and items of this batch (counted in the worker)


def _batches_of(n: int, b: int, drop_last: bool) -> int:
    """Batches of ``b`` that ``n`` things make (the last one short, or dropped)."""
    return n // b if drop_last else (n + b - 1) // b


def round_up(n: Any, multiple: int | None) -> Any:
    """``n`` (an int or an array) rounded up to a multiple (unchanged without one)."""
    return n if not multiple else (n + multiple - 1) // multiple * multiple


def _windows(shuffled: Iterator[tuple[int, Block]], size: int) -> Iterator[Block]:
    return windows((block for _, block in shuffled), size)


def _order_rng(spec: StreamSpec, window: int) -> np.random.Generator:
    return planmod.rng(spec.seed, planmod.STREAM_BATCH_ORDER, spec.epoch, spec.rank, spec.worker, window)


# ----------------------------------------------------------------------------------------------
# Fixed-size batches


class FixedBatcher:
    """``batch_size`` consecutive items of the shuffled stream per batch."""

    needs_lengths = False
    count_by = COUNT_BY_ITEMS

    def __init__(self, batch_size: int, drop_last: bool = False):
        if batch_size < 1:
            raise ConfigError("batch_size must be at least 1")
        self.batch_size = batch_size
        self.drop_last = drop_last

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None = None) -> int:
        return _batches_of(n_items, self.batch_size, self.drop_last)

    def start_position(self, batch: int, lengths: np.ndarray | None = None, hint: dict | None = None) -> int:
        return batch * self.batch_size

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        """The shuffled-stream positions of each batch's items, from lengths alone."""
        n, b = len(lengths), self.batch_size
        for a in range(0, n, b):
            if self.drop_last and a + b > n:
                return
            yield np.arange(a, min(n, a + b))

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_batch: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, dict | None]]:
        """(batch number, items, resume hint) from batch ``first_batch``; ``shuffled`` starts at
        its position. The hint says where the next batch starts, so a resume needs no replanning
        (fixed batches need none)."""
        b = self.batch_size
        index = first_batch
        pending: Block | None = None
        for _, block in shuffled:
            if pending is not None:
                # complete the pending batch from the head of this block; join nothing more
                need = b - len(pending)
                head = block.slice(0, need)
                pending = concat_blocks([pending, head])
                block = block.slice(len(head), len(block))
                if len(pending) < b:
                    continue
                yield index, pending, None
                index += 1
                pending = None
            full = len(block) // b
            for i in range(full):
                yield index, block.slice(i * b, (i + 1) * b), None
                index += 1
            if len(block) > full * b:
                pending = block.slice(full * b, len(block))
        if pending is not None and len(pending) and not self.drop_last:
            yield index, pending, None


class ItemChunker:
    """batch_size=None: items one at a time. Counts and positions are per item (a batch of one),
    but items travel in chunks of the shuffled stream's blocks, never one Python object each."""

    needs_lengths = False
    count_by = COUNT_BY_ITEMS

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None = None) -> int:
        return n_items

    def start_position(self, item: int, lengths: np.ndarray | None = None, hint: dict | None = None) -> int:
        return item

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        for i in range(len(lengths)):
            yield np.array([i])

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_item: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, None]]:
        """(index of the chunk's first item, chunk)."""
        index = first_item
        for _, block in shuffled:
            if len(block):
                yield index, block, None
                index += len(block)


# ----------------------------------------------------------------------------------------------
# Length bucketing


@dataclass
class WindowPlan:
    """One window of the bucket plan, over ``carry + new`` items (carried first)."""

    batches: list[np.ndarray]  # item indices into carry+new, in the order batches are emitted
    carry_out: int  # how many of the new items (the longest, stably) go to the next window
    small: int = 0  # batches emitted below size because a carried item was left over again


class BucketBatcher:
    """Length-sorted windows cut into fixed-size or token-budget batches.

    The carried partial batch of window i is always the ``carry_out`` longest *new* items of
    window i (stable order), so it is known from window i's lengths and one integer; a window
    plan never depends on windows further back, and resuming reads at most two windows.
    """

    needs_lengths = True

    def __init__(
        self,
        window: int,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        drop_last: bool = False,
    ):
        if (batch_size is None) == (max_tokens is None):
            raise ConfigError("bucket batching takes batch_size= or max_tokens=, not both")
        if batch_size is not None and window < batch_size:
            raise ConfigError(f"window ({window}) must hold at least one batch ({batch_size})")
        self.window = window
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.multiple = pad_to_multiple_of
        self.drop_last = drop_last
        # with a batch size, every window but the last emits whole batches and carries n mod b:
        # the count is that of fixed batches; a token budget needs each window's lengths
        self.count_by = COUNT_BY_ITEMS if batch_size is not None else COUNT_BY_WINDOWS

    # -- the rule, on lengths only ------------------------------------------------------------
    def _cut_budget(self, sorted_lengths: np.ndarray) -> list[tuple[int, int]]:
        """Greedy [start, end) ranges over ascending lengths: count x padded longest <= budget."""
        padded = round_up(sorted_lengths, self.multiple) if self.multiple else sorted_lengths
        n = len(padded)
        out = []
        s = 0
        while s < n:
            # (e - s) * padded[e - 1] grows with e, so the largest fitting e is found by bisection
            lo, hi = s + 1, n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if (mid - s) * int(padded[mid - 1]) <= self.max_tokens:
                    lo = mid
                else:
                    hi = mid - 1
            out.append((s, lo))
            s = lo
        return out

    def plan_window(self, carry_lengths: np.ndarray, new_lengths: np.ndarray, final: bool) -> WindowPlan:
        c = len(carry_lengths)
        merged = np.concatenate([carry_lengths, new_lengths])
        order = np.argsort(merged, kind="stable")  # carried items first among equal lengths
        if self.batch_size is not None:
            b = self.batch_size
            carry_out = 0 if final else len(merged) % b
            if carry_out:
                # the longest new items (stably) are carried; carried items always go out now
                new_sorted = c + np.argsort(new_lengths, kind="stable")
                keep = np.ones(len(merged), bool)
                keep[new_sorted[-carry_out:]] = False
                order = order[keep[order]]
            chunks = [order[i : i + b] for i in range(0, len(order), b)]
            if final and self.drop_last and chunks and len(chunks[-1]) < b:
                chunks.pop()
            return WindowPlan(chunks, carry_out)
        ranges = self._cut_budget(merged[order])
        chunks = [order[s:e] for s, e in ranges]
        if final or not chunks:
            if final and self.drop_last and chunks and self._underfull(merged[chunks[-1]]):
                chunks.pop()
            return WindowPlan(chunks, 0)
        last = chunks[-1]
        if np.all(last >= c):  # only new items: carry them into the next window
            return WindowPlan(chunks[:-1], len(last))
        return WindowPlan(chunks, 0, small=1)

    def _underfull(self, lengths: np.ndarray) -> bool:
        return (len(lengths) + 1) * int(round_up(int(lengths.max()), self.multiple)) <= self.max_tokens

    def simulate(self, lengths: np.ndarray) -> list[tuple[int, int]]:
        """(batches emitted, items carried out) per window of the whole stream."""
        out = []
        k = self.window
        n = len(lengths)
        carry = np.zeros(0, np.int64)
        n_windows = max(1, (n + k - 1) // k)
        for i in range(n_windows):
            new = lengths[i * k : (i + 1) * k]
            plan = self.plan_window(carry, new, final=i == n_windows - 1)
            out.append((len(plan.batches), plan.carry_out))
            carry = (
                np.sort(new, kind="stable")[len(new) - plan.carry_out :] if plan.carry_out else np.zeros(0, np.int64)
            )
        return out

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None) -> int:
        if n_items == 0:
            return 0
        if self.batch_size is not None:
            return _batches_of(n_items, self.batch_size, self.drop_last)
        if lengths is None:
            raise ConfigError("token-budget batch counts need the documents' lengths (an index)")
        return budget_count(
            as_item_lengths(lengths).windows(self.window), self.max_tokens, self.multiple, self.drop_last
        )

    def _locate(self, batch: int, lengths: np.ndarray) -> tuple[int, int, int]:
        """(window holding batch, batches before that window, items carried into it)."""
        done = 0
        carry_in = 0
        for i, (emitted, carry_out) in enumerate(self.simulate(lengths)):
            if done + emitted > batch:
                return i, done, carry_in
            done += emitted
            carry_in = carry_out
        return len(lengths) // self.window + 1, done, 0

    def _resume_point(self, batch: int, lengths: np.ndarray | None, hint: Hint | None) -> tuple[int, int, int]:
        """(window, batches before it, items carried into it) for resuming at ``batch``."""
        if hint is not None:
            return hint["w"], batch - hint["skip"], hint["carry"]
        if batch == 0 or lengths is None:
            return 0, 0, 0
        return self._locate(batch, lengths)

    def start_position(self, batch: int, lengths: np.ndarray | None, hint: dict | None = None) -> int:
        if batch == 0 or (lengths is None and hint is None):
            return 0
        i, _, carry_in = self._resume_point(batch, lengths, hint)
        return (i - 1 if carry_in else i) * self.window

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        k = self.window
        n_windows = max(1, (len(lengths) + k - 1) // k)
        carry_pos = np.zeros(0, np.int64)
        for i in range(n_windows):
            new_pos = np.arange(i * k, min(len(lengths), (i + 1) * k))
            plan = self.plan_window(lengths[carry_pos], lengths[new_pos], final=i == n_windows - 1)
            merged = np.concatenate([carry_pos, new_pos])
            for j in _order_rng(spec, i).permutation(len(plan.batches)):
                yield merged[plan.batches[j]]
            carry_pos = np.zeros(0, np.int64)
            if plan.carry_out:
                carry_pos = new_pos[np.argsort(lengths[new_pos], kind="stable")[len(new_pos) - plan.carry_out :]]

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_batch: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, dict]]:
        k = self.window
        known = lengths is not None or hint is not None
        start_window, done, carry_in = (
            self._resume_point(first_batch, lengths, hint) if first_batch and known else (0, 0, 0)
        )
        windows = _windows(shuffled, k)
        carry: Block | None = None
        i = start_window
        if first_batch and known and carry_in:
            prev = next(windows)  # window i-1: only its carried items are needed
            keep = np.argsort(prev.lengths, kind="stable")[len(prev) - carry_in :]
            carry = prev.take(keep)
        index = done
        skip = first_batch - done if known else first_batch
        pending = next(windows, None)
        while pending is not None:
            following = next(windows, None)
            final = following is None
            carry_block = carry if carry is not None else pending.slice(0, 0)
            plan = self.plan_window(carry_block.lengths, pending.lengths, final=final)
            merged = concat_blocks([carry_block, pending]) if len(carry_block) else pending
            order = _order_rng(spec, i).permutation(len(plan.batches))
            for emitted, j in enumerate(order, 1):
                if skip:
                    skip -= 1
                    index += 1
                    continue
                if emitted < len(order):
                    after = {"w": i, "carry": len(carry_block), "skip": emitted}
                else:
                    after = {"w": i + 1, "carry": plan.carry_out, "skip": 0}
                yield index, merged.take(plan.batches[j]), after
                index += 1
            carry = None
            if plan.carry_out:
                keep = np.argsort(pending.lengths, kind="stable")[len(pending) - plan.carry_out :]
                carry = pending.take(keep)
            pending = following
            i += 1


def budget_count(windows: Iterable[np.ndarray], max_tokens: int, multiple: int | None, drop_last: bool) -> int:
    """Batches ``BucketBatcher(max_tokens=...)`` makes of a stream given window by window.

    The same rule as ``plan_window``, on values alone: a window's batches are the greedy cut of
    its sorted lengths (the carried ones included), and the carry is the longest new items, so
    only each window's multiset matters; no argsort, no permutation, no batch built. Carried items
    sort first among equal lengths, which decides whether the last batch is carried on.
    """
    total = 0
    carry = np.zeros(0, np.int64)  # sorted lengths carried into the window
    stream = iter(windows)
    pending = next(stream, None)
    while pending is not None:
        following = next(stream, None)
        new = np.sort(np.asarray(pending, np.int64))
        merged = np.sort(np.concatenate([carry, new])) if len(carry) else new
        n = len(merged)
        if n == 0:
            carry, pending = np.zeros(0, np.int64), following
            continue
        batches, s = _budget_cut(round_up(merged, multiple) if multiple else merged, max_tokens)
        if following is None:
            last_max = int(round_up(int(merged[-1]), multiple))
            if drop_last and (n - s + 1) * last_max <= max_tokens:
                batches -= 1  # the final batch is under-full: dropped
            return total + batches
        v = int(merged[s])
        c_lo, c_hi = int(np.searchsorted(carry, v, "left")), int(np.searchsorted(carry, v, "right"))
        carried_above = len(carry) - c_hi
        first_v = int(np.searchsorted(merged, v, "left"))
        if carried_above == 0 and first_v + (c_hi - c_lo) <= s:  # the last batch holds new items only
            total += batches - 1
            carry = new[len(new) - (n - s) :]
        else:
            total += batches
            carry = np.zeros(0, np.int64)
        pending = following
    return total


def _budget_cut(padded: np.ndarray, budget: int) -> tuple[int, int]:
    """(batches, start of the last batch) of the greedy cut of ascending padded lengths into
    ranges whose count times their longest fits the budget (``BucketBatcher._cut_budget``)."""
    n = len(padded)
    s = batches = last = 0
    while s < n:
        first = int(padded[s])
        lo, hi = s + 1, min(n, s + max(1, budget // first if first else n))
        while lo < hi:  # (e - s) * padded[e - 1] grows with e: bisect for the largest that fits
            mid = (lo + hi + 1) // 2
            if (mid - s) * int(padded[mid - 1]) <= budget:
                lo = mid
            else:
                hi = mid - 1
        last, s = s, lo
        batches += 1
    return batches, last


# ----------------------------------------------------------------------------------------------
# Rows: best-fit packing and concatenation


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
    cnt: dict[int, int] = {}
    for length in np.flatnonzero(big).tolist():
        room = capacity - (half + 1 + length)
        if room > 0:
            cnt[room] = cnt.get(room, 0) + int(big[length])
    rooms = sorted(cnt)  # distinct rooms > 0 of open bins

    def add(room: int, c: int) -> None:
        if room <= 0 or c <= 0:
            return
        if room in cnt:
            cnt[room] += c
        else:
            cnt[room] = c
            bisect.insort(rooms, room)

    small = np.flatnonzero(hist[1 : half + 1]) + 1
    for length, k in zip(small[::-1].tolist(), hist[small][::-1].tolist()):
        while k:
            i = bisect.bisect_left(rooms, length)
            if i == len(rooms):  # nothing fits: new bins, each taking q items
                q = capacity // length
                full, rest = divmod(k, q)
                bins += full + (1 if rest else 0)
                add(capacity - q * length, full)
                if rest:
                    add(capacity - rest * length, 1)
                break
            room = rooms[i]
            c = cnt[room]
            q = room // length  # items of this length each such bin takes
            if k >= c * q:
                del cnt[room]
                rooms.pop(i)
                add(room - q * length, c)
                k -= c * q
            else:
                m, rest = divmod(k, q)
                cnt[room] -= m + (1 if rest else 0)
                if cnt[room] == 0:
                    del cnt[room]
                    rooms.pop(i)
                add(room - q * length, m)
                if rest:
                    add(room - rest * length, 1)
                k = 0
    if hist[0] and not rooms:  # empty items go into any bin with room; without one they open one
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

    def rows_per_window(self, lengths: np.ndarray) -> list[int]:
        cached = getattr(self, "_rows_cache", None)
        if cached is not None and cached[0] is lengths:
            return cached[1]
        rows = [bfd_count(w, self.seq_len) for w in ArrayLengths(lengths).windows(self.window)]
        self._rows_cache = (lengths, rows)
        return rows

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None) -> int:
        if lengths is None:
            raise ConfigError("pack batch counts need the documents' lengths (an index)")
        rows = sum(bfd_count(w, self.seq_len) for w in as_item_lengths(lengths).windows(self.window))
        return _batches_of(rows, self.batch_size, self.drop_last)

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
        rows_stream = (
            (start_window + i, self.window_rows(w, spec, start_window + i)) for i, w in enumerate(_windows(shuffled, k))
        )
        yield from _row_batches(rows_stream, self.batch_size, first_batch, skip_rows, self.drop_last)


def _row_batches(
    rows_stream: Iterable[tuple[int, Block]], b: int, first_batch: int, skip_rows: int, drop_last: bool
) -> Iterator[tuple[int, Block, dict]]:
    """Batches of ``b`` rows over a stream of (window, rows); rows run across windows. The hint
    after a batch is (window, rows of it already used) of the next row."""
    index = first_batch
    queue: list[tuple[int, int, Block]] = []  # (window, first row's offset in it, rows)
    have = 0
    last_window = -1
    for w, rows in rows_stream:
        last_window = w
        offset = 0
        if skip_rows:
            take = min(skip_rows, len(rows))
            skip_rows -= take
            offset = take
            rows = rows.slice(take, len(rows))
        if len(rows):
            queue.append((w, offset, rows))
            have += len(rows)
        while have >= b:
            parts, need = [], b
            while need:
                qw, qoff, qrows = queue[0]
                take = min(need, len(qrows))
                parts.append(qrows.slice(0, take))
                if take == len(qrows):
                    queue.pop(0)
                else:
                    queue[0] = (qw, qoff + take, qrows.slice(take, len(qrows)))
                need -= take
            have -= b
            after = {"w": queue[0][0], "skip": queue[0][1]} if queue else {"w": w + 1, "skip": 0}
            yield index, concat_blocks(parts) if len(parts) > 1 else parts[0], after
            index += 1
    if have and not drop_last:
        yield index, concat_blocks([q[2] for q in queue]), {"w": last_window + 1, "skip": 0}


class ConcatBatcher:
    """Documents concatenated in stream order and cut into rows of ``seq_len`` (GPT-style)."""

    needs_lengths = True
    count_by = COUNT_BY_TOKENS

    def __init__(self, seq_len: int, batch_size: int, drop_last: bool = False):
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.drop_last = drop_last

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None) -> int:
        if lengths is None:
            raise ConfigError("concat batch counts need the documents' lengths (an index)")
        rows = (as_item_lengths(lengths).total() + self.seq_len - 1) // self.seq_len
        return _batches_of(rows, self.batch_size, self.drop_last)

    def start_position(self, batch: int, lengths: np.ndarray | None, hint: dict | None = None) -> int:
        if batch == 0 or lengths is None:
            return 0
        offset = batch * self.batch_size * self.seq_len
        return int(np.searchsorted(np.cumsum(lengths), offset, side="right"))

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        """Items each batch's rows touch; an item that runs across batches is in each of them."""
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if len(ends) else 0
        span = self.batch_size * self.seq_len
        rows = -(-total // self.seq_len)  # the last row may be short: it still counts as a row
        for a in range(0, total, span):
            b = min(total, a + span)
            if self.drop_last and rows - a // self.seq_len < self.batch_size:
                return
            first = int(np.searchsorted(ends, a, side="right"))
            last = int(np.searchsorted(ends, b - 1, side="right"))
            yield np.arange(first, last + 1)

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_batch: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, None]]:
        L = self.seq_len
        lead = 0  # tokens of the first item already used by earlier rows
        skip_rows = first_batch * self.batch_size
        if first_batch and lengths is not None:
            start = self.start_position(first_batch, lengths)
            lead = first_batch * self.batch_size * L - (int(lengths[:start].sum()) if start else 0)
            skip_rows = 0
        rows_stream = ((0, rows) for rows in _concat_rows(shuffled, L, lead))
        for index, block, _ in _row_batches(rows_stream, self.batch_size, first_batch, skip_rows, self.drop_last):
            yield index, block, None


def _concat_rows(shuffled: Iterable[tuple[int, Block]], seq_len: int, lead: int) -> Iterator[Block]:
    """Rows of ``seq_len`` over the concatenated items; a row's segments are the pieces of
    items it holds. ``lead`` tokens of the first item belong to rows before the stream start."""
    carry: Block | None = None
    for _, block in shuffled:
        if lead:
            block = Block(block.tokens, block.starts.copy(), block.lengths.copy(), block.ids, block.pieces)
            block.starts[0] += lead
            block.lengths[0] -= lead
            lead = 0
        if carry is not None:
            block = concat_blocks([carry, block])
        total = int(block.lengths.sum())
        n_rows = total // seq_len
        if n_rows == 0:
            carry = block
            continue
        rows, carry = _cut_rows(block, seq_len, n_rows)
        yield rows
    if carry is not None and len(carry):
        rows, _ = _cut_rows(carry, seq_len, 1)
        yield rows


def _cut_rows(block: Block, seq_len: int, n_rows: int) -> tuple[Block, Block | None]:
    """The first ``n_rows`` rows of the block's concatenated tokens, and the rest as a block."""
    ends = np.cumsum(block.lengths)
    starts = ends - block.lengths
    limit = min(n_rows * seq_len, int(ends[-1]))
    # segments: every item piece that falls inside a row
    row_edges = np.arange(0, limit, seq_len)
    cuts = np.unique(np.concatenate([starts[starts < limit], row_edges]))
    item_of = np.searchsorted(ends, cuts, side="right")
    seg_end = np.minimum(np.append(cuts[1:], limit), ends[item_of])
    seg_len = seg_end - cuts
    keep = seg_len > 0
    cuts, item_of, seg_len = cuts[keep], item_of[keep], seg_len[keep]
    tokens = block.gather_tokens()
    row_of = cuts // seq_len
    counts = np.bincount(row_of, minlength=(limit + seq_len - 1) // seq_len)
    n = len(counts)
    row_len = np.minimum(seq_len, limit - np.arange(n) * seq_len)
    rows = Block(
        tokens[:limit], np.arange(n, dtype=np.int64) * seq_len, row_len.astype(np.int64), np.zeros(n, np.int64)
    )
    rows.set_segments(
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        (cuts - row_of * seq_len).astype(np.int64),
        block.ids[item_of],
        seg_len.astype(np.int64),
    )
    rest = None
    if limit < int(ends[-1]):
        i = int(np.searchsorted(ends, limit, side="right"))
        rest = block.slice(i, len(block))
        used = limit - int(starts[i])
        if used:
            rest = Block(rest.tokens, rest.starts.copy(), rest.lengths.copy(), rest.ids, rest.pieces)
            rest.starts[0] += used
            rest.lengths[0] -= used
    return rows, rest


# ----------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class BatchingMode:
    """What the loader needs to know of a batching mode besides its Batcher."""

    name: str
    make: Callable[[Any], Batcher]  # the Batcher for a load.config.Config
    docs_only: bool = False  # works on documents: a packed dataset's rows are fixed
    needs_seq_len: bool = False
    uses_window: bool = False
    rows: bool = False  # batches are rows of seq_len (documents in rows, with segments)
    boundaries: bool = False  # rows mark their documents' boundaries by default
    pieces_at_seq_len: bool = False  # documents longer than seq_len reach it as seq_len pieces
    hint_keys: frozenset[str] = frozenset()  # the keys of its batcher's resume hints (none: no hints)


def _fixed(cfg: Any) -> Batcher:
    return ItemChunker() if cfg.batch_size is None else FixedBatcher(cfg.batch_size, cfg.drop_last)


def _bucket(cfg: Any) -> Batcher:
    return BucketBatcher(
        cfg.window,
        batch_size=None if cfg.max_tokens else cfg.batch_size,
        max_tokens=cfg.max_tokens,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
        drop_last=cfg.drop_last,
    )


MODES: dict[str, BatchingMode] = {
    m.name: m
    for m in (
        BatchingMode("fixed", _fixed),
        BatchingMode("bucket", _bucket, docs_only=True, uses_window=True, hint_keys=frozenset({"w", "carry", "skip"})),
        BatchingMode(
            "pack",
            lambda cfg: PackBatcher(cfg.window, cfg.seq_len, cfg.batch_size, cfg.drop_last),
            docs_only=True,
            needs_seq_len=True,
            uses_window=True,
            rows=True,
            boundaries=True,
            pieces_at_seq_len=True,
            hint_keys=frozenset({"w", "skip"}),
        ),
        BatchingMode(
            "concat",
            lambda cfg: ConcatBatcher(cfg.seq_len, cfg.batch_size, cfg.drop_last),
            docs_only=True,
            needs_seq_len=True,
            rows=True,
        ),
    )
}


def mode_of(name: str) -> BatchingMode:
    try:
        return MODES[name]
    except KeyError:
        raise ConfigError(f"batching must be one of {tuple(MODES)}, not {name!r}") from None
