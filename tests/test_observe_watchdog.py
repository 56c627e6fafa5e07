"""The watchdog on real DataLoader workers: one stopped with SIGSTOP is named, with every
answering worker's stack, within watchdog_s plus a few seconds; its own stack when it resumes;
and with watchdog_raise the run stops with WorkerStalledError instead of hanging."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from pack_helpers import cached
from synth import write_dataset

import wdsllm

pytestmark = pytest.mark.timeout(90)


def _data() -> Path:
    return cached("observe-watchdog", lambda d: write_dataset(d, [300, 300], seed=7) and d)


def _loader(**options) -> wdsllm.Loader:
    return wdsllm.loader(_data(), batch_size=1, num_workers=2, prefetch_factor=1, seed=0, **options)


def _worker_pids(loader) -> list[int]:
    board = loader.observer.tally.board
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = board.pids()
        if all(pids):
            return pids
        time.sleep(0.05)
    raise AssertionError("the workers never wrote their pids")


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it finished its share and exited
        os.kill(pid, signal.SIGCONT)


def _records(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_stopped_worker_is_named_and_every_stack_logged(caplog):
    caplog.set_level(logging.WARNING, logger="wdsllm.observe.watchdog")
    with _loader(watchdog_s=2) as loader:
        batches = iter(loader)
        next(batches)
        stopped = _worker_pids(loader)[1]
        os.kill(stopped, signal.SIGSTOP)
        began = time.monotonic()

        def resume_after_warning() -> None:
            while not _records(caplog, "the data path is stuck") and time.monotonic() - began < 30:
                time.sleep(0.05)
            os.kill(stopped, signal.SIGCONT)

        resumer = threading.Thread(target=resume_after_warning)
        resumer.start()
        try:
            count = 1 + sum(1 for _ in batches)
        finally:
            _resume(stopped)
            resumer.join()
        deadline = time.monotonic() + 10
        while not _records(caplog, "answered the watchdog late") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert count == 600  # nothing lost: the stopped worker went on where it stood
    (warning,) = _records(caplog, "the data path is stuck")
    assert f"worker 1 (pid {stopped}, state T)" in warning and "stopped by a signal" in warning
    running = warning.split("worker 0 (pid", 1)[1].split("worker 1 (pid", 1)[0]
    assert "_worker_loop" in running, "the running worker's own stack"
    assert "Thread MainThread" in warning, "the loader's own threads"
    (late,) = _records(caplog, "answered the watchdog late")
    assert "_worker_loop" in late, "the stopped worker's stack, from the frame it stopped in"


def test_watchdog_raise_stops_the_run_with_a_named_error(caplog):
    caplog.set_level(logging.WARNING, logger="wdsllm.observe.watchdog")
    with _loader(watchdog_s=1, watchdog_raise=True) as loader:
        batches = iter(loader)
        next(batches)
        stopped = _worker_pids(loader)[1]
        os.kill(stopped, signal.SIGSTOP)
        try:
            with pytest.raises(wdsllm.WorkerStalledError, match="watchdog_s"):
                for _ in batches:
                    pass
        finally:
            _resume(stopped)
        del batches  # its DataLoader's workers are stopped here, not in a later test
        gc.collect()
    assert _records(caplog, "the data path is stuck"), "the warning with the stacks came first"


def test_close_after_watchdog_raise_leaves_no_stopped_worker():
    """The stalled worker is still stopped (SIGSTOP) when the error is raised and nobody continues
    it: ``close()`` continues it (a stopped process never sees DataLoader's SIGTERM) or kills it,
    and reaps it, although the failed iterator is still referenced."""
    loader = _loader(watchdog_s=0.5, watchdog_raise=True)
    batches = iter(loader)
    next(batches)
    pids = _worker_pids(loader)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(wdsllm.WorkerStalledError):
            for _ in batches:
                pass
        assert Path(f"/proc/{pids[1]}").exists(), "still stopped when the error is raised"
        loader.close()
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists(), f"worker {pid} outlived close()"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # the test failed: leave nothing behind
                os.kill(pid, signal.SIGKILL)


def test_no_watchdog_no_thread_and_no_files():
    def watchdogs() -> set[threading.Thread]:  # another test's loader, not yet collected, may hold one
        return {t for t in threading.enumerate() if t.name == "wdsllm-watchdog"}

    before = watchdogs()
    with wdsllm.loader(_data(), batch_size=64, watchdog_s=None) as loader:
        sum(1 for _ in loader)
        assert loader.observer.watchdog is None
        assert watchdogs() <= before


def test_epoch_after_epoch_keep_one_thread_which_stops_soon_after_the_last():
    loader = wdsllm.loader(_data(), batch_size=64, watchdog_s=60, seed=0)
    threads = set()
    for epoch in range(3):
        loader.set_epoch(epoch)
        sum(1 for _ in loader)
        threads.add(loader.observer.watchdog._thread)
    assert len(threads) == 1 and None not in threads  # no start and join per epoch
    (thread,) = threads
    thread.join(timeout=10)  # not closed: the thread waits about a second for another pass, then stops
    assert not thread.is_alive()
    loader.set_epoch(3)
    sum(1 for _ in loader)  # a later pass starts a new one
    again = loader.observer.watchdog._thread
    assert again is not None and again is not thread and again.is_alive()
    loader.close()
    assert not again.is_alive()


def test_without_workers_the_warning_holds_the_readers_own_stack(http_server, caplog):
    import shutil

    caplog.set_level(logging.WARNING, logger="wdsllm.observe.watchdog")
    shutil.copytree(_data(), http_server.root / "ds")
    http_server.faults.add("*/shard-000001.tar", "stall", bytes=0, seconds=3)  # the store goes silent
    url = http_server.url_for("ds")
    with wdsllm.loader(url, batch_size=64, watchdog_s=1, fetch_process=False, seed=0) as loader:
        assert sum(1 for _ in loader) == 10  # nothing raised: the trainer's thread is the reader
    (warning, *_) = _records(caplog, "the data path is stuck")
    assert "Thread MainThread" in warning and "worker 0 (pid" not in warning
