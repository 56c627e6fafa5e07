"""What one loader measures of its data path, and the flat dict of numbers it reports.

The loader owns one :class:`Observer`; its :func:`timed` stage wraps the loader's batches on the
trainer's thread (the data wait, charged to the worker whose batch was awaited), and
``Loader.metrics()`` is :meth:`Observer.metrics`: the wait, the stages, the workers and the stores.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import WorkerStalledError
from ..load.mixstats import MixTally
from ..load.options import ObserveOptions
from . import stages
from .drift import MixDrift
from .stores import StoreFigures
from .wait import WaitClock
from .watchdog import RAISE_GRACE_S, Watchdog
from .workers import WorkerTally


class Observer:
    """The data wait of one loader, its periodic reduction over the process group (opt-in), the
    last reduction's figures, and what its workers reported (``tally``)."""

    def __init__(self, options: ObserveOptions, tally: WorkerTally | None = None, mix: MixTally | None = None):
        self.options = options
        self.wait = WaitClock(options.wait_window)
        self.tally = tally if tally is not None else WorkerTally()
        #: a mixture's drift over the window, from the loader's count of what it delivered
        self.drift = MixDrift(mix, options.wait_window) if mix is not None else None
        #: the group ``reduce_every`` gathers over (None: the default group); the data-parallel
        #: group where the world also holds tensor or pipeline parallel ranks
        self.group: Any = None
        self.reduced: dict[str, float] = {}
        self._worker = 0  # whose batch is being handed out
        # this process's stage seconds count from its start: this loader reports what moved since
        # it was made (the stores' counters are the process's, as storage.stats() is)
        self._stages_base = stages.CLOCK.snapshot()
        self.watchdog: Watchdog | None = None  # started with the first iteration
        self.stores = StoreFigures()
        self._tally_version = -1  # the tally's version ``_stage_offsets`` were summed at
        #: per stage, the seconds the workers reported less this process's at the loader's start
        self._stage_offsets: list[float] = []
        self._worker_shape = (0, 0)  # (workers waited for, workers reported) of ``_worker_rows``
        self._worker_rows: list[tuple[int, tuple[str, ...]]] = []  # each worker with its keys

    def watch(self) -> None:
        """Start the watchdog (once, as iteration starts; before the workers fork, so that they
        learn where to write their stacks)."""
        seconds = self.options.watchdog_s
        if seconds is None:
            return
        if self.watchdog is None:
            self.watchdog = Watchdog(seconds, self.wait, self.tally)
            self.tally.stacks_dir = self.watchdog.stacks_dir
        self.watchdog.start()

    def dataloader_timeout(self) -> float:
        """DataLoader's ``timeout`` (0: none): with ``watchdog_raise``, a little after the warning."""
        options = self.options
        if options.watchdog_s is None or not options.watchdog_raise:
            return 0.0
        return options.watchdog_s + RAISE_GRACE_S

    def stalled(self, error: BaseException) -> WorkerStalledError | None:
        """The named error for DataLoader's timeout after the watchdog's warning (else None)."""
        if self.watchdog is None or not self.watchdog.stalled or not self.options.watchdog_raise:
            return None
        return WorkerStalledError(
            f"no batch for {self.options.watchdog_s} s (watchdog_s): the WARNING before this one holds every "
            f"worker's stack ({error})"
        )

    def close(self) -> None:
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.close()

    def handed(self, worker: int, collate_s: float) -> None:
        """The loader collated a batch of ``worker`` in ``collate_s`` seconds."""
        stages.add("collate", collate_s)
        self._worker = worker
        if self.drift is not None:
            self.drift.stepped()

    def stepped(self, wait: float) -> None:
        """After each batch handed out: its ``wait`` charged to its worker; every ``reduce_every``
        steps, the reduction (on every rank at the same step, as the ranks count the same steps)."""
        self.tally.waited(self._worker, wait)
        every = self.options.reduce_every
        if every is None or self.wait.total_steps % every:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        from .reduce import reduce_wait

        self.reduced = reduce_wait(self.wait.summary(), self.group)

    def metrics(self, skipped_shards: Sequence[str] = (), world: int = 1) -> dict[str, float]:
        """Everything measured, flat (docs/observability.md lists the keys); ``world``: the ranks,
        for a mixture's place in its schedule. Cheap enough to ask every step (tools/bench_observe.py)."""
        wait = self.wait
        out = self.stores.figures(skipped_shards).copy()  # a copy costs less than adding each key
        out["steps"], out["data_wait_total_s"] = float(wait.total_steps), wait.total_wait
        wait.summary().into(out)
        if self.reduced:
            out.update(self.reduced)
        self._stages(out)
        self._workers(out)
        if self.drift is not None:
            out.update(self.drift.metrics(world))
        return out

    def _stages(self, out: dict[str, float]) -> None:
        """Seconds per stage over the workers and this process (what this process's clock moved
        since the loader was made, and what its workers reported, summed again only when a
        report came), and the slowest stage (the first of equals)."""
        tally = self.tally
        if tally.version != self._tally_version:
            reported, base = list(tally.stages.values()), self._stages_base
            self._stage_offsets = [sum(mine[stage] for mine in reported) - base[stage] for stage in stages.STAGES]
            self._tally_version = tally.version
        seconds = list(map(operator.add, _STAGE_SECONDS(stages.SECONDS), self._stage_offsets))
        out.update(zip(_STAGE_KEY_LIST, seconds))
        out["slowest_stage"] = float(seconds.index(max(seconds)))

    def _workers(self, out: dict[str, float]) -> None:
        tally = self.tally
        waits, batches, faults = tally.waits, tally.stages, tally.faults
        shape = (len(waits), len(batches))  # the tally's dicts only gain workers: their sizes say which
        if shape != self._worker_shape:
            self._worker_shape = shape
            self._worker_rows = [(w, _worker_keys(w)) for w in sorted(waits.keys() | batches.keys())]
        for worker, keys in self._worker_rows:
            out[keys[0]] = waits.get(worker, 0.0)
            mine = batches.get(worker)
            out[keys[1]] = mine["batch"] if mine is not None else 0.0
            major, minor = faults.get(worker, _NO_FAULTS)
            out[keys[2]], out[keys[3]] = float(major), float(minor)
            depth = tally.queue_depth(worker)
            if depth is not None:
                out[keys[4]] = float(depth)
        slowest = tally.slowest_worker()
        if slowest is not None:
            out["slowest_worker"] = float(slowest)

    def diagnosis(self, skipped_shards: Sequence[str] = (), world: int = 1) -> str:
        """The metrics in one line for a log: the wait's share, the slowest stage and worker."""
        m = self.metrics(skipped_shards, world)
        line = (
            f"data wait {m['data_wait_share']:.1%} of step time over {int(m['data_wait_window_steps'])} steps "
            f"(p95 {m['data_wait_p95_s'] * 1e3:.1f} ms); slowest stage {stages.STAGES[int(m['slowest_stage'])]}"
        )
        if "slowest_worker" in m:
            line += f"; slowest worker {int(m['slowest_worker'])}"
        return line


_NO_FAULTS = (0, 0)
STAGE_KEYS = {stage: f"stage_{stage}_s" for stage in stages.STAGES}
_STAGE_KEY_LIST = tuple(STAGE_KEYS.values())
_STAGE_SECONDS = operator.itemgetter(*stages.STAGES)
#: each worker's keys (wait, batch, major and minor faults, queue), made once per worker
_WORKER_KEYS: dict[int, tuple[str, ...]] = {}


def _worker_keys(worker: int) -> tuple[str, ...]:
    keys = _WORKER_KEYS.get(worker)
    if keys is None:
        names = ("wait_s", "batch_s", "major_faults", "minor_faults", "queue")
        keys = _WORKER_KEYS[worker] = tuple(f"worker_{worker}_{name}" for name in names)
    return keys


def timed(batches: Iterator[dict], observer: Observer) -> Iterator[dict]:
    """The loader's batches, each ``next()`` timed on the calling (trainer's) thread."""
    clock = observer.wait
    entered, left, stepped = clock.entered, clock.left, observer.stepped  # bound once: called every batch
    observer.watch()
    try:
        while True:
            entered()
            try:
                batch = next(batches)
            except StopIteration:
                return
            except RuntimeError as exc:  # DataLoader's timeout, set by watchdog_raise
                stalled = observer.stalled(exc)
                if stalled is None:
                    raise
                raise stalled from exc
            stepped(left())
            yield batch
    finally:
        clock.abandoned()
        if observer.watchdog is not None:
            observer.watchdog.pause()  # its thread waits a moment for the next pass, then stops
        batches.close()
