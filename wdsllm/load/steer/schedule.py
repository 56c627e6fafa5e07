"""Schedules declared up front: batch sizes, token budgets and row lengths by point of the run.

Every position here is a **planned step**: the number of a batch in the sequence the loader plans
for the run (the epochs' batches end to end, skipped ones included), never the trainer's own step
counter, which a requeue or a skipped range moves. A schedule gives a value from a point of the
run on; a point is a planned step, or the samples (items) or tokens the run has planned by then
across every data-parallel rank, so that a point of the data stays where it is whatever the batch
sizes before it. Pure Python, no torch: ``wdsllm stats`` reads schedules too.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import SteeringError

#: what a schedule's points count: planned steps, or the samples / tokens planned before them
UNITS = ("steps", "samples", "tokens")
#: the values a schedule can steer (each a loader option of the same name)
SCHEDULED = ("batch_size", "max_tokens")
#: the most points a schedule may hold (each is a phase the loader walks)
MAX_POINTS = 1 << 16
#: positions beyond this are refused as damaged (a negated or huge number)
MAX_POSITION = 1 << 62


def _int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import operator

            value = operator.index(value)
        except TypeError:
            raise SteeringError(f"{what} must be an integer, not {value!r:.40}") from None
    if not low <= value < MAX_POSITION:
        raise SteeringError(f"{what} must be {'positive' if low == 1 else f'at least {low}'}, not {value!r}")
    return int(value)


def _points(values: Any, what: str) -> tuple[tuple[int, int], ...]:
    """``[(at, value), ...]`` (or ``{at: value}``) checked: rising points from 0, positive values."""
    if isinstance(values, Mapping):
        values = sorted(values.items())
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise SteeringError(f"{what} must be a list of (at, value) pairs, not {type(values).__name__}")
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(values):
        if i >= MAX_POINTS:
            raise SteeringError(f"{what} has more than {MAX_POINTS:,} points")
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise SteeringError(f"{what}[{i}] must be a pair (at, value), not {pair!r:.40}")
        at, value = _int(pair[0], f"{what}[{i}]'s point"), _int(pair[1], f"{what}[{i}]'s value", low=1)
        if out and at <= out[-1][0]:
            raise SteeringError(
                f"{what} goes backwards: point {at:,} comes after {out[-1][0]:,} (points must rise strictly)"
            )
        out.append((at, value))
    if not out:
        raise SteeringError(f"{what} is empty: give at least its value at 0")
    if out[0][0] != 0:
        raise SteeringError(f"{what} must start at 0 (its first point is {out[0][0]:,})")
    return tuple(out)


def ramp(start: int, stop: int, increment: int, over: int, at: int = 0) -> tuple[tuple[int, int], ...]:
    """A linear ramp as a piecewise constant schedule: ``start`` at point ``at``, then ``increment``
    more every ``over / n`` units (n = the increments from start to stop), ``stop`` from ``at + over``
    on (Megatron's ``--rampup-batch-size`` shape)."""
    start, stop = _int(start, "ramp start", 1), _int(stop, "ramp stop", 1)
    increment, over = _int(increment, "ramp increment", 1), _int(over, "ramp length", 1)
    if stop < start or (stop - start) % increment:
        raise SteeringError(f"a ramp from {start} to {stop} must rise by whole increments of {increment}")
    steps = (stop - start) // increment
    points = {0: start} if at else {}
    for i in range(steps + 1):  # the i-th increment holds from over * i / steps on
        points[at + (over * i // steps if steps else 0)] = start + increment * i
    out: list[tuple[int, int]] = []
    for point in sorted(points.items()):
        if not out or point[1] != out[-1][1]:  # a value held on is no new point
            out.append(point)
    return tuple(out)


@dataclass(frozen=True)
class Schedule:
    """Batch sizes (or token budgets) and row lengths by point of the run, declared up front:
    ``batch_size=[(0, 8), (1000, 16)]`` or ``batch_size=ramp(8, 64, 8, over=100_000)``, and
    ``seq_len=[(0, 1024), (50_000, 4096)]``; ``unit`` says what the points count.

    A ``batch_size`` (``max_tokens``) value is a multiple of the loader's own: a step is that many
    of the loader's batches taken together. A ``seq_len`` value (``batching="concat"``) is a
    multiple of the loader's own seq_len that divides into its batch: a row joins that many of the
    stream's consecutive rows, which is the stream cut at the longer length. So the documents, the
    plan and the equal batches are those without a schedule (docs/steering.md)."""

    batch_size: Any = None
    max_tokens: Any = None
    seq_len: Any = None
    unit: str = "steps"

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise SteeringError(f"a schedule's unit must be one of {', '.join(map(repr, UNITS))}, not {self.unit!r}")
        for name in (*SCHEDULED, "seq_len"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _points(value, f"schedule {name}"))
        grouping = [n for n in SCHEDULED if getattr(self, n) is not None]
        if len(grouping) > 1 or not (grouping or self.seq_len is not None):
            raise SteeringError("a schedule steers one of batch_size= or max_tokens=, and or only seq_len=")

    @property
    def name(self) -> str | None:
        """The option whose value takes batches together (None: a schedule of seq_len alone)."""
        return next((n for n in SCHEDULED if getattr(self, n) is not None), None)

    @property
    def points(self) -> tuple[tuple[int, int], ...]:
        return getattr(self, self.name) if self.name else ((0, 1),)

    @classmethod
    def rampup(cls, start: int, increment: int, samples: int, final: int) -> Schedule:
        """Megatron's ``--rampup-batch-size START INCR SAMPLES`` with ``--global-batch-size FINAL``,
        per rank (divide Megatron's global sizes by the data-parallel size): the batch size grows by
        ``increment`` over each of the equal stretches of ``samples`` planned samples."""
        return cls(batch_size=ramp(start, final, increment, samples), unit="samples")

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            n: [list(p) for p in getattr(self, n)] for n in (*SCHEDULED, "seq_len") if getattr(self, n)
        }
        return {**out, "unit": self.unit}

    @classmethod
    def from_json(cls, value: Any) -> Schedule:
        """A schedule from plain data: ``{"batch_size": [[0, 8], [1000, 16]], "unit": "steps"}``
        (what ``to_json`` writes too: a state's ``config``)."""
        if not isinstance(value, Mapping):
            raise SteeringError(
                f"a schedule is a mapping such as {{'batch_size': [[0, 8], [1000, 16]]}}, not {value!r:.60}"
            )
        unknown = [k for k in value if k not in (*SCHEDULED, "seq_len", "unit")]
        if unknown:
            raise SteeringError(f"a schedule has no key {unknown[0]!r} ({', '.join(SCHEDULED)}, seq_len, unit)")
        return cls(**value)

    def __repr__(self) -> str:  # the settings' fingerprint and the peers' description read it
        return f"Schedule({self.to_json()})"


@dataclass(frozen=True)
class StepPhase:
    """From planned step ``step`` on, each step takes ``group`` of the loader's batches."""

    step: int
    group: int


@dataclass(frozen=True)
class Phases:
    """A schedule resolved into planned steps (by the world size and the tokens of a sample)."""

    phases: tuple[StepPhase, ...] = (StepPhase(0, 1),)
    _starts: tuple[int, ...] = field(default=(0,), repr=False, compare=False)
    #: every step is one of the loader's batches
    trivial: bool = field(default=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(p.step for p in self.phases))
        object.__setattr__(self, "trivial", all(p.group == 1 for p in self.phases))

    def group_at(self, step: int) -> int:
        """The loader's batches that planned step ``step`` takes."""
        return self.phases[bisect.bisect_right(self._starts, step) - 1].group

    def batches_between(self, a: int, b: int) -> int:
        """The loader's batches that planned steps [a, b) take."""
        total = 0
        for i, phase in enumerate(self.phases):
            end = self.phases[i + 1].step if i + 1 < len(self.phases) else None
            lo, hi = max(a, phase.step), b if end is None else min(b, end)
            if hi > lo:
                total += (hi - lo) * phase.group
        return total

    def steps_for(self, start: int, batches: int) -> int:
        """Planned steps from ``start`` that ``batches`` of the loader's batches make (the last one
        short where they do not fill it)."""
        step, left = start, batches
        i = bisect.bisect_right(self._starts, start) - 1
        while left > 0:
            phase = self.phases[i]
            end = self.phases[i + 1].step if i + 1 < len(self.phases) else None
            span = None if end is None else end - step
            need = -(-left // phase.group)
            if span is None or need <= span:
                return step - start + need
            step, left, i = end, left - span * phase.group, i + 1
        return step - start

    def to_json(self) -> list:
        return [[p.step, p.group] for p in self.phases]

    def agrees(self, other: Phases, upto: int) -> bool:
        """Whether ``other`` takes as many batches a step as this on every step before ``upto``."""
        points = sorted({0, *(p.step for p in self.phases), *(p.step for p in other.phases)})
        return all(self.group_at(s) == other.group_at(s) for s in points if s < upto)


def resolve(schedule: Schedule | None, base: int, per_step: int) -> Phases:
    """``schedule``'s points as planned steps: ``base`` is the loader's own batch size (or token
    budget), whose multiples the values must be; ``per_step`` is what one of the loader's batches
    adds to the schedule's unit over every data-parallel rank (1 for steps; samples or tokens of a
    batch times the world size)."""
    if schedule is None or schedule.name is None:
        return Phases()
    out: list[StepPhase] = []
    step = 0
    planned = 0  # the unit planned before ``step``
    for i, (at, value) in enumerate(schedule.points):
        if value % base:
            raise SteeringError(
                f"schedule {schedule.name}[{i}] = {value} is not a multiple of the loader's {schedule.name}={base}: "
                f"a step takes whole batches of {base} (docs/steering.md)"
            )
        group = value // base
        if out:
            if schedule.unit == "steps":
                step = at
            else:  # the first step at which the planned unit reaches the point
                last = out[-1].group * per_step
                step = out[-1].step + max(0, -(-(at - planned) // last))
            planned += (step - out[-1].step) * (out[-1].group * per_step if schedule.unit != "steps" else 1)
            if step == out[-1].step:
                out[-1] = StepPhase(step, group)
                continue
        out.append(StepPhase(step, group))
    return Phases(tuple(out))


def _step_at(groups: Phases, units: int, per_step: int) -> int:
    """The first planned step at which the unit planned before it reaches ``units``."""
    planned = 0
    for i, phase in enumerate(groups.phases):
        end = groups.phases[i + 1].step if i + 1 < len(groups.phases) else None
        per = phase.group * per_step
        if end is None or planned + (end - phase.step) * per >= units:
            return phase.step + max(0, -(-(units - planned) // per))
        planned += (end - phase.step) * per
    return 0


def resolve_rows(schedule: Schedule | None, base: int, batch: int, groups: Phases, per_step: int) -> Phases:
    """A schedule's ``seq_len`` as planned steps of a join factor (rows of the loader's ``base``
    length joined a step), each dividing the loader's ``batch`` of rows; ``groups`` and
    ``per_step`` place points given in samples or tokens."""
    if schedule is None or schedule.seq_len is None:
        return Phases()
    out: list[StepPhase] = []
    for i, (at, value) in enumerate(schedule.seq_len):
        if value % base or batch % (value // base):
            raise SteeringError(
                f"schedule seq_len[{i}] = {value}: a row joins whole rows of the loader's seq_len={base} within one "
                f"of its batches of {batch} rows, so the value must be seq_len times a divisor of {batch}"
            )
        step = at if schedule.unit == "steps" else _step_at(groups, at, per_step)
        if out and step == out[-1].step:
            out[-1] = StepPhase(step, value // base)
        else:
            out.append(StepPhase(step, value // base))
    return Phases(tuple(out))


__all__ = ["Phases", "Schedule", "StepPhase", "ramp", "resolve", "resolve_rows"]
