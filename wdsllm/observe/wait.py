"""The exposed data wait: time the trainer's own thread spends inside the loader's ``next()``.

Measured where the trainer feels it, around each ``next()`` on the loader, not in the workers: a
worker that is slow but ahead costs nothing, and a wait the workers cannot see (collation, a
round-robin turn held by one slow worker, DataLoader's queues) is counted. The step time is the
time from one ``next()`` returning to the next one returning, so ``share`` is the fraction of the
trainer's wall time spent waiting for data.

A trainer may ask for the figures every step (``MetricsLog(every=1)``), so the window's order
statistics are kept as the steps come (a sorted copy of the window: one insertion and one removal
a step) and a summary reads them off, in constant time whatever the window. No torch.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from typing import NamedTuple


class WaitSummary(NamedTuple):
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
        out: dict[str, float] = {}
        self.into(out, prefix)
        return out

    def into(self, out: dict[str, float], prefix: str = "data_wait") -> None:
        """:meth:`flat`'s keys written into ``out`` (no dict in between: a trainer may ask every step)."""
        keys = _KEYS.get(prefix) or _KEYS.setdefault(prefix, _keys(prefix))
        out.update(zip(keys, (self.last, self.total, self.share, self.p50, self.p95, self.max, float(self.steps))))


def _keys(prefix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{k}" for k in ("_s", "_window_s", "_share", "_p50_s", "_p95_s", "_max_s", "_window_steps"))


#: ``WaitSummary.flat``'s keys per prefix, made once (a trainer may ask every step)
_KEYS: dict[str, tuple[str, ...]] = {}


def percentile(ordered: list[float], q: float) -> float:
    """The ``q``-th percentile of ``ordered`` (ascending, not empty), interpolated linearly between
    the two nearest ranks as ``numpy.percentile`` does by default."""
    key = (len(ordered), q)
    ranks = _RANKS.get(key) or _RANKS.setdefault(key, _ranks(*key))
    low, high, t = ranks
    a, b = ordered[low], ordered[high]
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


def _ranks(n: int, q: float) -> tuple[int, int, float]:
    """The two ranks a percentile of ``n`` values lies between, and how far past the lower one."""
    at = q / 100 * (n - 1)
    low = math.floor(at)
    return low, min(low + 1, n - 1), at - low


#: ``_ranks`` per (values, q): a full window asks the same two every step
_RANKS: dict[tuple[int, float], tuple[int, int, float]] = {}


class WaitClock:
    """Per-step waits and step times over a window of the last ``window`` steps.

    ``entered()`` when ``next()`` starts, ``left()`` when it returns a batch: two clock reads,
    two appends and the sorted window's update per step. ``waiting_for()`` is how long a
    ``next()`` now in progress has waited (the watchdog's question), readable from another thread.
    """

    def __init__(self, window: int = 100):
        self.window = window
        self.waits: deque[float] = deque(maxlen=window)
        self.steps: deque[float] = deque(maxlen=window)
        self._ordered: list[float] = []  # the window's waits, ascending
        self._wait_sum = 0.0  # the window's sums, kept as steps enter and leave it
        self._step_sum = 0.0
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
        # the first step of a pass has no previous return: its step is its wait
        self._add(wait, now - self._left if self._left is not None else wait)
        self._left = now
        self.total_steps += 1
        self.total_wait += wait
        return wait

    def _add(self, wait: float, step: float) -> None:
        """A step into the window (the oldest out of it, once full)."""
        waits, ordered = self.waits, self._ordered
        if len(waits) == self.window:
            oldest = waits[0]
            del ordered[bisect.bisect_left(ordered, oldest)]
            self._wait_sum -= oldest
            self._step_sum -= self.steps[0]
        waits.append(wait)
        self.steps.append(step)
        bisect.insort(ordered, wait)
        self._wait_sum += wait
        self._step_sum += step
        if self.total_steps % self.window == 0:  # the running sums lose no precision over a run
            self._wait_sum, self._step_sum = math.fsum(waits), math.fsum(self.steps)

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
        ordered = self._ordered
        if not ordered:
            return WaitSummary(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        total, step_time = max(0.0, self._wait_sum), self._step_sum
        share = total / step_time if step_time > 0 else 0.0
        p50, p95 = percentile(ordered, 50), percentile(ordered, 95)
        return WaitSummary(len(ordered), self.waits[-1], total, min(1.0, share), p50, p95, ordered[-1])
