"""No hidden processes: with CUDA-like conditions (threads running, ``os.fork`` forbidden), a loader
without DataLoader workers reads remote shards through its fetch process without a fork; and
whatever a loader started (DataLoader workers, the fetch process, block reader threads, parked
next-epoch downloads) is gone after its ``close()``, its ``with`` block, or its collection."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from synth import write_dataset

import wdsllm
from wdsllm import storage
from wdsllm.storage import offload

pytestmark = pytest.mark.skipif(not offload.SUPPORTED, reason="the fetch process needs Linux (memfd, SCM_RIGHTS)")

#: the training process of a GPU job: NCCL- and CUDA-like threads running, and a fork of it forbidden
TRAINING = r"""
import json, os, sys, threading
stop = threading.Event()
for i in range(3):
    threading.Thread(target=stop.wait, name=f"cuda-like-{i}", daemon=True).start()

def forbidden(*args, **kwargs):
    raise AssertionError("os.fork() of a process with threads running")

os.fork = os.forkpty = forbidden
import wdsllm
from wdsllm.storage import offload

url, local = sys.argv[1], sys.argv[2]
def batches(loader):
    return [b["input_ids"].numpy().tobytes() for b in loader]

expected = batches(wdsllm.loader(local, batch_size=4, seed=1))
report = {}
for options in ({}, {"fetch_process": True}):
    with wdsllm.loader(url, batch_size=4, seed=1, **options) as loader:
        report[str(options)] = [batches(loader) == expected, offload.running_pid()]
print(json.dumps(report))
"""


def test_remote_shards_without_workers_are_read_without_a_fork(http_server):
    write_dataset(http_server.root / "ds", [30, 12, 25], seed=4, mode="packed", seq_len=16)
    env = {k: v for k, v in os.environ.items() if k != "WDSLLM_FETCH_PROCESS"}
    out = subprocess.run(
        [sys.executable, "-c", TRAINING, http_server.url_for("ds"), str(http_server.root / "ds")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for options, (same, fetch_process) in report.items():
        assert same, f"{options}: the remote batches are the local ones"
        if options != "{}":
            assert fetch_process is not None, f"{options}: a fetch process read them, started without a fork"


def children() -> set[int]:
    """This process's child processes (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.add(int(entry.name))
    return found


def ours() -> list[str]:
    """The threads of this process that wdsllm started."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("wdsllm-", "readahead")))


def settled(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def read_two_epochs(loader) -> None:
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sum(1 for _ in loader) > 0


def read_and_end(url: str, workers: int, how: str, before: set[int]) -> None:
    """Read two epochs, then close the loader, leave its ``with`` block, or drop it."""
    loader = wdsllm.loader(url, batch_size=4, seed=1, num_workers=workers, fetch_process=True)
    if how == "with":
        with loader:
            read_two_epochs(loader)
            assert children() - before, "workers or a fetch process run while it reads"
        return
    read_two_epochs(loader)
    assert children() - before, "workers or a fetch process run while it reads"
    if how == "close":
        loader.close()


@pytest.mark.parametrize(("workers", "how"), [(0, "close"), (0, "collected"), (2, "with")])
def test_nothing_we_started_outlives_the_loader(http_server, monkeypatch, workers, how):
    monkeypatch.delenv("WDSLLM_FETCH_PROCESS", raising=False)
    write_dataset(http_server.root / "ds", [30, 12, 25], seed=4, mode="packed", seq_len=16)
    storage.reset()
    gc.collect()  # an earlier test's loader left to the collector stops its threads there
    assert settled(lambda: not ours())
    before = children()
    read_and_end(http_server.url_for("ds"), workers, how, before)
    gc.collect()
    assert settled(lambda: children() <= before), f"child processes left: {children() - before}"
    assert settled(lambda: not ours()), f"threads left: {ours()}"
    assert storage.parking.parked_count() == 0
