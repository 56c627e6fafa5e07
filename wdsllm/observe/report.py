"""What a DataLoader worker sends with each message beside its batches, and what it took to make.

One small record per message (a bundle of up to 16 batches): the stage seconds and the store
counters that moved since the worker's previous message, and how many messages it has sent. The
loader's process adds them up (``workers.WorkerTally``); a worker's own figures are otherwise
invisible there.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..storage.counters import fetch_ns, store_stats, stores_moved
from . import stages
from .board import WorkerBoard
from .watchdog import arm_worker


@dataclass
class WorkerReport:
    """A worker's figures since its previous message (``seq``: the messages it has sent, this one included)."""

    worker: int
    seq: int
    stages: dict[str, float] = field(default_factory=dict)
    stores: dict[str, dict[str, int]] = field(default_factory=dict)
    #: page faults (major: read from disk, minor: mapped from the page cache) of its mapped shards
    faults: tuple[int, int] = (0, 0)


def page_faults() -> tuple[int, int]:
    """This process's (major, minor) page faults so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_majflt, usage.ru_minflt


class Reporter:
    """A worker's side: snapshots taken when it starts (a forked worker inherits its parent's
    counts), then each message's differences, and its row of the board."""

    def __init__(self, worker: int, board: WorkerBoard | None):
        self.worker = worker
        self.board = board if board is not None and board.usable and worker < board.workers else None
        # kept workers count on across passes (their board is kept too)
        self.seq = self.board.messages(worker) if self.board is not None else 0
        self._stages = stages.CLOCK.snapshot()
        self._stores = store_stats()
        self._faults = page_faults()
        if self.board is not None:
            self.board.started(worker)
            if self.board.stacks_dir is not None:
                arm_worker(self.board.stacks_dir, worker)

    def report(self) -> WorkerReport:
        self.seq += 1
        now_stages, now_stores, now_faults = stages.CLOCK.snapshot(), store_stats(), page_faults()
        report = WorkerReport(
            self.worker,
            self.seq,
            stages.moved(self._stages, now_stages),
            stores_moved(self._stores, now_stores),
            (now_faults[0] - self._faults[0], now_faults[1] - self._faults[1]),
        )
        self._stages, self._stores, self._faults = now_stages, now_stores, now_faults
        if self.board is not None:
            self.board.sent(self.worker, self.seq)
        return report


def timed_stream(items: Iterator, stage: str) -> Iterator:
    """``items``, the time each takes to come counted as ``stage`` in this process."""
    seconds, perf_counter = stages.SECONDS, time.perf_counter
    while True:
        began = perf_counter()
        try:
            item = next(items)
        except StopIteration:
            return
        seconds[stage] += perf_counter() - began
        yield item


def timed_reads(blocks: Iterator) -> Iterator:
    """A worker's blocks from its reader, the wait for each split between ``fetch`` (as long as
    requests and bodies were being received in this process meanwhile: the wait for bytes), the
    stages timed on their own inside the reader (``check``, ``decode``, ``tokenize``), and ``read``
    (the rest); all of it taken from ``batch``, the stream they run inside. An estimate where
    several downloads overlap one wait: fetch gets at most the wait."""
    seconds, perf_counter = stages.SECONDS, time.perf_counter
    while True:
        began, fetched, inner = perf_counter(), fetch_ns(), _inner(seconds)
        try:
            block = next(blocks)
        except StopIteration:
            return
        spent = perf_counter() - began
        for_bytes = min(spent, (fetch_ns() - fetched) / 1e9)
        seconds["fetch"] += for_bytes
        seconds["read"] += max(0.0, spent - for_bytes - (_inner(seconds) - inner))
        seconds["batch"] -= spent
        yield block


def _inner(seconds: dict[str, float]) -> float:
    """Seconds of the stages a reader times on its own (``stages.timed``)."""
    return seconds["check"] + seconds["decode"] + seconds["tokenize"]
