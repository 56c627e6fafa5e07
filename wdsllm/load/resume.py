"""Loader state for exact resumption, and re-planning an epoch's remainder for a new layout.

A worker's position is two integers: the epoch and the number of batches it has yielded in it.
Everything else is recomputed: the plan from (seed, epoch, rank, worker), the shuffle blocks, and
each batcher's windows from the documents' lengths. A resumed worker starts reading at the
shuffle block or window that holds its next batch, so resuming reads at most the shards in flight
at checkpoint time and never replays an epoch.

Elastic resumption (another world size or worker count) needs what every old (rank, worker) had
consumed. With equal batches every rank had yielded the same number k of batches, and DataLoader's
round-robin order says how many of them came from each worker, so the state of any one rank is
enough. The consumed items of each old worker are its first batches re-planned over lengths; the
rest of the epoch, in a fixed order, is dealt out to the new layout like a normal epoch.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import numpy as np

from ..errors import StateError
from . import plan as planmod
from . import runs
from .batching import Batcher
from .config import Config
from .handoff import batcher_for, hands_over, slices_for, tail_positions
from .mixplan import smooth_prefixes
from .plan import Slice
from .runs import Run
from .slices import Slices
from .sources.protocol import Source
from .stream import (
    PlanLabels,
    StreamSpec,
    block_order,
    block_size,
    has_lengths,
    slice_item_counts,
    slice_items,
)


def settings_fingerprint(cfg: Config) -> str:
    # equal_batches only caps how many batches come out, not which, and docs only what a batch
    # carries: a resume may change either
    fields = {k: v for k, v in asdict(cfg).items() if k not in ("equal_batches", "docs")}
    for name, default in (("uneven", "drop"), ("shift_labels", False), ("schedule", None)):
        if name in fields and fields[name] == default:  # the default: states saved before the option still fit
            del fields[name]
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Consumed items of one worker


def consumed_plan_positions(
    batcher: Batcher, lengths: PlanPrefix, spec: StreamSpec, batches: int, mixing=None, labels: PlanLabels | None = None
) -> np.ndarray:
    """Plan positions of the items in a worker's first ``batches`` batches (sorted, unique), from
    its plan-order ``lengths``; a mixture's ``mixing`` and the plan stream's sources (``labels``)
    give its block order."""
    stream = _Shuffled(lengths, spec, mixing, labels)
    if batches <= 0 or stream.n == 0:
        return np.zeros(0, np.int64)
    parts = _first_batches(batcher, stream, spec, batches)
    if not parts:
        return np.zeros(0, np.int64)
    return np.unique(stream.inverse(np.concatenate(parts).astype(np.int64)))


#: items a worker's first batches are first looked for in (then twice as many, until they agree)
FIRST_PREFIX = 1 << 14


class PlanPrefix:
    """A share's plan-order item lengths, read a slice at a time as far as asked (a re-plan early
    in an epoch reads the start of each share, not the whole of it)."""

    def __init__(self, chunks: Callable[[], Iterator[np.ndarray]], n: int):
        self._chunks, self.n = chunks(), n
        self._parts: list[np.ndarray] = []
        self._have = 0

    @classmethod
    def of_slices(cls, source: Source, slices: list[Slice], counts: list[int], spec: StreamSpec) -> PlanPrefix:
        return cls(lambda: (slice_items(source, sl, spec) for sl in slices), int(sum(counts)))

    def upto(self, n: int) -> np.ndarray:
        while self._have < n:
            part = next(self._chunks, None)
            if part is None:
                break
            self._parts.append(part)
            self._have += len(part)
        if len(self._parts) > 1:
            self._parts = [np.concatenate(self._parts)]
        return self._parts[0][:n] if self._parts else np.zeros(0, np.int64)


class _Shuffled:
    """A share's lengths in shuffled-stream order as far as asked, each block's order drawn once
    (and used again to map shuffled positions back to plan positions)."""

    def __init__(self, lengths: PlanPrefix, spec: StreamSpec, mixing, labels: PlanLabels | None):
        self.lengths, self.spec, self.mixing, self.labels = lengths, spec, mixing, labels
        self.n = lengths.n
        self.size = max(1, block_size(spec, mixing))
        self.orders: list[np.ndarray] = []

    def _labels(self, a: int, b: int) -> np.ndarray | None:
        return None if self.labels is None else self.labels.at(a, b)

    def _order(self, k: int) -> np.ndarray:
        while len(self.orders) <= k:
            i = len(self.orders)
            a, b = i * self.size, min(self.n, (i + 1) * self.size)
            if self.size <= 1:
                self.orders.append(np.zeros(1, np.int64))
            else:
                self.orders.append(block_order(self.spec, i, b - a, self.mixing, self._labels(a, b)))
        return self.orders[k]

    def upto(self, n: int) -> np.ndarray:
        plan = self.lengths.upto(n)
        if self.size <= 1:
            return plan
        out = np.empty_like(plan)
        for k, a in enumerate(range(0, len(plan), self.size)):
            out[a : a + self.size] = plan[a : a + self.size][self._order(k)]
        return out

    def inverse(self, positions: np.ndarray) -> np.ndarray:
        if self.size <= 1 or len(positions) == 0:
            return positions
        out = np.empty_like(positions)
        blocks = positions // self.size
        for k in np.unique(blocks).tolist():
            sel = blocks == k
            out[sel] = k * self.size + self._order(k)[positions[sel] - k * self.size]
        return out


def _first_batches(batcher: Batcher, stream: _Shuffled, spec: StreamSpec, batches: int) -> list:
    """The shuffled positions of a worker's first ``batches`` batches, from the shortest prefix of
    its stream that gives them: a prefix of whole shuffle blocks is shuffled as the whole is, and
    its batches are the whole stream's but where its end cuts a window or a row, so a prefix is
    taken once twice its length gives the same batches (the whole stream at the latest)."""
    n, size = stream.n, stream.size

    def first(upto: int) -> list:
        return list(itertools.islice(batcher.dry_batches(stream.upto(upto), spec), batches))

    upto = min(n, -(-FIRST_PREFIX // size) * size)
    got = first(upto)
    while upto < n:
        longer = min(n, -(-2 * upto // size) * size)
        again = first(longer)
        if len(got) == batches and all(np.array_equal(a, b) for a, b in zip(got, again)):
            break
        got, upto = again, longer
    return got


def items_between(
    source: Source, cfg: Config, epoch: int, rank: int, world: int, plan, before: list[int], after: list[int]
) -> tuple[int, int]:
    """(items, tokens) that each worker of (rank) handed out between batch ``before[w]`` and
    ``after[w]`` of ``epoch`` (what a skipped range passed over), from the plan over lengths."""
    items = tokens = 0
    workers = len(before)
    for w in range(workers):
        if after[w] <= before[w]:
            continue
        spec = cfg.spec(epoch, rank, world, w, workers)
        slices = slices_for(source, cfg, spec, plan)
        counts = slice_item_counts(source, slices, spec)
        if counts is None or not has_lengths(source):
            continue
        lengths = PlanPrefix.of_slices(source, slices, counts, spec)
        labels = PlanLabels.of(source, slices, spec)
        batcher = batcher_for(source, cfg, spec)
        shown = [
            consumed_plan_positions(batcher, lengths, spec, n, source.mixing, labels) for n in (before[w], after[w])
        ]
        passed = np.setdiff1d(shown[1], shown[0], assume_unique=True)
        items += len(passed)
        tokens += int(lengths.upto(int(passed.max()) + 1)[passed].sum()) if len(passed) else 0
    return items, tokens


# ----------------------------------------------------------------------------------------------
# The remainder of an epoch, for a new layout


#: consumers whose slices a remainder plan keeps once dealt (``RemainderPlan.slices_for``)
MAX_KEPT_CONSUMERS = 16


@dataclass
class RemainderPlan:
    """Epoch ``epoch`` minus what an old layout (world x workers) had consumed.

    ``consumed[r][w]`` is how many batches old (rank r, worker w) had yielded; ``base`` is the plan
    the old layout was itself following (None: the normal epoch plan).
    """

    epoch: int
    world: int
    workers: int
    consumed: list[list[int]]
    base: RemainderPlan | None = None
    remainder: ClassVar[bool] = True  # ``counts.EpochPlan``
    #: ``sequence``'s answer, once made (it takes a pass over every old share's lengths)
    _sequence: tuple[Slices, list[int]] | None = field(default=None, repr=False, compare=False)
    #: ``slices_for``'s answers, by consumer, once made (ahead of a change's step: steer/ahead.py)
    _dealt: dict = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dealt": {}}  # a spawned worker makes its own

    def to_json(self) -> dict:
        return {
            "epoch": self.epoch,
            "world": self.world,
            "workers": self.workers,
            "consumed": self.consumed,
            "base": self.base.to_json() if self.base else None,
        }

    @classmethod
    def from_json(cls, d: dict | None) -> RemainderPlan | None:
        if d is None:
            return None
        return cls(d["epoch"], d["world"], d["workers"], d["consumed"], cls.from_json(d.get("base")))

    def sequence(self, source: Source, cfg: Config) -> tuple[Slices, list[int]]:
        """Every remaining item, in a fixed order: old ranks, then old workers, plan order."""
        if self._sequence is not None:
            return self._sequence
        slices_out: list[Slices] = []
        for r in range(self.world):
            for w in range(self.workers):
                spec = cfg.spec(self.epoch, r, self.world, w, self.workers)
                slices = slices_for(source, cfg, spec, self.base)
                counts = slice_item_counts(source, slices, spec)
                if counts is not None and not self.consumed[r][w] and not hands_over(source, cfg, spec):
                    slices_out.append(Slices.of(slices).take(np.flatnonzero(counts)))  # nothing of it gone
                    continue
                if counts is None or not has_lengths(source):
                    raise StateError(
                        "resuming with another world size or worker count needs the dataset's index (lengths.npy)"
                    )
                lengths = PlanPrefix.of_slices(source, slices, counts, spec)
                labels = PlanLabels.of(source, slices, spec)
                batcher = batcher_for(source, cfg, spec)
                gone = consumed_plan_positions(batcher, lengths, spec, self.consumed[r][w], source.mixing, labels)
                if hands_over(source, cfg, spec):  # its tail is in its rank's last worker's slices
                    gone = np.union1d(gone, tail_positions(source, cfg, spec, slices)[0])
                slices_out.append(runs.remaining(Run.of(slices, counts), gone))  # partly consumed: picks
        joined = Slices.join(slices_out)
        self._sequence = (joined, slice_item_counts(source, joined, cfg.spec(self.epoch, 0, 1, 0, 1)))
        return self._sequence

    def slices_for(self, source: Source, cfg: Config, rank: int, world: int, worker: int, workers: int) -> Slices:
        """One dataset: the remaining sequence split like an epoch. A mixture: each source's
        remainder (per part of the epoch) split on its own and interleaved in rounds of a shuffle
        block, as ``MixPlanner.slices`` deals a fresh epoch, so every new consumer keeps the mix.
        Kept for the consumer (read-only)."""
        key = (rank, world, worker, workers)
        got = self._dealt.get(key)
        if got is None:
            got = self._slices_for(source, cfg, rank, world, worker, workers)
            if len(self._dealt) < MAX_KEPT_CONSUMERS:  # the first asked: a rank's workers, made ahead
                self._dealt = {**self._dealt, key: got}
        return got

    def _slices_for(self, source: Source, cfg: Config, rank: int, world: int, worker: int, workers: int) -> Slices:
        slices, counts = self.sequence(source, cfg)
        split = cfg.spec(self.epoch, 0, 1, 0, 1).splits(source.mode)
        mixing = source.mixing
        if mixing is None:  # in whole batches per worker, as an epoch is (``Config.share_unit``)
            unit = cfg.share_unit(source.mode)
            a, b = planmod.consumer_share(int(sum(counts)), rank, world, worker, workers, unit=unit)
            return Run.of(slices, counts).cut(a, b, split)
        block = mixing.block_size(cfg.spec(self.epoch, rank, world, worker, workers))
        out: list[Slices] = []
        for strands in self.strands(source, cfg, slices, counts):
            shares = [planmod.consumer_share(strand.total, rank, world, worker, workers) for strand in strands]
            total = sum(b - a for a, b in shares)
            if not total:
                continue
            rounds = -(-total // block)
            upto = smooth_prefixes(
                [b - a for a, b in shares], np.minimum(total, np.arange(1, rounds + 1, dtype=np.int64) * block)
            )
            upto = np.vstack([np.zeros((1, len(shares)), np.int64), upto])
            firsts = np.asarray([a for a, _ in shares], np.int64)
            out.append(runs.deal(strands, (upto + firsts[None, :]).T, split))
        return Slices.join(out)

    def share_items(self, source: Source, cfg: Config, world: int, workers: int) -> np.ndarray:
        """[world, workers] items of every consumer's share, as ``slices_for`` deals them, from the
        remaining sequence's totals alone (``counts.RemainderItems``: no consumer's slices made)."""
        slices, counts = self.sequence(source, cfg)
        if source.mixing is None:
            unit = cfg.share_unit(source.mode)
            starts, stops = planmod.consumer_shares(int(sum(counts)), world, workers, unit=unit)
            return stops - starts
        out = np.zeros((world, workers), np.int64)
        for strands in self.strands(source, cfg, slices, counts):
            for strand in strands:
                starts, stops = planmod.consumer_shares(strand.total, world, workers)
                out += stops - starts
        return out

    def excluded(self) -> tuple[int, int]:
        """(items, tokens) that exclusions took out of this epoch's plans (``steer.plans.SteeredPlan``)."""
        return self.base.excluded() if self.base is not None else (0, 0)

    def strands(self, source: Source, cfg: Config, slices: Sequence[Slice], counts: Sequence[int]) -> list[list[Run]]:
        """Per part of the epoch, per source of a mixture: its remaining slices and counts."""
        mixing = source.mixing
        return runs.strands(Run.of(slices, counts), mixing.sources_of_shards, mixing.sources)
