"""The log of a run's changes: what a trainer (or an operator's file) changed while the run trained,
and the planned step at which each took effect. A state carries it; a resume reads it like any
other setting. Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import SteeringError
from .schedule import Schedule, _int

#: the most changes a run's log may hold (each one is in every state)
MAX_CHANGES = 1 << 16


@dataclass(frozen=True)
class Skip:
    """Planned steps [start, stop) are not yielded; ``asked`` is the start the caller named (a
    range named partly in the past takes effect from the next planned step)."""

    start: int
    stop: int
    asked: int
    kind: str = "skip"

    def to_json(self) -> dict:
        return {"kind": self.kind, "start": self.start, "stop": self.stop, "asked": self.asked}


@dataclass(frozen=True)
class Exclude:
    """Sources (by name), shards and items (by number, as item ids name them) are not yielded
    again; ``epoch``: the first epoch whose plan it shapes from the start."""

    sources: tuple[str, ...]
    shards: tuple[int, ...]
    items: tuple[int, ...]
    epoch: int
    kind: str = "exclude"

    def same(self, other: Exclude) -> bool:
        return (self.sources, self.shards, self.items) == (other.sources, other.shards, other.items)

    def to_json(self) -> dict:
        out = {"kind": self.kind, "sources": list(self.sources), "shards": list(self.shards)}
        return {**out, "items": list(self.items), "epoch": self.epoch}


@dataclass(frozen=True)
class Weights:
    """A mixture's weights from here on (normalised, in the mixture's source order); ``epoch``:
    the first epoch whose quotas follow them from its start."""

    weights: tuple[float, ...]
    epoch: int
    #: where in the run's units (tokens or items, over every rank) it took effect: what a report
    #: of the realized mix judges the steps after it by
    point: int = 0
    kind: str = "weights"

    def to_json(self) -> dict:
        return {"kind": self.kind, "weights": list(self.weights), "epoch": self.epoch, "point": self.point}


@dataclass(frozen=True)
class Rescheduled:
    """The schedule from here on (``schedule.Schedule.to_json``): it agrees with the one it
    replaced on every step already planned."""

    schedule: dict
    kind: str = "schedule"

    def to_json(self) -> dict:
        return {"kind": self.kind, "schedule": self.schedule}


@dataclass(frozen=True)
class Change:
    """One entry of the log: ``change`` took effect at planned step ``at``."""

    at: int
    change: Skip | Exclude | Weights | Rescheduled

    def to_json(self) -> dict:
        return {"at": self.at, **self.change.to_json()}


def _ints(value: Any, where: str, limit: int = 1 << 20) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > limit:
        raise SteeringError(f"{where} must be a list of at most {limit:,} numbers")
    return tuple(_int(v, f"{where}[]") for v in value)


def check_weights(weights: Sequence[float], where: str) -> tuple[float, ...]:
    """Weights that are finite, not negative and not all zero, normalised to sum to one."""
    out = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or math.isnan(w) or math.isinf(w) or w < 0:
            raise SteeringError(f"{where}[{i}] is {w!r:.20}: a weight is a finite number, zero or more")
        out.append(float(w))
    total = sum(out)
    if not out or total <= 0:
        raise SteeringError(f"{where} are all zero: nothing would be read")
    return tuple(w / total for w in out)


def parse_change(value: Any, where: str) -> Change:
    """A log entry from its JSON, every field checked (a state's log is untrusted)."""
    if not isinstance(value, dict):
        raise SteeringError(f"{where} must be an object")
    kind = value.get("kind")
    if kind not in ("skip", "exclude", "weights", "schedule"):
        raise SteeringError(f"{where} has an unknown kind {kind!r:.20}")
    at = _int(value.get("at"), f"{where}.at")
    if kind == "schedule":
        return Change(at, Rescheduled(Schedule.from_json(value.get("schedule")).to_json()))
    if kind == "exclude":
        names = value.get("sources")
        if not isinstance(names, list) or len(names) > 1 << 16 or not all(isinstance(n, str) for n in names):
            raise SteeringError(f"{where}.sources must be a list of source names")
        shards, items = _ints(value.get("shards"), f"{where}.shards"), _ints(value.get("items"), f"{where}.items")
        return Change(at, Exclude(tuple(names), shards, items, _int(value.get("epoch"), f"{where}.epoch")))
    if kind == "weights":
        weights = value.get("weights")
        if not isinstance(weights, list) or len(weights) > 1 << 16:
            raise SteeringError(f"{where}.weights must be a list")
        epoch, point = _int(value.get("epoch"), f"{where}.epoch"), _int(value.get("point", 0), f"{where}.point")
        return Change(at, Weights(check_weights(weights, f"{where}.weights"), epoch, point))
    start, stop = _int(value.get("start"), f"{where}.start"), _int(value.get("stop"), f"{where}.stop")
    asked = _int(value.get("asked"), f"{where}.asked")
    if stop <= start or asked > start or start != max(asked, at):
        raise SteeringError(f"{where}: the range [{start}, {stop}) (asked from {asked} at {at}) does not hold together")
    return Change(at, Skip(start, stop, asked))


@dataclass
class Log:
    """The changes of a run in the order they took effect (``docs/steering.md``)."""

    changes: list[Change] = field(default_factory=list)

    @property
    def skips(self) -> list[Skip]:
        return [c.change for c in self.changes if isinstance(c.change, Skip)]

    @property
    def schedule(self) -> dict | None:
        """The schedule set last while the run trained (None: the one declared)."""
        changes = [c.change for c in self.changes if isinstance(c.change, Rescheduled)]
        return changes[-1].schedule if changes else None

    @property
    def exclusions(self) -> list[Exclude]:
        return [c.change for c in self.changes if isinstance(c.change, Exclude)]

    @property
    def weight_changes(self) -> list[Weights]:
        return [c.change for c in self.changes if isinstance(c.change, Weights)]

    def room(self) -> None:
        """Refuse a change the log has no room for."""
        if len(self.changes) >= MAX_CHANGES:
            raise SteeringError(f"the run's log holds {MAX_CHANGES:,} changes; no more are kept")

    def add(self, at: int, change: Exclude | Weights | Rescheduled) -> None:
        self.room()
        self.changes.append(Change(at, change))

    def add_skip(self, start: int, stop: int, planned: int) -> tuple[Skip, bool]:
        """Record a skip of planned steps [start, stop) made when ``planned`` steps were planned:
        the skip recorded, and whether it was recorded already (a replay: nothing more is removed)."""
        start, stop = _int(start, "skip's start"), _int(stop, "skip's stop")
        if stop <= start:
            raise SteeringError(f"skip({start}, {stop}): the range is empty or reversed")
        for old in self.skips:
            if (old.asked, old.stop) == (start, stop):
                return old, True
            if start < old.stop and old.asked < stop:
                raise SteeringError(
                    f"skip({start}, {stop}) overlaps the recorded skip({old.start}, {old.stop}) without being it; "
                    "give the recorded range again (a replay), or a range beside it"
                )
        if stop <= planned:
            raise SteeringError(
                f"skip({start}, {stop}) lies wholly in what was already planned and consumed (the next planned "
                f"step is {planned}): steps before it cannot be taken back"
            )
        self.room()
        skip = Skip(max(start, planned), stop, start)
        self.changes.append(Change(planned, skip))
        return skip, False

    def skip_end(self, step: int) -> int | None:
        """Where a skip that holds planned step ``step`` ends (None: ``step`` is not skipped)."""
        for skip in self.skips:
            if skip.start <= step < skip.stop:
                return skip.stop
        return None

    def skipped_before(self, step: int) -> int:
        """Planned steps before ``step`` that skips removed."""
        return sum(max(0, min(step, s.stop) - s.start) for s in self.skips)

    def to_json(self) -> list:
        return [c.to_json() for c in self.changes]

    @classmethod
    def parse(cls, value: Any, where: str = "steering.log") -> Log:
        if not isinstance(value, list):
            raise SteeringError(f"{where} must be a list")
        if len(value) > MAX_CHANGES:
            raise SteeringError(f"{where} holds {len(value):,} changes; at most {MAX_CHANGES:,} are read")
        log = cls([parse_change(v, f"{where}[{i}]") for i, v in enumerate(value)])
        skips = sorted(log.skips, key=lambda s: s.start)
        for a, b in itertools.pairwise(skips):
            if b.start < a.stop:
                raise SteeringError(f"{where}: the recorded skips [{a.start}, {a.stop}), [{b.start}, {b.stop}) overlap")
        return log

    def digest(self) -> str:
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


__all__ = ["Change", "Exclude", "Log", "Rescheduled", "Skip", "Weights", "check_weights", "parse_change"]
