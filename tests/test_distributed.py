"""Real multi-process runs: torchrun with the gloo backend and DataLoader workers per rank."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from pack_helpers import cached
from synth import write_dataset

SCRIPTS = Path(__file__).parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, *args: str, timeout: float = 240) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(SCRIPTS / script),
        *args,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish in {timeout} s (a rank hung?)\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.mark.timeout(300)
def test_torchrun_three_ranks_two_workers_each(tmp_path):
    """3 ranks x 2 workers: the union of every rank's documents is the dataset, each document
    appears once (up to the remainder dropped for equal batches), and every rank yields the
    same number of batches, so the per-step all_reduce never hangs."""
    data = tmp_path / "ds"
    info = write_dataset(data, [23, 7, 31, 2, 18, 11, 9], max_len=30)
    out = tmp_path / "out"
    out.mkdir()
    torchrun("ddp_epoch.py", 3, "--data", str(data), "--out", str(out), "--workers", "2", "--batch-size", "4")
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    for epoch in range(2):
        counts = [rep["epochs"][epoch]["batches"] for rep in reports]
        assert len(set(counts)) == 1, f"ranks yielded different batch counts: {counts}"
        seen = Counter(i for rep in reports for i in rep["epochs"][epoch]["ids"])
        assert max(seen.values()) == 1, "a document was yielded twice"
        missing = set(info["expect"]) - set(seen)
        dropped = sum(rep["epochs"][epoch]["dropped_batches"] for rep in reports)
        assert len(missing) <= dropped * 4, "documents are missing beyond the dropped remainder"
    # Epochs reshuffle: rank 0's order differs between epochs.
    assert reports[0]["epochs"][0]["ids"] != reports[0]["epochs"][1]["ids"]


@pytest.mark.timeout(300)
def test_torchrun_exactly_once_without_equal_batches(tmp_path):
    data = tmp_path / "ds"
    info = write_dataset(data, [5, 40, 3], max_len=20)
    out = tmp_path / "out"
    out.mkdir()
    torchrun(
        "ddp_epoch.py",
        2,
        "--data",
        str(data),
        "--out",
        str(out),
        "--workers",
        "2",
        "--equal-batches",
        "0",
        "--epochs",
        "1",
    )
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    seen = Counter(i for rep in reports for i in rep["epochs"][0]["ids"])
    assert set(seen) == set(info["expect"]) and max(seen.values()) == 1


def _steps(out, world: int) -> list[list[dict]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def torchrun_may_fail(script: str, nproc: int, *args: str, timeout: float = 240) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(SCRIPTS / script),
        *args,
    ]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish in {timeout} s")


BATCHINGS = ("fixed", "bucket")


@pytest.fixture(scope="module")
def killed_and_resumed() -> Path:
    """Three launches of 2 ranks x 2 workers, each running every batching mode in turn: an
    uninterrupted run; a run that saves the loader state at step 5, then dies by SIGKILL; a run
    restarted from those states. Each mode's files are in DIR/{full,crash,resumed}/MODE (once per
    test run, its xdist workers included)."""
    return cached("distributed-killed-and-resumed", _killed_and_resumed)


def _killed_and_resumed(tmp: Path) -> Path:
    data = tmp / "ds"
    write_dataset(data, [23, 7, 31, 2, 18, 11, 9], max_len=30)

    def runs(stage: str, *args: str, resume: str = "") -> list[str]:
        out = []
        for i, batching in enumerate(BATCHINGS):
            (tmp / stage / batching).mkdir(parents=True)
            again = ["--resume", str(tmp / resume / batching)] if resume else []
            out += [*(["--then"] if i else []), "--data", str(data), "--out", str(tmp / stage / batching)]
            out += ["--batching", batching, *args, *again]
        return out

    torchrun("ddp_resume.py", 2, *runs("full"))
    assert torchrun_may_fail("ddp_resume.py", 2, *runs("crash", "--kill-at", "5")) != 0
    torchrun("ddp_resume.py", 2, *runs("resumed", resume="crash"))
    return tmp


@pytest.mark.timeout(400)
@pytest.mark.parametrize("batching", BATCHINGS)
def test_torchrun_killed_and_resumed_equals_uninterrupted(killed_and_resumed, batching):
    """2 ranks x 2 workers save the loader state at step 5, die by SIGKILL, restart from it: the
    document ids of every step equal an uninterrupted run's."""
    full, crash, resumed = (killed_and_resumed / n / batching for n in ("full", "crash", "resumed"))
    for r in range(2):
        before = json.loads((crash / f"rank{r}.json").read_text())
        after = json.loads((resumed / f"rank{r}.json").read_text())
        whole = json.loads((full / f"rank{r}.json").read_text())
        assert len(before) == 5
        assert before + after == whole


@pytest.mark.timeout(400)
def test_torchrun_elastic_three_ranks_to_two(tmp_path):
    """3 ranks x 2 workers checkpoint at step 3 and die; 2 ranks x 3 workers resume: within the
    epoch no document is lost or repeated (up to the equal-batches remainder)."""
    data = tmp_path / "ds"
    info = write_dataset(data, [23, 7, 31, 2, 18, 11, 9], max_len=30)
    crash, resumed = tmp_path / "crash", tmp_path / "resumed"
    crash.mkdir()
    resumed.mkdir()
    assert (
        torchrun_may_fail(
            "ddp_resume.py",
            3,
            "--data",
            str(data),
            "--out",
            str(crash),
            "--kill-at",
            "3",
            "--workers",
            "2",
            "--epochs",
            "1",
        )
        != 0
    )
    torchrun(
        "ddp_resume.py",
        2,
        "--data",
        str(data),
        "--out",
        str(resumed),
        "--resume",
        str(crash),
        "--workers",
        "3",
        "--epochs",
        "1",
    )
    before = [i for r in range(3) for s in json.loads((crash / f"rank{r}.json").read_text()) for i in s["ids"]]
    after = [i for r in range(2) for s in json.loads((resumed / f"rank{r}.json").read_text()) for i in s["ids"]]
    seen = Counter(before + after)
    assert max(seen.values()) == 1, "a document was repeated"
    missing = set(info["expect"]) - set(seen)
    assert len(missing) <= 2 * 3 * 4, f"{len(missing)} documents lost, more than the equal-batches remainder"
