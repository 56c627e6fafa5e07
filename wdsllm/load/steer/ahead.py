"""A change's re-plan made ahead of its step, in a thread, while the stream still yields the old
plan's batches (``steer_horizon``, ``at=``: docs/steering.md).

A change made for planned step E re-plans the rest of the epoch from what every consumer will
have consumed at E, which the round robin says from the batch count at E alone. So the plan, and
the pass over lengths it takes, can be made while the steps before E train. When the stream
reaches E the loader works the inputs out again as it always does (``PlanKey``) and takes the plan
made ahead only where they are the same: a guess is never trusted, at worst the step waits for a
re-plan as it would have without a horizon.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..counts import round_robin_share
from ..cursor import EpochTotal
from .plans import Leaving, SteeredPlan
from .prestart import Prestarted, started

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanKey:
    """What a re-plan is made from: the epoch, every consumer's batches consumed, the plan they
    followed (its identity: the object the loader holds) and what the rest leaves out."""

    epoch: int
    consumed: tuple[tuple[int, ...], ...]
    base: int
    leaving: Leaving

    @classmethod
    def of(cls, epoch: int, consumed: list[list[int]], base: Any, leaving: Leaving) -> PlanKey:
        return cls(epoch, tuple(tuple(int(x) for x in row) for row in consumed), id(base), leaving)


class Ahead:
    """One re-plan in a thread of its own, for the rank's batch count ``upto`` at the change's
    step (``make`` returns its key, plan and stream; ``expected`` is the key as far as it is
    known before: all but the consumed counts); ``take`` hands it over where the key is the one
    asked for."""

    def __init__(self, expected: PlanKey, upto: int, make: Callable[[], tuple[PlanKey, Any, Any]]):
        self.expected, self.upto, self._make = expected, upto, make
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._result: tuple[PlanKey, Any, Any] | None = None
        #: the plan's stream started ahead (``prestart.Prestarted``), made by ``make`` or later
        self.prestarted: Any = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="wdsllm-steer-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            self._result = self._make()
            self.prestarted = self._result[2]
        except BaseException as exc:  # the step that needs the plan makes it again, and sees this
            self._error = exc
        finally:
            log.debug("the re-plan made ahead took %.2f s", time.perf_counter() - began)
            with self._lock:
                self._done.set()
                abandoned = self._abandoned
            if abandoned:
                self._close_stream()

    def plan(self) -> Any | None:
        """The plan made, once the thread is done (None before, or where it failed)."""
        return self._result[1] if self._done.is_set() and self._result is not None else None

    def abandon(self) -> None:
        """Not wanted: a stream it started is closed once its thread is done, which nobody waits
        for here (``thread`` is what to join before the loader is closed)."""
        with self._lock:
            self._abandoned = True
            done = self._done.is_set()
        if done:
            self._close_stream()

    def close(self) -> None:
        """Wait for the thread, and close a stream it started that nobody took."""
        self._done.wait()
        self._close_stream()

    def _close_stream(self) -> None:
        pre, self.prestarted = self.prestarted, None
        if pre is not None:
            pre.close()

    def take(self, key: PlanKey) -> Any | None:
        """The plan made ahead where it was made from ``key`` (waiting for the thread if it still
        runs), else None: the caller makes it now."""
        if replace(key, consumed=()) != self.expected:
            log.debug("the re-plan made ahead was made for another plan or exclusion: made again")
            return None
        self._done.wait()
        if self._error is not None:
            log.debug("the re-plan made ahead failed (%s): made again at its step", self._error)
            return None
        made, plan, _ = self._result
        if made != key:
            log.debug("the re-plan made ahead was made from other inputs than the step's: made again")
            return None
        return plan


@dataclass(frozen=True)
class AheadInputs:
    """What a re-plan made ahead reads, taken in the loader's thread at the call: the loader's
    ``Here`` (catalog, settings, layout), its transport and pipeline (to start the new pass), the
    epoch and the plan it follows, what the rest leaves out, and the rank's batch count at the
    change's step (``upto``)."""

    here: Any
    transport: Any
    pipeline: Any
    epoch: int
    base: Any
    leaving: Leaving
    upto: int
    seed: int


def readied(here: Any, plan: SteeredPlan, deal: bool) -> SteeredPlan:
    """``plan`` with what its pass asks of it first worked out: the remaining sequence (every
    worker forked after inherits it), with ``deal`` this rank's consumers' slices too, and this
    rank's own batch count (what ``len()`` and the epoch's end ask: ``EpochTotal``)."""
    world, workers = here.world, max(1, here.workers)
    plan.sequence(here.catalog, here.cfg)
    if deal:
        for worker in range(workers):
            plan.slices_for(here.catalog, here.cfg, here.rank, world, worker, workers)
    if not here.cfg.keeps_equal_batches(world):
        plan.own_total = EpochTotal.own(here, plan.epoch, plan)
    return plan


def replan_ahead(i: AheadInputs) -> tuple[PlanKey, SteeredPlan | None, Prestarted | None]:
    """The re-plan of the rest of the epoch at the change's step (what every consumer will have
    consumed by then, by the round robin), this rank's consumers' slices dealt, and (without
    real workers) its pass started; no plan where the step lies beyond the epoch."""
    here = i.here
    world, workers = here.world, here.workers
    counts = here.worker_counts(i.epoch, world, workers, i.base)
    consumed = [[int(x) for x in round_robin_share(counts[r], i.upto)] for r in range(world)]
    key = PlanKey.of(i.epoch, consumed, i.base, i.leaving)
    if i.upto >= int(counts[here.rank].sum()):
        return key, None, None
    plan = readied(here, SteeredPlan(i.epoch, world, workers, consumed, i.base, leaving=i.leaving), deal=True)
    pre = None if i.transport.bundled else started(i.transport, i.pipeline, i.epoch, plan, i.seed)
    return key, plan, pre


__all__ = ["Ahead", "AheadInputs", "PlanKey", "readied", "replan_ahead"]
