"""The exposed data wait: measured on the trainer's thread around each ``next()``, reported as a
flat dict, and gathered over 2 real gloo ranks only where asked."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pack_helpers import cached
from synth import write_dataset

import wdsllm
from wdsllm.observe import wait as wait_module
from wdsllm.observe.wait import WaitClock

SCRIPTS = Path(__file__).parent / "scripts"


def _data() -> Path:
    return cached("observe-synth", lambda d: write_dataset(d, [13, 7, 11, 9], seed=5) and d)


def test_wait_clock_counts_only_the_time_inside_next():
    clock = WaitClock(window=3)
    for wait in (0.02, 0.0, 0.01, 0.03):
        clock.entered()
        time.sleep(wait)
        clock.left()
        time.sleep(0.01)  # the trainer's step: not a wait
    summary = clock.summary()
    assert summary.steps == 3 and clock.total_steps == 4
    assert summary.max >= 0.03 and summary.p50 <= summary.p95 <= summary.max
    assert summary.total <= summary.max * 3 and 0 < summary.share < 1
    assert clock.waiting_for() == 0.0


def test_metrics_hold_the_wait_of_every_next_and_nothing_else():
    with wdsllm.loader(_data(), batch_size=4, wait_window=1000) as loader:
        inside = 0.0
        it = iter(loader)
        steps = 0
        while True:
            start = time.perf_counter()
            batch = next(it, None)
            inside += time.perf_counter() - start
            if batch is None:
                break
            steps += 1
            time.sleep(0.002)  # the trainer's step
        metrics = loader.metrics()
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in metrics.items())
    assert metrics["steps"] == steps == metrics["data_wait_window_steps"]
    # each timed next() lies within the test's own timing of it
    assert 0 < metrics["data_wait_total_s"] <= inside
    assert metrics["data_wait_window_s"] == pytest.approx(metrics["data_wait_total_s"])
    assert metrics["data_wait_p50_s"] <= metrics["data_wait_p95_s"] <= metrics["data_wait_max_s"]
    assert 0 < metrics["data_wait_share"] < 1
    assert not any(k.startswith("data_wait_rank") for k in metrics), "nothing gathered without reduce_every"


def test_observe_options_are_the_loaders_only():
    with pytest.raises(wdsllm.ConfigError, match="reduce_every"):
        wdsllm.dataset(_data(), batch_size=4, reduce_every=2)
    with pytest.raises(wdsllm.ConfigError, match="watchdog_s must be positive"):
        wdsllm.ObserveOptions(watchdog_s=0)


def test_watchdog_seconds_may_be_a_float():
    assert wdsllm.ObserveOptions(watchdog_s=3.0).watchdog_s == 3.0
    assert wdsllm.ObserveOptions(watchdog_s=0.25).watchdog_s == 0.25
    for bad in (0.0, -1.5, float("nan"), float("inf"), "3", True):
        with pytest.raises(wdsllm.ConfigError, match="watchdog_s must be"):
            wdsllm.ObserveOptions(watchdog_s=bad)
    with wdsllm.loader(_data(), batch_size=4, watchdog_s=2.5) as loader:
        assert sum(1 for _ in loader) == 10
        assert loader.observer.dataloader_timeout() == 0.0  # no watchdog_raise: DataLoader waits on


class _Unwalkable(deque):
    """A window that a report must not walk (only its newest entry may be read)."""

    def __iter__(self):
        raise AssertionError("a report walked the whole window")


def test_a_report_reads_the_windows_order_statistics_without_walking_it(monkeypatch):
    """A trainer may ask for the figures every step: the window's p50, p95, max and sums are kept
    as steps come, so a report reads them off whatever the window (and equals numpy's)."""
    rng = np.random.default_rng(3)
    now = [0.0]
    monkeypatch.setattr(wait_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    clock = WaitClock(window=50)
    waits, steps = rng.exponential(0.01, 1_000), rng.exponential(0.02, 1_000)
    for wait, work in zip(waits, steps):
        clock.entered()
        now[0] += wait
        clock.left()
        now[0] += work
    clock.waits, clock.steps = _Unwalkable(clock.waits, maxlen=50), _Unwalkable(clock.steps, maxlen=50)
    summary = clock.summary()
    window = waits[-50:]
    assert summary.steps == 50 and summary.last == pytest.approx(window[-1])
    assert summary.p50 == pytest.approx(np.percentile(window, 50), rel=1e-9)
    assert summary.p95 == pytest.approx(np.percentile(window, 95), rel=1e-9)
    assert summary.max == pytest.approx(window.max()) and summary.total == pytest.approx(window.sum())
    assert summary.share == pytest.approx(window.sum() / (window.sum() + steps[-50:-1].sum() + steps[-51]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_reduction_over_two_gloo_ranks_names_the_rank_that_waited(http_server, tmp_path):
    shutil.copytree(_data(), http_server.root / "ds")
    http_server.faults.add("*", "delay", seconds=0.3, times=None)  # rank 1's store: every answer late
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    sources = [str(_data()), http_server.url_for("ds")]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPTS / "observe_reduce.py"),
                *("--rank", str(rank), "--port", str(port), "--data", sources[rank], "--out", str(out)),
            ]
        )
        for rank in range(2)
    ]
    for proc in procs:
        assert proc.wait(timeout=100) == 0
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["steps"] == reports[1]["steps"] == 10  # 40 documents, 4 per batch: the last reduction at 10
    own = [r["metrics"]["data_wait_window_s"] for r in reports]
    assert own[1] > own[0]
    for report in reports:  # every rank holds the same reduction
        m = report["metrics"]
        assert m["data_wait_slowest_rank"] == 1.0 and m["data_wait_ranks"] == 2.0
        assert m["data_wait_rank_max_s"] == max(own)
        assert m["data_wait_rank_mean_s"] == pytest.approx(sum(own) / 2)
