"""The exposed data wait: time the trainer's own thread spends inside the loader's ``next()``.

Measured where the trainer feels it, around each ``next()`` on the loader, not in the workers: a
worker that is slow but ahead costs nothing, and a wait the workers cannot see (collation, a
round-robin turn held by one slow worker, DataLoader's queues) is counted. The step time is the
time from one ``next()`` returning to the next one returning, so ``share`` is the fraction of the
trainer's wall time spent waiting for data. No torch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WaitSummary:
    """The data wait over the last ``steps`` steps (seconds): total, p50, p95, max, and its share of
    the steps' wall time; ``last``: the latest step's wait."""

    steps: int
    last: float
    total: float
    share: float
    p50: float
    p95: float
    max: float

    def flat(self, prefix: str = "data_wait") -> dict[str, float]:
        return {
            f"{prefix}_s": self.last,
            f"{prefix}_window_s": self.total,
            f"{prefix}_share": self.share,
            f"{prefix}_p50_s": self.p50,
            f"{prefix}_p95_s": self.p95,
            f"{prefix}_max_s": self.max,
            f"{prefix}_window_steps": float(self.steps),
        }


class WaitClock:
    """Per-step waits and step times over a window of the last ``window`` steps.

    ``entered()`` when ``next()`` starts, ``left()`` when it returns a batch: two clock reads
    and two appends per step. ``waiting_for()`` is how long a ``next()`` now in progress has
    waited (the watchdog's question), readable from another thread.
    """

    def __init__(self, window: int = 100):
        self.waits: deque[float] = deque(maxlen=window)
        self.steps: deque[float] = deque(maxlen=window)
        self.total_steps = 0
        self.total_wait = 0.0
        self._entered: float | None = None
        self._left: float | None = None  # when the previous next() returned

    def entered(self) -> float:
        now = time.perf_counter()
        self._entered = now
        return now

    def left(self) -> float:
        """The wait of the ``next()`` that returned now (0.0 when none was entered)."""
        now = time.perf_counter()
        entered, self._entered = self._entered, None
        if entered is None:
            return 0.0
        wait = now - entered
        self.waits.append(wait)
        # the first step of a pass has no previous return: its step is its wait
        self.steps.append(now - self._left if self._left is not None else wait)
        self._left = now
        self.total_steps += 1
        self.total_wait += wait
        return wait

    def abandoned(self) -> None:
        """The pass ended (or failed) inside ``next()``: no step to count; the next pass's
        first step does not include the time between passes."""
        self._entered = None
        self._left = None

    @property
    def entered_at(self) -> float | None:
        """When the ``next()`` in progress began (None: none is), which names that wait."""
        return self._entered

    def waiting_for(self) -> float:
        """Seconds the ``next()`` in progress has waited; 0 when none is in progress."""
        entered = self._entered
        return 0.0 if entered is None else time.perf_counter() - entered

    def summary(self) -> WaitSummary:
        if not self.waits:
            return WaitSummary(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        waits = np.fromiter(self.waits, np.float64, len(self.waits))
        step_time = float(sum(self.steps))
        total = float(waits.sum())
        p50, p95 = np.percentile(waits, [50, 95])
        share = total / step_time if step_time > 0 else 0.0
        return WaitSummary(
            len(waits), float(waits[-1]), total, min(1.0, share), float(p50), float(p95), float(waits.max())
        )
