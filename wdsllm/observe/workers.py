"""The loader's side of its workers' reports: stage seconds per worker, queue depths, the wait
each worker's batches cost the trainer, and the slowest of each."""

from __future__ import annotations

from ..storage.counters import add_stores
from . import stages
from .board import WorkerBoard
from .report import WorkerReport


class WorkerTally:
    """Sums of what the workers reported, and the data wait charged to the worker whose batch
    the trainer was waiting for."""

    def __init__(self) -> None:
        self.stages: dict[int, dict[str, float]] = {}
        self.taken: dict[int, int] = {}  # messages of each worker taken here (its report's seq)
        self.waits: dict[int, float] = {}
        self.faults: dict[int, list[int]] = {}  # [major, minor] page faults per worker
        self.board: WorkerBoard | None = None
        self.stacks_dir: str | None = None  # the watchdog's, for the workers started from now on
        #: changes whenever ``stages`` does: the sums made of them are made again only then
        self.version = 0

    def new_board(self, workers: int) -> WorkerBoard:
        """The board of a set of workers about to start (their messages are counted afresh)."""
        self.board = WorkerBoard(workers, self.stacks_dir)
        self.taken = {}
        return self.board

    def add(self, report: WorkerReport) -> None:
        mine = self.stages.setdefault(report.worker, dict.fromkeys(stages.STAGES, 0.0))
        for stage, seconds in report.stages.items():
            mine[stage] += seconds
        self.version += 1
        self.taken[report.worker] = report.seq
        faults = self.faults.setdefault(report.worker, [0, 0])
        faults[0] += report.faults[0]
        faults[1] += report.faults[1]
        add_stores(report.stores)  # this process's store counters hold its workers' too

    def waited(self, worker: int, seconds: float) -> None:
        self.waits[worker] = self.waits.get(worker, 0.0) + seconds

    def queue_depth(self, worker: int) -> int | None:
        """Messages the worker sent that this process has not taken yet (None without a board)."""
        board = self.board
        if board is None or not board.usable or worker >= board.workers:
            return None
        return max(0, board.messages(worker) - self.taken.get(worker, 0))

    def slowest_worker(self) -> int | None:
        """The worker whose batches the trainer waited for longest (None before any wait)."""
        slowest, most = None, 0.0
        for worker, seconds in self.waits.items():  # the lowest worker on a tie
            if seconds > most or (seconds == most and slowest is not None and worker < slowest):
                slowest, most = worker, seconds
        return slowest
