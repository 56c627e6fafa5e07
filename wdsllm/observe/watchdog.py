"""The watchdog: a loader that waited ``watchdog_s`` seconds for a batch says where every worker is.

A thread of the loader's process looks, about once a second, at how long the trainer's current
``next()`` has waited (``WaitClock.waiting_for``): no batch for that long means the data path made
no progress. It then asks every worker for its Python stack (``SIGUSR1``, which each worker
registered with ``faulthandler`` to write into a file of its own: a stack is printed by the
worker itself, even one stuck in C code holding the GIL's release), waits briefly for them, and
logs one WARNING with each worker's pid, state, last progress, queue and stack, and this
process's threads. A worker that cannot answer (stopped by a signal, ``state T``) is named as
such; its stack is logged when it resumes. With ``watchdog_raise`` the loader also stops waiting
(DataLoader's ``timeout``, a little after the warning) and raises ``WorkerStalledError``.

A worker killed by the OS is already DataLoader's error, naming its pid; that is left as it is.
The workers' ``SIGUSR1`` is the watchdog's (``faulthandler`` replaces a handler installed before).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from .board import WorkerBoard
    from .wait import WaitClock
    from .workers import WorkerTally

log = logging.getLogger(__name__)

#: how long the watchdog waits for the workers' stacks once it asked
STACK_WAIT_S = 2.0
#: DataLoader's timeout under ``watchdog_raise`` is the watchdog's seconds plus this: the warning,
#: with its stacks, comes first
RAISE_GRACE_S = STACK_WAIT_S + 1.0
#: how long a paused watchdog still waits for the stacks that stopped workers owe
OWED_WAIT_S = 30.0
#: how long a paused watchdog's thread waits for the next iteration (the next epoch's), which then
#: needs no thread started and joined
LINGER_S = 1.0

#: the file a worker's faulthandler writes its stack into (kept open for the process's life)
_STACK_FILE: IO[bytes] | None = None


def arm_worker(stacks_dir: str, worker: int) -> None:
    """In a DataLoader worker: print every thread's stack into ``stacks_dir/worker-N`` on SIGUSR1."""
    global _STACK_FILE
    path = Path(stacks_dir) / f"worker-{worker}"
    file = open(path, "ab", buffering=0)  # noqa: SIM115 - faulthandler writes to its descriptor for the process's life
    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)
    if _STACK_FILE is not None:
        _STACK_FILE.close()
    _STACK_FILE = file


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R running, S sleeping, T stopped, Z zombie), or "?"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[-1].split()[0]


def own_threads() -> str:
    """This process's threads' Python stacks (the trainer's thread among them)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """The thread that watches one loader's ``next()`` (see the module's docstring)."""

    def __init__(self, seconds: float, clock: WaitClock, tally: WorkerTally):
        self.seconds = seconds
        self.clock = clock
        self.tally = tally  # its board: the workers' pids and progress
        self.stacks_dir = tempfile.mkdtemp(prefix="wdsllm-stacks-")
        self.stalled = False  # the current wait passed the limit (the loader raises on it)
        self._seen: dict[int, int] = {}  # bytes of each worker's stack file already logged
        self._owed: set[int] = set()  # workers asked for a stack that did not answer yet
        self._growing: dict[int, int] = {}  # a stack file's size at the last look, while it grows
        self._fired_for: float | None = None  # the wait (its start) the warning was given for
        self._stop = threading.Event()
        self._lock = threading.Lock()  # who starts and who ends the thread
        self._thread: threading.Thread | None = None
        self._paused: float | None = None  # when the last iteration ended (None: one is running)

    def start(self) -> None:
        with self._lock:
            self._paused = None
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="wdsllm-watchdog", daemon=True)
                self._thread.start()

    def pause(self) -> None:
        """An iteration ended. The thread waits ``LINGER_S`` for the next one, or, while a stopped
        worker still owes its stack, lets it log that (at most ``OWED_WAIT_S``), then stops. A
        loader left unclosed after its iterations keeps no thread for longer."""
        with self._lock:
            self._paused = time.monotonic()

    def close(self) -> None:
        """Stop the thread and remove the stack files (also what ``Loader.close()`` does)."""
        with self._lock:
            self._owed.clear()  # nothing is waited for any more
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        shutil.rmtree(self.stacks_dir, ignore_errors=True)

    def _run(self) -> None:
        poll = min(1.0, self.seconds / 4, LINGER_S)
        while not self._stop.wait(poll):
            try:
                self._check()
            except Exception:  # the watchdog must never be what stops a run
                log.debug("watchdog check failed", exc_info=True)
            if self._ended():
                return

    def _ended(self) -> bool:
        """Whether a paused thread is done: no iteration came within ``LINGER_S`` and no stack is
        owed, or ``OWED_WAIT_S`` passed (it is then no longer this watchdog's thread)."""
        with self._lock:
            if self._paused is None:
                return False
            idle = time.monotonic() - self._paused
            if (self._owed and idle < OWED_WAIT_S) or idle < LINGER_S:
                return False
            self._thread = None
            return True

    def _check(self) -> None:
        entered = self.clock.entered_at
        if self._owed:
            self._late_stacks()
        if entered is None:
            self.stalled = False
            return
        waited = self.clock.waiting_for()
        if waited < self.seconds or self._fired_for == entered:
            return
        self._fired_for = entered
        self.stalled = True
        self._warn(waited)

    @property
    def board(self) -> WorkerBoard | None:
        return self.tally.board

    def _workers(self) -> list[tuple[int, int]]:
        board = self.board
        if board is None or not board.usable:
            return []
        return [(w, pid) for w, pid in enumerate(board.pids()) if pid > 0]

    def _warn(self, waited: float) -> None:
        workers = self._workers()
        for _, pid in workers:
            with contextlib.suppress(OSError):  # gone: DataLoader reports it
                os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACK_WAIT_S
        answered: dict[int, str] = {}
        while time.monotonic() < deadline and len(answered) < len(workers):
            for w, _ in workers:
                if w not in answered and (text := self._new_stack(w)):
                    answered[w] = text
            time.sleep(0.05)
        lines = [f"no batch for {waited:.0f} s (watchdog_s={self.seconds:g}): the data path is stuck"]
        for w, pid in workers:
            lines.append(self._describe(w, pid, answered.get(w)))
            if w not in answered:
                self._owed.add(w)
        lines.append(f"the loader's process (pid {os.getpid()}):\n{own_threads()}")
        log.warning("\n".join(lines))

    def _describe(self, worker: int, pid: int, stack: str | None) -> str:
        board, state = self.board, process_state(pid)
        head = (
            f"worker {worker} (pid {pid}, state {state}): last progress {board.idle_for(worker):.0f} s ago, "
            f"{board.messages(worker)} messages sent"
        )
        if stack is not None:
            return f"{head}\n{stack}"
        why = "it is stopped by a signal" if state == "T" else "it did not answer"
        return f"{head}\n  no stack: {why}; it is logged when the worker answers"

    def _new_stack(self, worker: int) -> str:
        """What the worker's stack file gained since last read."""
        path = Path(self.stacks_dir) / f"worker-{worker}"
        try:
            data = path.read_bytes()
        except OSError:
            return ""
        seen = self._seen.get(worker, 0)
        if len(data) <= seen or self._growing.get(worker) != len(data):  # new, and no longer growing
            self._growing[worker] = len(data)
            return ""
        self._seen[worker] = len(data)
        return data[seen:].decode("utf-8", "replace")

    def _late_stacks(self) -> None:
        for worker in sorted(self._owed):
            stack = self._new_stack(worker)
            if stack:
                self._owed.discard(worker)
                log.warning("worker %d answered the watchdog late (resumed); its stack then:\n%s", worker, stack)
