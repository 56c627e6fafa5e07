"""Seconds spent per stage of the data path in this process: a leaf that any stage can feed.

The stages, in the order data flows: ``fetch`` (a worker waiting for its reader while bytes were
being received: the wait for a store; the stores' own busy time is ``storage.counters``'
``fetch_ns``), ``read`` (the rest of that wait: checksums, decoding, tokenizing, less what
``check``, ``decode`` and ``tokenize`` time on their own), ``batch`` (the rest of a worker's
stream: shuffling, batching and packing), ``collate`` (tensors, in the loader's process) and
``transport`` (into and out of the shared ring). The stages of one process add up to the time
its stream took; workers run beside one another and beside the trainer, so the data wait says
what the trainer felt and the stages say where the workers spent theirs.

Updates are plain float additions under the GIL: a rare lost update costs a few microseconds of
a count, never a lock on the batch path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

STAGES = ("fetch", "read", "check", "decode", "tokenize", "batch", "collate", "transport")


class StageClock:
    """Seconds per stage since this process started (``add`` adds to them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


#: this process's clock (a DataLoader worker's starts with its parent's figures: reports send
#: differences from a snapshot taken when the worker starts)
CLOCK = StageClock()
#: CLOCK's figures: the dict that hot loops add to directly (one dict update a batch or block,
#: no call), never replaced
SECONDS = CLOCK.seconds


def add(stage: str, seconds: float) -> None:
    SECONDS[stage] += seconds


@contextmanager
def timed(stage: str) -> Iterator[None]:
    """Time a block as ``stage`` (for stages without a loop of their own to time)."""
    began = time.perf_counter()
    try:
        yield
    finally:
        add(stage, time.perf_counter() - began)


def moved(before: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """The stages whose seconds changed between two snapshots, by how much."""
    return {stage: now[stage] - before[stage] for stage in STAGES if now[stage] != before[stage]}
