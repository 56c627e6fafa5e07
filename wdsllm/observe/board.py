"""A loader's workers, seen from its process: a few numbers per worker in shared memory.

Each DataLoader worker writes its own row when it sends a message (its pid, when it last made
progress, how many messages it has sent); the loader's process reads the rows at any time: the
watchdog (which worker stopped moving, and its pid to ask for its stack) and the queue depth
(messages sent but not yet taken). Made before the workers fork, like the token ring; under spawn
or forkserver there is no board (``usable`` is False) and these figures are absent.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

PID, BEAT, SENT = 0, 1, 2  # columns
COLUMNS = 3


class WorkerBoard:
    """Rows of (pid, last progress on the monotonic clock, messages sent), one per worker."""

    def __init__(self, workers: int, stacks_dir: str | None = None):
        self.workers = workers
        #: where each worker's faulthandler writes its stack for the watchdog (None: no watchdog)
        self.stacks_dir = stacks_dir
        self.mm = mmap.mmap(-1, max(1, workers) * COLUMNS * 8)  # MAP_SHARED | MAP_ANONYMOUS
        self.rows = np.frombuffer(self.mm, np.float64).reshape(max(1, workers), COLUMNS)

    def __getstate__(self) -> dict:
        return {"workers": self.workers}  # an anonymous mapping does not survive pickling

    def __setstate__(self, state: dict) -> None:
        self.workers, self.mm, self.rows, self.stacks_dir = state["workers"], None, None, None

    @property
    def usable(self) -> bool:
        return self.rows is not None

    def started(self, worker: int) -> None:
        """A worker's first act: its pid, and a first beat (it is alive and planning)."""
        self.rows[worker] = (os.getpid(), time.monotonic(), 0)

    def sent(self, worker: int, messages: int) -> None:
        row = self.rows[worker]
        row[BEAT] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        row[SENT] = messages

    def pids(self) -> list[int]:
        return [int(p) for p in self.rows[: self.workers, PID]]

    def idle_for(self, worker: int) -> float:
        """Seconds since the worker last made progress (0 before it started)."""
        beat = float(self.rows[worker, BEAT])
        return 0.0 if beat == 0 else time.monotonic() - beat

    def messages(self, worker: int) -> int:
        return int(self.rows[worker, SENT])
