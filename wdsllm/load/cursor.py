"""Where a loader's stream stands: a cursor whose get/set is the position half of its state dict.

A position is a few integers (``resume.py`` says why that is enough): the epoch, each worker's
batches handed out (with the batcher's note of where its next one starts), the round-robin turn
over the workers, and the rank's batch count. The cursor holds exactly that, plus which pass of
the loader is current (so that an abandoned iterator never moves a later pass) and a restored
position not yet begun. The identity half of the state (dataset, settings, layout) is the
loader's; ``get`` and ``set`` read and write the rest. A loaded state is checked against the
loader (``check_fits``) before ``restore`` moves anything: its own position, another rank's
turned into this rank's, or another layout's re-planned as the rest of its epoch.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..errors import StateError
from . import resume as resumemod
from . import state as statemod
from .config import Config
from .counts import EpochCounts, EpochPlan, batch_counts, equalised, round_robin_share
from .dataset import EndOfWorker
from .holes import lost_batches

log = logging.getLogger(__name__)

#: where a worker stands: (epoch, batches of it handed out, the batcher's hint for the next one)
WorkerPosition = tuple


class RoundRobin:
    """DataLoader's order: turns over the workers that still have batches, starting at ``turn``."""

    def __init__(self, workers: int, turn: int = 0, active: list[int] | None = None):
        self.queues: list[deque] = [deque() for _ in range(workers)]
        self.active = list(range(workers)) if active is None else sorted(active)
        self.turn = turn

    def _advance(self) -> None:
        """The next active worker after ``turn``, wrapping around (``active`` is in worker order)."""
        active = self.active
        if active:
            i = bisect.bisect_right(active, self.turn)
            self.turn = active[i] if i < len(active) else active[0]

    def run(self, raw: Iterator, on_end: Callable[[EndOfWorker], None]) -> Iterator:
        """The batches of ``raw`` (items that name their ``worker``) in turn order; a worker's end
        marker goes to ``on_end`` and takes it out of the turns."""
        while self.active:
            if self.turn not in self.active:
                self._advance()
            while not self.queues[self.turn]:
                item = next(raw, None)
                if item is None:
                    break
                self.queues[item.worker].append(item)
            if not self.queues[self.turn]:  # DataLoader ended without this worker's end marker
                self.active.remove(self.turn)
                continue
            item = self.queues[self.turn].popleft()
            if isinstance(item, EndOfWorker):
                on_end(item)
                self.active.remove(self.turn)
                continue
            self._advance()
            yield item


def turn_after(positions: dict[int, WorkerPosition], workers: int) -> int:
    """The round-robin turn after these per-worker counts: the worker after the last one served
    (the last in worker order among those that served the most rounds). Workers that are done
    stay in the turn order: their end markers are consumed when their turn comes, which yields no
    batch, so the sequence of batches is the same."""
    served = [positions.get(w, (0, 0))[1] for w in range(workers)]
    most = max(served) if served else 0
    if most == 0:
        return 0
    last = max(w for w in range(workers) if served[w] == most)
    return (last + 1) % workers


def positions_of_share(epoch: int, counts: Any, yielded: int) -> dict[int, WorkerPosition]:
    """Each worker's position after ``yielded`` batches of a rank whose workers have ``counts``
    batches this epoch, in DataLoader's round-robin order (another rank's state, equal counts)."""
    share = round_robin_share(counts, yielded)
    return {w: (epoch, int(share[w]), None) for w in range(len(share))}


class Progress(NamedTuple):
    """A reader's cursor after a batch (or at its pass's end): what a peer that receives its
    batches (a broadcast's receivers, a pipeline's middle stages) mirrors, so that its
    ``len()``, ``epoch``, ``set_epoch`` and ``state_dict()`` answer as the reader's do without
    asking it. ``turn`` is None between passes."""

    epoch: int
    yielded: int
    completed: int | None
    steps: int
    tails: int
    positions: dict[int, WorkerPosition]
    turn: int | None
    active: list[int] | None
    #: the reader's steering position (``steer.Steerer.where``), which its peers mirror too
    steer: tuple | None = None


@dataclass
class Restored:
    """A loaded position that no pass has begun from yet (or a skipped range's end: ``_Sought``)."""

    state: statemod.LoaderState | _Sought
    turn: int
    active: list[int]


@dataclass(frozen=True)
class _Sought:
    """Where a skipped range sends a pass: the counts ``Cursor.begin`` takes from a loaded state."""

    yielded: int
    steps: int
    tails: int


@dataclass
class Cursor:
    """The epoch, the pass, and each worker's position in it (see the module's docstring)."""

    workers: int
    epoch: int = 0
    auto_epoch: bool = True  # until set_epoch is called, each completed pass advances the epoch
    completed: int | None = None  # the last epoch iterated to its end
    pass_no: int = 0  # the current pass; a pass abandoned by its caller must not touch a later one
    positions: dict[int, WorkerPosition] = field(default_factory=dict)
    yielded: int = 0  # batches handed out this epoch (finite) or since the stream began
    steps: int = 0  # batches handed out in the current steps_per_epoch loop
    tails: int = 0  # of ``yielded``: batches of the workers' merged tails (``tails.py``)
    order: RoundRobin | None = None  # the turns of the pass in progress
    restored: Restored | None = None

    def new_pass(self) -> int:
        """Begin a pass (or forget the current one): an iterator of an earlier pass stops acting."""
        self.pass_no += 1
        return self.pass_no

    def begin(self, resume_positions: dict[int, WorkerPosition]) -> RoundRobin:
        """The turns of a pass that starts now: from a restored position if one is waiting."""
        restored, self.restored = self.restored, None
        if restored is not None:
            self.order = RoundRobin(self.workers, restored.turn, restored.active)
            self.positions = dict(resume_positions)
            self.yielded, self.steps = restored.state.yielded, restored.state.steps
            self.tails = restored.state.tails
        else:
            self.order = RoundRobin(self.workers)
            self.positions, self.yielded, self.tails = {}, 0, 0
        return self.order

    def seek(self, positions: dict[int, WorkerPosition], yielded: int, turn: int) -> None:
        """The pass goes on from ``positions`` (``yielded`` of the rank's batches of the epoch
        behind it, a skipped range among them): its next ``begin`` starts there."""
        self.restored = Restored(_Sought(yielded, self.steps, self.tails), turn, list(range(self.workers)))

    def handed_out(self, worker: int, epoch: int, index: int, hint: Any) -> None:
        self.positions[worker] = (epoch, index + 1, hint)
        self.yielded += 1

    def merged_out(self) -> None:
        """A batch of the workers' merged tails was handed out (no worker's position moves)."""
        self.tails += 1
        self.yielded += 1

    def finish(self, epoch: int) -> None:
        """The pass over ``epoch`` ended with its last batch."""
        self.new_pass()
        self.order = None
        self.completed = epoch
        if self.auto_epoch:
            self.epoch = epoch + 1

    def progress(self) -> Progress:
        order = self.order
        turn, active = (order.turn, list(order.active)) if order is not None else (None, None)
        return Progress(
            self.epoch, self.yielded, self.completed, self.steps, self.tails, dict(self.positions), turn, active
        )

    def mirror(self, progress: Progress) -> None:
        """Stand where a reader's cursor stands (``progress``): a receiver's own pass, if any,
        and any restored position are its reader's."""
        self.restored = None
        self.epoch, self.yielded, self.completed = progress.epoch, progress.yielded, progress.completed
        self.steps, self.tails, self.positions = progress.steps, progress.tails, dict(progress.positions)
        if progress.turn is None:
            self.order = None
        else:
            self.order = RoundRobin(self.workers, progress.turn, progress.active)

    def get(self, in_epoch: bool) -> dict[str, Any]:
        """The position fields of the state dict (``state.LoaderState``); between epochs, the
        epoch a resume runs next."""
        epoch = self.epoch
        if not in_epoch and self.completed is not None and self.completed == epoch:
            epoch += 1  # saved after a finished epoch: the next one is what a resume runs
        order = self.order if in_epoch else None
        return {
            "epoch": epoch,
            "yielded": self.yielded if in_epoch else 0,
            "steps": self.steps,
            "tails": self.tails if in_epoch else 0,
            "workers": {w: statemod.Position(*p) for w, p in sorted(self.positions.items())} if in_epoch else {},
            "turn": order.turn if order is not None else 0,
            "active": list(order.active) if order is not None else None,
        }

    def set(self, st: statemod.LoaderState, turn: int = 0, active: list[int] | None = None) -> None:
        """Stand where ``st`` stood: its epoch, and (when it was saved inside one) the turn and
        counts its next pass begins with."""
        self.new_pass()
        self.order = None
        self.epoch = st.epoch
        self.steps = st.steps  # a steps_per_epoch loop's steps so far (0 in a finite state)
        self.completed = None
        self.restored = None
        if st.in_epoch and active is not None:
            self.restored = Restored(st, turn, active)


# ----------------------------------------------------------------------------------------------
# Setting a loaded state: checked against this loader, then its positions for this layout


@dataclass(frozen=True)
class Here:
    """What a loaded state is checked and re-planned against: this loader's dataset and settings,
    its rank among ``world`` and its ``workers`` streams, and its epoch source (plans, resumes)."""

    catalog: Any
    cfg: Config
    rank: int
    world: int
    workers: int
    source: Any  # dataset.EpochSource

    def state(self, position: dict[str, Any]) -> statemod.LoaderState:
        """A state of this loader standing at ``position`` (``Cursor.get``)."""
        plan = self.source.plan_for(position["epoch"])
        return statemod.LoaderState(
            dataset=self.catalog.fingerprint(),
            settings=resumemod.settings_fingerprint(self.cfg),
            config=self.cfg.as_json(),
            rank=self.rank,
            world_size=self.world,
            num_workers=self.workers,
            equal_batches=bool(self.cfg.keeps_equal_batches(self.world)),
            infinite=self.cfg.infinite,
            plan=plan if plan is not None and plan.remainder else None,
            **position,
        )

    def rank_specific(self, st: statemod.LoaderState) -> bool:
        """Whether only the saving rank can resume from ``st``: it stands inside an epoch whose
        ranks yield different numbers of batches, or whose counts (which turn one rank's position
        into another's) the index cannot give."""
        return st.in_epoch and not self.cfg.one_state_for_all(self.catalog, st.world_size)

    def worker_counts(self, epoch: int, world: int, workers: int, plan: EpochPlan | None) -> np.ndarray:
        """Every (rank, worker)'s batches in ``epoch`` of a ``world`` x ``workers`` layout."""
        counts = batch_counts(self.catalog, self.cfg, epoch, world, workers, plan)
        if counts is None:
            raise StateError("this needs the dataset's index (lengths.npy) to recompute other ranks' positions")
        return equalised(counts, self.cfg.uneven) if self.cfg.keeps_equal_batches(world) else counts


def check_fits(st: statemod.LoaderState, here: Here, *, exact_order: bool) -> None:
    """Refuse, before anything changes, a state of another dataset or settings, or whose
    positions this loader cannot take."""
    statemod.check_identity(
        st,
        dataset=here.catalog.fingerprint(),
        settings=resumemod.settings_fingerprint(here.cfg),
        infinite=here.cfg.infinite,
    )
    statemod.check_order(statemod.LOADER_KIND, st.version, here.catalog, here.cfg)
    statemod.check_split(
        statemod.LOADER_KIND, st.version, here.catalog, here.cfg, st.world_size, st.num_workers, st.plan is not None
    )
    same_layout = st.world_size == here.world and st.num_workers == here.workers
    if st.workers and st.world_size != here.world and here.catalog.has_step_schedule():
        raise StateError(
            f"the mixture's schedule has at_step points, which are converted with the world size "
            f"({st.world_size} when saved, {here.world} now): an elastic resume would move them; "
            "write the points as at_tokens / at_items to resume with another world size"
        )
    by_epochs = here.cfg.endless_by_epochs(here.world)
    if st.infinite and here.cfg.infinite and st.equal_batches != by_epochs:
        raise StateError(
            "the state is from an endless loader whose "
            + (
                "epochs ran whole with equal batches; this one streams on across epochs: pass equal_batches=True"
                if st.equal_batches
                else "workers streamed on across epochs (equal_batches off, or saved by a wdsllm before state version "
                "6); this one runs whole epochs with equal batches: pass equal_batches=False to resume it"
            )
        )
    statemod.check_positions(st, here.catalog, here.cfg, exact_order=exact_order)
    if st.workers and not same_layout and here.cfg.infinite and not by_epochs:
        raise StateError(
            "resuming an endless stream with another world size or worker count needs equal batches "
            "(equal_batches=True, the default with several ranks): its workers streamed on across epochs"
        )
    if st.workers and same_layout and st.rank != here.rank and not st.equal_batches:
        raise StateError(
            f"this state is rank {st.rank}'s and ranks yielded different numbers of batches; load each rank's own state"
        )
    if st.workers and not same_layout and st.world_size > 1 and not st.equal_batches:
        raise StateError("an elastic resume needs equal batch counts on the old ranks (equal_batches=True)")


def restore(cursor: Cursor, st: statemod.LoaderState, here: Here) -> None:
    """Stand where a fitting state stood: the cursor, and the epoch source's plan and positions
    (this rank's own, another rank's turned into this one's, or the re-planned rest of the epoch
    for another layout)."""
    source = here.source
    source.set_plan(st.plan.epoch if st.plan else None, st.plan)
    same_layout = st.world_size == here.world and st.num_workers == here.workers
    if not st.in_epoch or not same_layout:
        cursor.set(st)
        source.resume_from({})  # between epochs: the next iteration starts epoch `epoch` afresh
        if st.workers:
            _elastic(st, here)
        return
    if st.rank == here.rank:
        positions = {w: p.as_tuple() for w, p in st.workers.items()}
    else:  # another rank's state (equal batch counts): this rank's share of as many batches
        counts = here.worker_counts(st.epoch, here.world, here.workers, source.plan_for(st.epoch))[here.rank]
        positions = positions_of_share(st.epoch, counts, st.yielded)
    served = {w: (p[0], p[1] - lost_batches(p[2])) for w, p in positions.items()}  # batches of holes only: never sent
    streamed = here.cfg.infinite and not here.cfg.endless_by_epochs(here.world)
    turn = st.turn if streamed else turn_after(served, here.workers)
    source.resume_from(positions)
    cursor.set(st, turn, list(range(here.workers)))


def _elastic(st: statemod.LoaderState, here: Here) -> None:
    """Re-plan the rest of the saved epoch for this world size and worker count."""
    epoch, plan = st.epoch, st.plan
    old_world, old_workers = st.world_size, st.num_workers
    counts = here.worker_counts(epoch, old_world, old_workers, plan)
    consumed = [[int(x) for x in round_robin_share(counts[r], st.yielded)] for r in range(old_world)]
    if old_world == 1:
        consumed = [[st.workers[w].batches if w in st.workers else 0 for w in range(old_workers)]]
    here.source.set_plan(epoch, resumemod.RemainderPlan(epoch, old_world, old_workers, consumed, base=plan))
    log.info(
        "resuming epoch %d of a %d x %d layout as %d x %d: the epoch's remainder is re-planned",
        epoch,
        old_world,
        old_workers,
        here.world,
        here.workers,
    )


class EpochTotal:
    """Batches this rank yields in an epoch, from the index (None without one): the equal-batches
    decision's count where there is one, else this rank's own shares alone. Kept for the last
    (epoch, plan, world size) asked: ``len(loader)`` and every end-of-epoch test ask again."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: int | None = None

    def forget(self) -> None:
        self._key = None

    def of(self, here: Here, epoch: int) -> int | None:
        plan = here.source.plan_for(epoch)
        key = (epoch, id(plan), here.world)
        if self._key != key:
            limits = here.source.limits(epoch, here.workers)
            self._key, self._value = key, limits.per_rank if limits is not None else self.own(here, epoch, plan)
        return self._value

    @staticmethod
    def own(here: Here, epoch: int, plan: Any) -> int | None:
        """This rank's own batches of ``epoch`` under ``plan`` (where no equal-batches decision is made)."""
        counts = EpochCounts.create(here.catalog, here.cfg, epoch, here.world, here.workers, plan, ranks=[here.rank])
        return None if counts is None else int(counts.exact()[here.rank].sum())

    def know(self, here: Here, epoch: int, plan: Any, value: int | None) -> None:
        """``own``'s answer for ``plan``, worked out elsewhere (ahead of a change: steer/ahead.py)."""
        self._key, self._value = (epoch, id(plan), here.world), value
