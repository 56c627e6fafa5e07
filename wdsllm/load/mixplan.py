"""A mixture's epoch plan: quotas, repeats and subsets from (seed, epoch) and the indexes, every
consumer's share, and the order that interleaves the sources. Pure numpy, no torch.

One rule gives quotas, repeats and subsets. Each source has an endless stream of passes over its
items: pass p visits its blocks (its shards cut as ``plan.epoch_blocks`` cuts one dataset's) in an
order drawn from (seed, source name, p), items in block order, so a source of one shard is
reshuffled at every pass and the stretch each rank reads moves with it. The run takes consecutive
stretches of that stream: an epoch (or a part of one between two schedule points) takes the next
``quota`` of it. A quota above the source's size spans several
passes, so every item appears floor(q/size) or one more times, each pass in a fresh order; a quota
below it is a subset that differs each epoch and walks the whole source before any item repeats.
With unit="tokens" a quota is cut at the first item whose end reaches it (within one document).

Each stretch is split among the consumers (rank, then worker) as ``plan.consumer_shares`` splits a
dataset, so exactly-once holds within the quota for any layout. A consumer reads its parts of the
sources in rounds of one shuffle block, each source's part of a round one contiguous run, and the
shuffle block's order (``Mixing.permutation``) interleaves them smoothly: the sources' slots follow
a fixed even pattern and only which item of a source fills which of its slots is random. So every
window of a few batches holds the sources in proportion, which a per-item random draw does not.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..errors import MixtureError
from . import plan as planmod
from .block import ID_SHIFT
from .plan import consumer_share, consumer_shares
from .runs import Run, deal
from .slices import Slices
from .stream import StreamSpec

if TYPE_CHECKING:
    from .mixture import Mixture
    from .sources.mixture import MixturePart

#: the random stream of a source's pass orders (plan.py's streams are 1-5)
STREAM_MIX_PASS = 6
#: items per mixing block when the stream is not shuffled (shuffle=False or shuffle_buffer <= 1)
DEFAULT_MIX_WINDOW = 1024
#: what a pass orders: 2, blocks of shards (1 was whole shards); part of a plan's identity
PASS_ORDER = 2
#: the most passes over one source an epoch may take, and the most entries its plan may hold
#: beyond those of reading each source once (a slice per block of each repeated pass, a row of
#: counts per shuffle block): refused before any is made, as an epoch far larger than a source
#: would plan (and walk) without end
MAX_EPOCH_PASSES = 1 << 16
MAX_PLAN_ENTRIES = 1 << 22


# ----------------------------------------------------------------------------------------------
# Even patterns


def smooth_pattern(counts: np.ndarray) -> np.ndarray:
    """Source labels of ``sum(counts)`` slots spread evenly: source s's k-th slot sits at time
    floor((2k+1) N / 2 n_s), ties broken by source. Any window holds each source in proportion."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    k = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    times = ((2 * k + 1) * total) // (2 * counts[labels]) if total else k
    return labels[np.argsort(times * len(counts) + labels, kind="stable")]  # by time, then source


def smooth_prefix(counts: Sequence[int], x: int) -> list[int]:
    """How many slots of each source the first ``x`` slots of ``smooth_pattern(counts)`` hold
    (exact integers; no pattern is built)."""
    counts = [int(c) for c in counts]
    total = sum(counts)
    if x >= total:
        return counts

    def before(t: int) -> list[int]:  # slots of each source at times < t
        return [min(n, max(0, -(-(2 * n * t - total) // (2 * total)))) if n else 0 for n in counts]

    lo, hi = 0, total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(before(mid)) <= x:
            lo = mid
        else:
            hi = mid - 1
    got = before(lo)
    at = [b - a for a, b in zip(got, before(lo + 1))]
    extra = x - sum(got)
    for s in range(len(counts)):
        if extra and at[s]:
            got[s] += 1
            extra -= 1
    return got


def smooth_prefixes(counts: Sequence[int], xs: np.ndarray) -> np.ndarray:
    """[len(xs), sources]: ``smooth_prefix(counts, x)`` for every x of ``xs`` at once (the same
    integers; vectorised over x where the products fit in int64)."""
    n = np.asarray([int(c) for c in counts], np.int64)
    xs = np.asarray(xs, np.int64)
    total = int(n.sum())
    if total == 0:
        return np.zeros((len(xs), len(n)), np.int64)
    if total >= 1 << 30:  # 2 n t might not fit: one at a time, in Python integers
        return np.array([smooth_prefix(counts, int(x)) for x in xs], np.int64).reshape(len(xs), len(n))

    def before(t: np.ndarray) -> np.ndarray:  # [len(t), sources] slots at times < t
        v = -(-(2 * n[None, :] * t[:, None] - total) // (2 * total))
        return np.where(n > 0, np.minimum(n, np.maximum(0, v)), 0)

    lo, hi = np.zeros(len(xs), np.int64), np.full(len(xs), total, np.int64)
    while (lo < hi).any():
        mid = (lo + hi + 1) // 2
        fits = before(mid).sum(axis=1) <= xs
        lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid - 1)
    got = before(lo)
    at = (before(lo + 1) - got) > 0
    extra = xs - got.sum(axis=1)
    got += at & (np.cumsum(at, axis=1) <= extra[:, None])
    return np.where((xs >= total)[:, None], n[None, :], got)


def stratified_pattern(counts: np.ndarray, group: int) -> np.ndarray:
    """Labels whose every ``group`` consecutive slots (from the first) hold each source's share of
    what is left to within one: each group takes floor or ceil of its proportional part (largest
    remainders first), evenly spread inside the group."""
    remaining = np.asarray(counts, np.int64).copy()
    out = []
    while remaining.sum() > 0:
        left = int(remaining.sum())
        size = min(group, left)
        take = remaining * size // left
        rest = remaining * size % left
        short = size - int(take.sum())
        if short:
            take[np.lexsort((np.arange(len(rest)), -rest))[:short]] += 1
        out.append(smooth_pattern(take))
        remaining -= take
    return np.concatenate(out) if out else np.zeros(0, np.int64)


# ----------------------------------------------------------------------------------------------
# The order inside a shuffle block


@dataclass(frozen=True)
class Mixing:
    """How a mixture orders the items of a block of its stream: ``bases[s]`` is source s's first
    unit in the mixture's numbering; ``group`` (stratified) is the batch size each group of slots
    holds in proportion; ``window`` is the block size when the stream is not shuffled."""

    bases: tuple[int, ...]
    group: int = 0
    window: int = DEFAULT_MIX_WINDOW

    def sources_of_shards(self, shards: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self.bases), np.asarray(shards, np.int64), side="right") - 1

    @property
    def sources(self) -> int:
        return len(self.bases) - 1

    @functools.cached_property
    def _source_of_shard(self) -> np.ndarray:
        """Every shard's source, then -1: indexed by ``id >> ID_SHIFT``, the padding id -1 lands
        on the last entry. One lookup per batch, not a search."""
        counts = np.diff(np.asarray(self.bases, np.int64))
        return np.append(np.repeat(np.arange(len(counts), dtype=np.int64), counts), -1)

    def sources_of_ids(self, ids: np.ndarray) -> np.ndarray:
        """Source of each item or document id (-1, no document, stays -1)."""
        return self._source_of_shard.take(np.asarray(ids, np.int64) >> ID_SHIFT)

    def block_size(self, spec: StreamSpec) -> int:
        size = spec.shuffle_buffer if spec.shuffle_buffer > 1 else self.window
        if self.group:
            size = -(-size // self.group) * self.group
        return size

    def permutation(self, spec: StreamSpec, block: int, labels: np.ndarray) -> np.ndarray:
        """The order of a block's items (``labels``: source + sources x part of the epoch, plan
        order, parts rising): each part's slots keep their place and follow the even pattern of
        its counts; a source's items fill its slots in a random order drawn from (seed, epoch,
        rank, worker, block), or in plan order when not shuffled."""
        labels = np.asarray(labels, np.int64)
        n = len(labels)
        k = self.sources
        pattern = np.empty(n, np.int64)
        parts = labels // k
        cuts = [0, *(np.flatnonzero(np.diff(parts)) + 1).tolist(), n]
        for a, b in itertools.pairwise(cuts):
            if b > a:
                counts = np.bincount(labels[a:b] % k, minlength=k)
                order = stratified_pattern(counts, self.group) if self.group else smooth_pattern(counts)
                pattern[a:b] = order + k * parts[a]
        if spec.shuffle_buffer > 1:
            keys = planmod.rng(
                spec.seed, planmod.STREAM_SAMPLE_SHUFFLE, spec.epoch, spec.rank, spec.worker, block
            ).random(n)
            by_key = np.argsort(keys)  # then stably by label: lexsort((keys, labels)) for less work
            items = by_key[_stable_order(labels[by_key])]
        else:
            items = _stable_order(labels)
        perm = np.empty(n, np.int64)
        perm[_stable_order(pattern)] = items
        return perm


def _stable_order(labels: np.ndarray) -> np.ndarray:
    """``argsort(labels, kind="stable")``; small labels as int16, which numpy radix-sorts."""
    if len(labels) and labels.min() >= 0 and labels.max() < np.iinfo(np.int16).max:
        labels = labels.astype(np.int16)
    return np.argsort(labels, kind="stable")


# ----------------------------------------------------------------------------------------------
# A source's endless stream of passes


@dataclass(frozen=True)
class _Pass:
    """One pass's order: its blocks (ids into ``PassStream.blocks``), their shards, first items
    and item counts in that order, and the running ends of the counts."""

    order: np.ndarray
    shards: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray
    ends: np.ndarray


class PassStream:
    """Source ``source``'s items as an endless sequence of passes (positions 0, 1, ...).

    A pass visits the source's blocks in an order drawn from (seed, source name, pass), each
    block's items in unit order. The blocks are the source's shards cut as an epoch of one dataset
    cuts them (``plan.epoch_blocks``: about ``EPOCH_BLOCKS`` per source, each read as one range;
    raw text's units stay whole), so a source of one shard is reshuffled at every pass, and the
    stretch a rank reads moves with it.

    A subset is a set: when an epoch (``epoch_units(e)``: the source's units taken by the first
    e epochs) starts inside pass p-1 and runs into pass p, pass p visits the blocks that epoch
    read in pass p-1 last (the block it started in first), so the epoch takes the start of pass
    p from the items it has not shown yet."""

    def __init__(
        self,
        source: MixturePart,
        seed: int,
        shuffle: bool,
        epoch_units: Callable[[int], int] | None = None,
        unit: str = "items",
    ):
        self.source = source
        self.epoch_units = epoch_units
        self.unit = unit
        self.items = np.asarray(source.items_per_shard(), np.int64)
        self.shard_tokens = np.asarray(source.tokens_per_shard(), np.int64)
        self.size = int(self.items.sum())
        self.token_size = int(self.shard_tokens.sum())
        self.blocks = planmod.epoch_blocks(self.items, planmod.block_tokens(source.source), 0, 0, shuffle=False)
        self.seed = seed
        self.shuffle = shuffle
        self.key = int.from_bytes(hashlib.sha256(source.name.encode()).digest()[:7], "little")
        self._orders: dict[int, _Pass] = {}
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        """Tokens of each block: the index's where a block is its whole shard, else the lengths'."""
        if self._tokens is None:
            b = self.blocks
            tokens = self.shard_tokens[b.shards]
            cut = b.counts < self.items[b.shards]
            if cut.any():
                tokens[cut] = self.source.range_tokens(b.shards[cut], b.firsts[cut], b.counts[cut])
            self._tokens = tokens
        return self._tokens

    def order(self, p: int) -> _Pass:
        """Pass p's order of blocks."""
        got = self._orders.get(p)
        if got is None:
            if self.shuffle and self.epoch_units is not None:  # each pass's order needs the one before
                for earlier in range(max((k for k in self._orders if k < p), default=0) + 1, p):
                    self._make_order(earlier)
            got = self._make_order(p)
        return got

    def _make_order(self, p: int) -> _Pass:
        n = len(self.blocks.shards)
        draw = planmod.rng(self.seed, STREAM_MIX_PASS, self.key, p)
        order = draw.permutation(n) if self.shuffle else np.arange(n)
        tail = self._tail_start(p)
        if tail is not None:
            order = self._tail_last(order, p - 1, tail)
        b = self.blocks
        counts = b.counts[order]
        got = _Pass(order, b.shards[order], b.firsts[order], counts, np.cumsum(counts))
        if len(self._orders) >= 4:  # replaced, not evicted in place: the counts' thread plans too
            self._orders = {}
        self._orders[p] = got
        return got

    def _tail_start(self, p: int) -> int | None:
        """Offset in pass p-1 where the epoch that runs into pass p starts; None when no epoch
        starts inside pass p-1 and ends inside pass p (or passes are not reshuffled)."""
        if p <= 0 or not self.shuffle or self.epoch_units is None or self.size == 0:
            return None
        full = self.token_size if self.unit == "tokens" else self.size
        below = self._units_before(p * self.size)  # the most units a start inside pass p-1 can be
        e = _last_at_most(self.epoch_units, below)
        start = self.epoch_units(e)
        if start <= (p - 1) * full or self.epoch_units(e + 1) - start > full:
            return None  # no epoch starts inside pass p-1, or a repeat epoch (no order avoids a second)
        return self.position_of(start, self.unit) - (p - 1) * self.size

    def _units_before(self, position: int) -> int:
        """The most units whose ``position_of`` is below ``position`` (> 0)."""
        if self.unit != "tokens":
            return position - 1
        p = (position - 1) // self.size
        last = self._item_lengths(self.order(p), -1)
        return (p + 1) * self.token_size - int(last[-1]) if len(last) else p * self.token_size

    def _item_lengths(self, ps: _Pass, i: int) -> np.ndarray:
        """Token count of each item of block ``i`` of pass ``ps``."""
        first = int(ps.firsts[i])
        return self.source.item_lengths(int(ps.shards[i]), first, first + int(ps.counts[i]))

    def _tail_last(self, order: np.ndarray, prev: int, offset: int) -> np.ndarray:
        """``order`` with the blocks pass ``prev`` held from ``offset`` on moved to the end, in
        pass ``prev``'s order."""
        before = self.order(prev)
        moved = before.order[int(np.searchsorted(before.ends, offset, side="right")) :]
        keep = order[~np.isin(order, moved)]
        return np.concatenate([keep, moved])

    def slices(self, a: int, b: int) -> Slices:
        """Slices (the source's own shard numbers) covering stream positions [a, b)."""
        out: list[Slices] = []
        while a < b:
            p, off = divmod(a, self.size)
            ps = self.order(p)
            stop = min(b - p * self.size, self.size)
            out.append(planmod.slices_of_range(ps.shards, ps.counts, ps.ends, off, stop, ps.firsts))
            a = p * self.size + stop
        return Slices.join(out)

    def tokens_before(self, positions: np.ndarray, head_tokens: HeadTokens) -> np.ndarray:
        """Tokens of the stream before each of ``positions``: whole passes and blocks from the
        block table, the items of a block cut by a position from ``head_tokens`` (no shard read
        whole)."""
        positions = np.asarray(positions, np.int64)
        passes, offsets = np.divmod(positions, max(1, self.size))
        out = passes * self.token_size
        for p in np.unique(passes).tolist():
            at = np.flatnonzero(passes == p)
            ps = self.order(p)
            token_ends = np.concatenate([[0], np.cumsum(self.tokens[ps.order])])
            off = offsets[at]
            i = np.searchsorted(ps.ends, off, side="right")  # the block (in pass order) holding each
            inside = i < len(ps.order)
            before = np.full(len(off), token_ends[-1], np.int64)
            j = i[inside]
            k = off[inside] - (ps.ends[j] - ps.counts[j])  # items of that block before the position
            shards, firsts = ps.shards[j], ps.firsts[j]
            before[inside] = token_ends[j] + head_tokens(shards, firsts + k) - head_tokens(shards, firsts)
            out[at] += before
        return out

    def position_of(self, units: int, unit: str) -> int:
        """The stream position where ``units`` of the stream are reached: items as they are; tokens
        at the first item whose end reaches them."""
        if unit == "items" or units <= 0:
            return max(0, units)
        p, rest = divmod(units, self.token_size)
        if rest == 0:
            return p * self.size
        ps = self.order(p)
        tokens = self.tokens[ps.order]
        token_ends = np.cumsum(tokens)
        i = int(np.searchsorted(token_ends, rest, side="left"))  # the block where ``rest`` is reached
        before = int(token_ends[i] - tokens[i])
        lengths = self._item_lengths(ps, i)
        k = int(np.searchsorted(np.cumsum(lengths), rest - before, side="left")) + 1
        return p * self.size + int(ps.ends[i] - ps.counts[i]) + min(k, int(ps.counts[i]))


#: tokens of the first k[i] items of (a source's own) shard shards[i], for every i
HeadTokens = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _last_at_most(rising: Callable[[int], int], limit: int) -> int:
    """The largest e >= 0 with ``rising(e) <= limit`` (``rising`` non-decreasing, rising(0) = 0);
    searched by doubling, then halving; an e whose value never passes ``limit`` ends the search."""
    lo, hi = 0, 1
    while rising(hi) <= limit:
        lo, hi = hi, hi * 2
        if hi > 1 << 62:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if rising(mid) <= limit else (lo, mid)
    return lo


# ----------------------------------------------------------------------------------------------
# Quotas over the run, and each consumer's share


class MixPlanner:
    """Every epoch's stretches of every source, and each consumer's slices (an ``EpochPlan`` per
    epoch through ``plan``)."""

    def __init__(self, mixture: Mixture, sources: list[MixturePart], bases: np.ndarray, seed: int, shuffle: bool):
        self.mixture = mixture
        self.bases = bases
        self.streams = [
            PassStream(s, seed, shuffle, functools.partial(self.epoch_units, i), mixture.unit)
            for i, s in enumerate(sources)
        ]
        sizes = [st.token_size if mixture.unit == "tokens" else st.size for st in self.streams]
        self.sizes = sizes
        self.epoch = int(mixture.epoch_size or sum(sizes))
        self.step_units: int | None = None  # units per step (at_step schedules), set by bind
        for name, size, w in zip(mixture.names, sizes, mixture.base_weights):
            if size == 0 and (w > 0 or any(p.weights[mixture.names.index(name)] > 0 for p in mixture.phases)):
                raise MixtureError(f"mixture source {name!r} is empty but has a positive weight")
        self._segments: dict[int, list[list[tuple[int, int]]]] = {}
        #: the last consumers' slices (a re-plan while the run trains starts from the running one's)
        self._slices: dict[tuple, Slices] = {}
        #: weights set while the run trained: (the first epoch they plan, weights), in order
        self.steered: tuple[tuple[int, tuple[float, ...]], ...] = ()
        self.excluded: tuple[tuple[int, int], ...] = ()
        #: weights set inside an epoch, from their point in the run's units (reports only)
        self.noted: tuple[tuple[int, tuple[float, ...]], ...] = ()
        self.noted_version = 0
        self._check_passes()

    def steer(self, phases: Sequence[tuple[int, tuple[float, ...]]], excluded: Sequence[tuple[int, int]] = ()) -> None:
        """Weights changed while the run trained, each from the start of an epoch on (after the
        declared phases that come before it, before those that come after), and sources excluded
        from an epoch on: ``excluded`` holds (epoch, source)."""
        steered = tuple((int(e), tuple(w)) for e, w in phases)
        excluded = tuple((int(e), int(s)) for e, s in excluded)
        changed = {*set(steered) ^ set(self.steered), *set(excluded) ^ set(self.excluded)}
        self.steered, self.excluded = steered, excluded
        if changed:  # an epoch's plan depends on changes from its own start or before only
            first = min(e for e, _ in changed)
            self._segments = {e: got for e, got in self._segments.items() if e < first}
            self._slices = {key: got for key, got in self._slices.items() if key[0] < first}

    def report_phases(self) -> list[tuple[int, tuple[float, ...]]]:
        """The phases a report judges the realized mix by: the plan's, and weights set while the
        run trained from the point (in the run's units) where they took effect, not only from the
        next epoch's start, where the plan takes them up (``noted``)."""
        phases = self.phases()
        for at, weights in self.noted:
            phases = [p for p in phases if p[0] < at] + [(at, weights)] + [p for p in phases if p[0] > at]
        return phases

    def note(self, at: int, weights: tuple[float, ...]) -> None:
        """Weights in force from ``at`` units of the run on (what a report judges by)."""
        self.noted = (*self.noted, (int(at), tuple(weights)))
        self.noted_version += 1

    def _without_excluded(self, out: list[tuple[int, tuple[float, ...]]]) -> list[tuple[int, tuple[float, ...]]]:
        """Phases with each excluded source's weight zero from its epoch on (the rest renormalised)."""
        for epoch, _ in sorted(self.excluded):
            at = epoch * self.epoch
            if all(p[0] != at for p in out):
                current = [p for p in out if p[0] < at][-1][1]
                out = sorted([*out, (at, current)])
        fixed = []
        for start, weights in out:
            gone = {s for e, s in self.excluded if start >= e * self.epoch}
            kept = [0.0 if s in gone else w for s, w in enumerate(weights)]
            total = sum(kept)
            fixed.append((start, tuple(w / total for w in kept) if total > 0 else tuple(kept)))
        return fixed

    # -- bounds, before anything is planned ------------------------------------------------------
    def _epoch_bounds(self, more: tuple[float, ...] | None = None) -> tuple[list[int], list[int]]:
        """Upper bounds, valid in every epoch and phase, on the passes over each source and the
        items taken of it (a source takes at most its largest weight's share of the epoch, in any
        phase declared or set while the run trains, or ``more``; an item holds a unit or more)."""
        vectors = [self.mixture.base_weights, *(ph.weights for ph in self.mixture.phases)]
        vectors += [w for _, w in self.steered] + ([more] if more is not None else [])
        largest = np.max([np.asarray(v, float) / (sum(v) or 1) for v in vectors], axis=0)
        passes, items = [], []
        for s, st in enumerate(self.streams):
            share = float(largest[s])
            p = -(-int(self.epoch * share) // self.sizes[s]) + 2 if self.sizes[s] and share > 0 else 0
            passes.append(p)
            items.append(min(p * st.size, self.epoch + 1))
        return passes, items

    def check_weights(self, weights: tuple[float, ...]) -> None:
        """Refuse weights (set while the run trains) under which an epoch would take a source more
        times over than a plan may hold (``MixtureError``, as for a declared weight)."""
        self._check_passes(weights)

    def _check_passes(self, more: tuple[float, ...] | None = None) -> None:
        """Refuse an epoch that repeats a source beyond the bounds: the slices of its repeats (a
        source's blocks once per pass, over what reading each source once already holds)."""
        passes, _ = self._epoch_bounds(more)
        repeats = [max(0, p - 2) * len(st.blocks.shards) for p, st in zip(passes, self.streams)]
        worst = int(np.argmax(passes))
        if passes[worst] > MAX_EPOCH_PASSES or sum(repeats) > MAX_PLAN_ENTRIES:
            name, unit = self.mixture.names[worst], self.mixture.unit
            raise MixtureError(
                f"{self._epoch_key()}: an epoch of {self.epoch:,} {unit} can take source {name!r} "
                f"({self.sizes[worst]:,} {unit}) about {passes[worst] - 2:,} times over, {sum(repeats):,} slices "
                f"of repeats (at most {MAX_EPOCH_PASSES:,} passes over a source and {MAX_PLAN_ENTRIES:,} slices "
                "of repeats an epoch): give a smaller epoch or weight it less"
            )

    def check_rounds(self, block: int) -> None:
        """Refuse an epoch of more shuffle blocks of ``block`` items than a plan may hold."""
        _, items = self._epoch_bounds()
        rounds = (sum(items) // max(1, block) + 1) * len(self.streams)
        if rounds > MAX_PLAN_ENTRIES:
            raise MixtureError(
                f"{self._epoch_key()}: an epoch of {self.epoch:,} {self.mixture.unit} can hold {sum(items):,} items, "
                f"{rounds:,} rows of counts in shuffle blocks of {block:,} (at most {MAX_PLAN_ENTRIES:,}): give a "
                "smaller epoch or a larger shuffle_buffer"
            )

    def _epoch_key(self) -> str:
        key = "epoch_tokens" if self.mixture.unit == "tokens" else "epoch_items"
        given = self.mixture.epoch_size is not None
        return self.mixture.where_key(key) if given else f"{self.mixture.where_key('sources')} (epoch: their sizes)"

    # -- the run's phases -----------------------------------------------------------------------
    def phases(self) -> list[tuple[int, tuple[float, ...]]]:
        """(start in units, weights) of each phase, the first from 0."""
        out = [(0, self.mixture.base_weights)]
        for ph in self.mixture.phases:
            if ph.at is not None:
                at = ph.at
            else:
                if self.step_units is None:
                    raise MixtureError("at_step needs fixed batching (or rows) to know the units of a step")
                at = ph.at_step * self.step_units
            if at == 0:
                out[0] = (0, ph.weights)
            else:
                out.append((at, ph.weights))
        for epoch, weights in self.steered:  # from its point to the next declared one (which it replaces there)
            at = epoch * self.epoch
            out = [p for p in out if p[0] < at] + [(at, weights)] + [p for p in out if p[0] > at]
        return self._without_excluded(out) if self.excluded else out

    def cumulative(self, g: int) -> list[int]:
        """Units of each source taken by the first ``g`` units of the run (exact rounding of the
        weights integrated over the phases, so epochs never drift)."""
        phases = self.phases()
        acc = [Fraction(0)] * len(self.streams)
        for j, (start, weights) in enumerate(phases):
            end = phases[j + 1][0] if j + 1 < len(phases) else None
            span = (min(g, end) if end is not None else g) - start
            if span <= 0:
                break
            for s, w in enumerate(weights):
                acc[s] += Fraction(w) * span
        return [int(a + Fraction(1, 2)) for a in acc]

    def epoch_units(self, source: int, epochs: int) -> int:
        """Units of source ``source`` taken by the first ``epochs`` epochs."""
        return self.cumulative(epochs * self.epoch)[source]

    def segments(self, epoch: int) -> list[list[tuple[int, int]]]:
        """Epoch ``epoch``'s stretches: per segment (cut at schedule points), per source, the
        first stream position and the item count."""
        got = self._segments.get(epoch)
        if got is not None:
            return got
        a, b = epoch * self.epoch, (epoch + 1) * self.epoch
        cuts = sorted({a, b, *(p for p, _ in self.phases() if a < p < b)})
        unit = self.mixture.unit
        positions = [[st.position_of(u, unit) for st, u in zip(self.streams, self.cumulative(g))] for g in cuts]
        got = [[(p0, p1 - p0) for p0, p1 in zip(positions[j], positions[j + 1])] for j in range(len(cuts) - 1)]
        if len(self._segments) >= 8:  # replaced, not evicted in place: the counts' thread plans too
            self._segments = {}
        self._segments[epoch] = got
        return got

    def quotas(self, epoch: int) -> list[int]:
        """Items of each source in epoch ``epoch``."""
        return [sum(seg[s][1] for seg in self.segments(epoch)) for s in range(len(self.streams))]

    def unit_quotas(self, epoch: int) -> list[int]:
        """Units (tokens or items) of each source planned for epoch ``epoch``."""
        a, b = self.cumulative(epoch * self.epoch), self.cumulative((epoch + 1) * self.epoch)
        return [y - x for x, y in zip(a, b)]

    def share_sizes(
        self, epoch: int, world: int, workers: int, head_tokens: Sequence[HeadTokens] | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """([world, workers] items, and tokens when ``head_tokens`` (one per source) is given) of
        every consumer's share of the epoch, from the stretches alone: what ``slices`` holds,
        without making any consumer's slices."""
        items = np.zeros((world, workers), np.int64)
        tokens = None if head_tokens is None else np.zeros((world, workers), np.int64)
        for seg in self.segments(epoch):
            for s, (first, n) in enumerate(seg):
                starts, stops = consumer_shares(n, world, workers, first)
                items += stops - starts
                if tokens is not None and n:
                    points, where = np.unique(np.concatenate([starts.ravel(), stops.ravel()]), return_inverse=True)
                    before = self.streams[s].tokens_before(points, head_tokens[s])[where]
                    tokens += (before[starts.size :] - before[: starts.size]).reshape(world, workers)
        return items, tokens

    def slices(self, epoch: int, rank: int, world: int, worker: int, workers: int, block: int) -> Slices:
        """The slices (combined shard numbers) consumer (rank, worker) reads, in reading order:
        each segment's share in rounds of ``block`` items, the sources in turn inside a round.
        The last two asked are kept (read-only: every user takes copies)."""
        key = (epoch, rank, world, worker, workers, block)
        got = self._slices.get(key)
        if got is None:
            got = self._dealt(epoch, rank, world, worker, workers, block)
            kept = self._slices if len(self._slices) < 2 else {}  # replaced, not evicted in place
            self._slices = {**kept, key: got}
        return got

    def _dealt(self, epoch: int, rank: int, world: int, worker: int, workers: int, block: int) -> Slices:
        out: list[Slices] = []
        for group, seg in enumerate(self.segments(epoch)):
            firsts, counts = [], []
            for first, n in seg:
                a, b = consumer_share(n, rank, world, worker, workers, first)
                firsts.append(a)
                counts.append(b - a)
            total = sum(counts)
            if not total:
                continue
            rounds = -(-total // block)
            upto = smooth_prefixes(counts, np.minimum(total, np.arange(1, rounds + 1, dtype=np.int64) * block))
            cuts = np.vstack([np.zeros((1, len(counts)), np.int64), upto]).T  # [source, round + 1]
            runs = [self._run(s, firsts[s], c, group) for s, c in enumerate(counts)]
            out.append(deal(runs, cuts, split=False))
        return Slices.join(out)

    def _run(self, source: int, first: int, count: int, group: int) -> Run:
        """Source ``source``'s stream positions [first, first + count) as a run of slices in
        combined shard numbers, marked as part ``group`` of the epoch."""
        got = self.streams[source].slices(first, first + count)
        groups = np.full(len(got), group, np.int64) if group else None
        shards = got.shards + int(self.bases[source])
        return Run(Slices(shards, got.starts, got.stops, None, groups), got.stops - got.starts)


@dataclass
class MixturePlan:
    """The ``counts.EpochPlan`` of one epoch of a mixture."""

    planner: Any
    mixing: Mixing
    epoch: int
    remainder: ClassVar[bool] = False

    def slices_for(self, source: Any, cfg: Any, rank: int, world: int, worker: int, workers: int) -> Slices:
        block = self.mixing.block_size(cfg.spec(self.epoch, rank, world, worker, workers))
        return self.planner.slices(self.epoch, rank, world, worker, workers, block)

    def share_sizes(
        self, world: int, workers: int, head_tokens: Sequence[HeadTokens] | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """[world, workers] items (and tokens) of every consumer's share (``counts.SizedPlan``)."""
        return self.planner.share_sizes(self.epoch, world, workers, head_tokens)

    def identity(self) -> list:
        """What, beside the source's fingerprint and the settings, decides this plan's shares."""
        return ["mixture", PASS_ORDER, self.epoch, self.planner.step_units, self.mixing.group, self.mixing.window]
