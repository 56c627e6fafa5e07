"""Length bucketing: windows of ``window`` items sorted by length (stably, so the shuffle survives
among equal lengths), cut into batches of a fixed size or a padded-token budget, the batches of a
window shuffled. The partial batch at a window's end is carried into the next window."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ConfigError
from ..block import Block, concat_blocks
from .protocol import (
    COUNT_BY_ITEMS,
    COUNT_BY_WINDOWS,
    Hint,
    ItemLengths,
    as_item_lengths,
    batch_order_rng,
    batches_of,
    item_windows,
    left_out,
    round_up,
)

if TYPE_CHECKING:
    from ..stream import StreamSpec


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
                # the longest new items (stably) are carried; carried items go out in this window, so
                # an item is carried at most once
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

    def handing(self) -> BucketBatcher:
        return BucketBatcher(self.window, self.batch_size, self.max_tokens, self.multiple, drop_last=True)

    def tail(self, lengths: np.ndarray, spec: StreamSpec) -> tuple[np.ndarray, int]:
        return left_out(self.handing(), lengths, spec)

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
            return batches_of(n_items, self.batch_size, self.drop_last)
        if lengths is None:
            raise ConfigError("token-budget batch counts need the documents' lengths (an index)")
        return budget_count(
            as_item_lengths(lengths).windows(self.window), self.max_tokens, self.multiple, self.drop_last
        )

    def lower_bound(self, items: np.ndarray, tokens: np.ndarray | None, longest: int) -> np.ndarray:
        """With a batch size, the count itself. With a token budget, a batch holds at most the
        budget in real tokens, or one item longer than it."""
        if self.batch_size is not None:
            return batches_of(np.asarray(items, np.int64), self.batch_size, self.drop_last)
        cap = max(self.max_tokens, longest, 1)
        have = tokens if tokens is not None else items
        bound = -(-np.asarray(have, np.int64) // cap) - (1 if self.drop_last else 0)
        return np.maximum(bound, 0).astype(np.int64)

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
            for j in batch_order_rng(spec, i).permutation(len(plan.batches)):
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
        windows = item_windows(shuffled, k)
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
            order = batch_order_rng(spec, i).permutation(len(plan.batches))
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
