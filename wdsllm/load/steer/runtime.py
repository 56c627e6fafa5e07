"""A loader's steering at run time: where the run stands in planned steps, how many of the loader's
own batches the next step takes, and where a skipped range sends the stream.

The loader's own batches (a worker's, in DataLoader's round-robin order) are the plan: a schedule
groups consecutive ones into a step, and a skip moves the stream over the batches of its steps
(``Loader._seek``), so the documents, their order and the equal batches are the plan's whatever
the schedule and the log. No torch.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...errors import SteeringError
from .log import Change, Log
from .schedule import Phases, Schedule, resolve, resolve_rows

STEERING_KEY = "steering"


def step_units(schedule: Schedule | None, cfg: Any, rows: bool, seq_len: int | None, world: int) -> int:
    """What one of the loader's batches adds to the schedule's unit over the data-parallel ranks."""
    if schedule is None or schedule.unit == "steps":
        return 1
    if schedule.name == "max_tokens":
        if schedule.unit != "tokens":
            raise SteeringError("a max_tokens schedule counts its points in steps or tokens, not samples")
        return int(cfg.max_tokens) * world
    if schedule.unit == "samples":
        return int(cfg.batch_size) * world
    if not rows or not seq_len:
        raise SteeringError(
            "a schedule in tokens needs batches of a known size in tokens (rows: a packed dataset, or "
            "batching='pack' or 'concat' with seq_len); give its points in steps or samples"
        )
    return int(cfg.batch_size) * int(seq_len) * world


def schedule_base(schedule: Schedule | None, cfg: Any) -> int:
    """The loader's own size of what the schedule steers (whose multiples its values are)."""
    if schedule is None or schedule.name is None:
        return 1
    base = getattr(cfg, schedule.name)
    if base is None:
        raise SteeringError(f"a {schedule.name} schedule needs the loader's own {schedule.name}= (its unit)")
    if schedule.name == "batch_size" and cfg.batching == "bucket" and cfg.max_tokens:
        raise SteeringError("batches of a token budget (max_tokens) are steered by a max_tokens schedule")
    return int(base)


@dataclass
class Counted:
    """What the run left out on purpose: steps (batches handed out by a step), and the loader's
    own batches, documents and tokens inside them."""

    steps: int = 0
    batches: int = 0
    items: int = 0  # documents (or rows of a packed dataset)
    tokens: int = 0

    def add(self, steps: int, batches: int, items: int, tokens: int) -> None:
        self.steps, self.batches = self.steps + steps, self.batches + batches
        self.items, self.tokens = self.items + items, self.tokens + tokens

    def to_json(self) -> dict:
        return {"steps": self.steps, "batches": self.batches, "items": self.items, "tokens": self.tokens}


@dataclass
class Replans:
    """How the re-plans of changes went: made ahead of their step (``steer_horizon``) or while
    the stream waited, and how long the stream waited at the last one."""

    ahead: int = 0
    waited: int = 0
    last_wait_s: float = 0.0

    def add(self, made_ahead: bool, wait_s: float) -> None:
        if made_ahead:
            self.ahead += 1
        else:
            self.waited += 1
        self.last_wait_s = wait_s

    def metrics(self) -> dict[str, float]:
        return {
            "steer_replans_ahead": float(self.ahead),
            "steer_replans_waited": float(self.waited),
            "steer_replan_wait_s": self.last_wait_s,
        }


@dataclass
class Steerer:
    """The schedule resolved into planned steps, the run's log, and the planned step of the next
    batch (``planned``)."""

    phases: Phases = field(default_factory=Phases)
    log: Log = field(default_factory=Log)
    planned: int = 0
    #: the planned step at which the current epoch began (its batches' steps start there)
    epoch_start: int = 0
    skipped: Counted = field(default_factory=Counted)
    #: restored from a state saved before steering existed: the planned step is not known
    unknown: bool = False
    #: a change re-planned the epoch in progress: its pass starts again over the new plan
    restart: bool = False
    #: every N planned steps the steering file is re-read (``SteerOptions``; None: never)
    reload_every: int | None = None
    _reloaded: int = -1  # the planned step it was last re-read at

    #: the row length schedule as planned steps of a join factor (``steering.resolve_rows``)
    rows: Phases = field(default_factory=Phases)
    #: changes made for a later planned step (``at=``, ``steer_horizon``), in the order they take
    #: effect; each is recorded in the log when the stream reaches its step
    pending: list[Change] = field(default_factory=list)
    #: planned steps between a call and the step its change takes effect at (``steer_horizon``)
    horizon: int = 0

    @classmethod
    def of(cls, schedule: Schedule | None, cfg: Any, rows: bool, seq_len: int | None, world: int) -> Steerer:
        base = schedule_base(schedule, cfg)
        per_step = step_units(schedule, cfg, rows, seq_len, world)
        groups = resolve(schedule, base, per_step)
        if schedule is None or schedule.seq_len is None:
            return cls(groups)
        if cfg.batching != "concat" or cfg.shift_labels:
            raise SteeringError(
                "a seq_len schedule joins the rows of a GPT-style stream: batching='concat' (without shift_labels); "
                "rows packed by best fit, or a packed dataset's, are cut at one length"
            )
        return cls(groups, rows=resolve_rows(schedule, int(cfg.seq_len), int(cfg.batch_size), groups, per_step))

    @property
    def plain(self) -> bool:
        """Whether every step is one of the loader's batches of the loader's rows, nothing is
        skipped and no file is re-read (the fast path)."""
        return (
            self.phases.trivial
            and self.rows.trivial
            and not self.log.changes
            and not self.pending
            and self.reload_every is None
        )

    def due(self) -> bool:
        """Whether a pending change takes effect at the next planned step."""
        return bool(self.pending) and self.pending[0].at <= self.planned

    def add_pending(self, change: Change) -> None:
        """Hold ``change`` until the stream reaches its step (after those due at or before it)."""
        self.log.room()
        at = [c.at for c in self.pending]
        self.pending.insert(bisect.bisect_right(at, change.at), change)

    def group_at(self, step: int) -> int:
        return self.phases.group_at(step)

    def steps(self, batches: Iterator[Any], reload: Callable[[], None] | None = None) -> Iterator[list[Any]]:
        """The loader's batches grouped into steps; stops at the end of ``batches``, where the next
        planned step is skipped (``skip_target`` then says where the stream goes) or where a
        change re-planned the epoch (``restart``). ``reload`` re-reads the steering file where due."""
        while True:
            if reload is not None and self.reload_due():
                self._reloaded = self.planned
                reload()
            if self.restart or self.due() or self.log.skip_end(self.planned) is not None:
                return
            group = list(itertools.islice(batches, self.group_at(self.planned)))
            if not group:
                return
            self.planned += 1
            yield group

    def reload_due(self) -> bool:
        every = self.reload_every
        return every is not None and self.planned % every == 0 and self._reloaded != self.planned

    def skip_target(self) -> int | None:
        return self.log.skip_end(self.planned)

    def epoch_steps(self, start: int, batches: int) -> int:
        """Planned steps of an epoch of ``batches`` of the loader's batches that begins at ``start``."""
        return self.phases.steps_for(start, batches)

    def yielded_steps(self, start: int, batches: int) -> int:
        """Steps an epoch yields: its planned steps less the skipped ones."""
        steps = self.epoch_steps(start, batches)
        return steps - (self.log.skipped_before(start + steps) - self.log.skipped_before(start))

    def restore(self, saved: SavedSteering | None, same_layout: bool) -> None:
        """Stand where a loaded state's steering stood (None: a state from before steering). An
        elastic resume re-plans the rest of the epoch, whose steps then begin at ``planned``."""
        if saved is None:
            self.log, self.planned, self.epoch_start, self.skipped, self.unknown = Log(), 0, 0, Counted(), True
            self.pending = []
            return
        self.log, self.planned, self.unknown = Log(list(saved.log.changes)), saved.planned, False
        self.pending = list(saved.pending)
        self.epoch_start = saved.epoch_start if same_layout else saved.planned
        self.skipped = Counted(**saved.skipped)

    def where(self) -> tuple:
        """Where the run stands in planned steps (what a peer that receives its batches mirrors)."""
        return self.planned, self.epoch_start, tuple(self.skipped.to_json().values())

    def mirror(self, where: tuple | None) -> None:
        if where is not None:
            self.planned, self.epoch_start, skipped = where
            self.skipped = Counted(*skipped)

    def metrics(self) -> dict[str, float]:
        """What steering did so far, for ``Loader.metrics()`` (a few numbers, no work)."""
        skipped = self.skipped  # the keys of Counted.to_json, written out: a trainer may ask every step
        out = {
            "steer_planned_step": float(self.planned),
            "steer_skipped_steps": float(skipped.steps),
            "steer_skipped_batches": float(skipped.batches),
            "steer_skipped_items": float(skipped.items),
            "steer_skipped_tokens": float(skipped.tokens),
            "steer_pending_changes": float(len(self.pending)),
        }
        if not self.phases.trivial:
            i = bisect.bisect_right(self.phases._starts, self.planned) - 1
            out["steer_schedule_phase"], out["steer_step_batches"] = float(i), float(self.phases.phases[i].group)
        return out

    def saved(self) -> SavedSteering:
        """What a state keeps of it."""
        log = Log(list(self.log.changes))
        return SavedSteering(self.planned, self.epoch_start, log, self.skipped.to_json(), tuple(self.pending))


@dataclass(frozen=True)
class SavedSteering:
    """A state's steering, every field checked (``state.LoaderState``)."""

    planned: int
    epoch_start: int
    log: Log
    skipped: dict
    #: changes made for a later planned step, not yet taken effect (state version 8; none before)
    pending: tuple[Change, ...] = ()

    @classmethod
    def parse(cls, value: Any) -> SavedSteering:
        if not isinstance(value, dict):
            raise SteeringError("loader state field 'steering' must be an object")
        planned, start = _checked(value.get("planned"), "planned"), _checked(value.get("epoch_start"), "epoch_start")
        if start > planned:
            raise SteeringError("loader state field 'steering': its epoch begins after its planned step")
        skipped = value.get("skipped")
        if not isinstance(skipped, dict) or set(skipped) != {"steps", "batches", "items", "tokens"}:
            raise SteeringError("loader state field 'steering.skipped' must be {steps, batches, items, tokens}")
        counts = {k: _checked(v, f"skipped.{k}") for k, v in skipped.items()}
        pending = tuple(Log.parse(value.get("pending", []), "steering.pending").changes)
        ats = [c.at for c in pending]
        if ats != sorted(ats) or any(at < planned for at in ats) or any(c.change.kind == "skip" for c in pending):
            raise SteeringError("loader state field 'steering.pending' must be changes for later steps, in order")
        return cls(planned, start, Log.parse(value.get("log")), counts, pending)

    def to_json(self) -> dict:
        log = self.log.to_json()
        out = {"planned": self.planned, "epoch_start": self.epoch_start, "log": log, "skipped": self.skipped}
        return {**out, "pending": [c.to_json() for c in self.pending]} if self.pending else out


def _checked(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise SteeringError(f"loader state field 'steering.{key}' must be a count, not {value!r:.40}")
    return value


__all__ = ["STEERING_KEY", "Counted", "Replans", "SavedSteering", "Steerer", "schedule_base", "step_units"]
