"""Where a loader's stream stands: a cursor whose get/set is the position half of its state dict.

A position is a few integers (``resume.py`` says why that is enough): the epoch, each worker's
batches handed out (with the batcher's note of where its next one starts), the round-robin turn
over the workers, and the rank's batch count. The cursor holds exactly that, plus which pass of
the loader is current (so that an abandoned iterator never moves a later pass) and a restored
position not yet begun. The identity half of the state (dataset, settings, layout) is the
loader's; ``get`` and ``set`` read and write the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import state as statemod
from .counts import round_robin_share
from .dataset import EndOfWorker

#: where a worker stands: (epoch, batches of it handed out, the batcher's hint for the next one)
WorkerPosition = tuple


class RoundRobin:
    """DataLoader's order: turns over the workers that still have batches, starting at ``turn``."""

    def __init__(self, workers: int, turn: int = 0, active: list[int] | None = None):
        self.queues: list[deque] = [deque() for _ in range(workers)]
        self.active = list(range(workers)) if active is None else list(active)
        self.turn = turn

    def _advance(self) -> None:
        if self.active:
            self.turn = min((w for w in self.active if w > self.turn), default=self.active[0])

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


@dataclass
class Restored:
    """A loaded position that no pass has begun from yet."""

    state: statemod.LoaderState
    turn: int
    active: list[int]


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
        else:
            self.order = RoundRobin(self.workers)
            self.positions, self.yielded = {}, 0
        return self.order

    def handed_out(self, worker: int, epoch: int, index: int, hint: Any) -> None:
        self.positions[worker] = (epoch, index + 1, hint)
        self.yielded += 1

    def finish(self, epoch: int) -> None:
        """The pass over ``epoch`` ended with its last batch."""
        self.new_pass()
        self.order = None
        self.completed = epoch
        if self.auto_epoch:
            self.epoch = epoch + 1

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
        self.completed = None
        self.restored = None
        if st.workers and active is not None:
            self.restored = Restored(st, turn, active)
