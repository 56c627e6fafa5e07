"""examples/train_ddp.py under a real torchrun: 2 ranks, gloo, DDP, one DataLoader worker each.

Each run has a timeout, so a hang (a rank waiting in an all-reduce for a rank that ran out of
batches) fails the test; torchrun, its ranks and their workers are then killed, so none is left
behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pack_helpers import shakespeare_packed

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_ddp.py"
TIMEOUT_S = 120  # per run; a run takes about 10 s, and two runs must fit in pytest's 300 s
BATCH = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each rank in a session of its own, so killing
    torchrun's process group does not reach the ranks or their DataLoader workers)."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def kill_tree(proc: subprocess.Popen) -> str:
    """Kill torchrun, its ranks and their workers; return what they printed."""
    victims = descendants(proc.pid)
    for pid in [proc.pid, *victims]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        output, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        output = ""
    return output


def torchrun(data: Path, out: Path, *args: str, nproc: int = 2) -> list[dict]:
    """Run the example under torchrun; return the rank reports in rank order."""
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
        str(SCRIPT),
        "--data",
        str(data),
        "--batch-size",
        str(BATCH),
        "--workers",
        "1",
        "--out",
        str(out),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        output = kill_tree(proc)
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s (a rank hangs?):\n{output[-4000:]}")
    except BaseException:  # pytest-timeout or Ctrl-C: leave no rank or worker behind
        kill_tree(proc)
        raise
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{output[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def packed() -> Path:
    return shakespeare_packed()


@pytest.fixture(scope="module")
def two_steps(packed, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Two steps, with a checkpoint saved at step 2."""
    out = tmp_path_factory.mktemp("two-steps")
    return out, torchrun(packed, out, "--steps", "2", "--log-every", "1", "--save-every", "2")


def test_every_rank_takes_the_steps_on_disjoint_rows(two_steps):
    _, reports = two_steps
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["world_size"] == 2
        assert r["steps"] == 2 and r["batches"] == 2
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert len(r["rows"]) == 2 * BATCH
        assert len(set(r["rows"])) == len(r["rows"])
    assert not set(reports[0]["rows"]) & set(reports[1]["rows"])


def test_resume_equals_uninterrupted(packed, two_steps, tmp_path):
    """Model, optimizer and data position restored from the step-2 checkpoint: steps 3 and 4
    train on the same rows with the same losses as a run that was never stopped."""
    ckpt_dir, first = two_steps
    whole = torchrun(packed, tmp_path / "whole", "--steps", "4")
    resumed = torchrun(packed, tmp_path / "resumed", "--steps", "4", "--resume", str(ckpt_dir / "checkpoint.pt"))
    for rank in range(2):
        assert resumed[rank]["steps"] == 4 and resumed[rank]["batches"] == 2
        assert first[rank]["rows"] + resumed[rank]["rows"] == whole[rank]["rows"]
        assert resumed[rank]["losses"] == pytest.approx(whole[rank]["losses"][2:], rel=1e-5)


def test_attention_stays_within_documents(packed):
    """With boundaries the model sees each document of a packed row on its own: changing the
    first document of a row leaves the logits of every later document unchanged."""
    import torch

    import wdsllm

    sys.path.insert(0, str(REPO / "examples"))
    from tiny_gpt import GPTConfig, TinyGPT, lm_loss

    batch = next(iter(wdsllm.loader(packed, batch_size=2, boundaries=True, shuffle=False, shuffle_buffer=0)))
    ids, pos = batch["input_ids"], batch["position_ids"]
    starts = torch.nonzero(pos[0] == 0).flatten().tolist()
    assert len(starts) >= 3, "the first row should hold several documents"
    second = starts[1]
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50257, max_len=ids.shape[1])).eval()
    changed = ids.clone()
    changed[0, :second] = (changed[0, :second] + 1) % 50257
    with torch.no_grad():
        a, b = model(ids, pos), model(changed, pos)
        plain = model(changed)  # without position ids attention crosses documents
    torch.testing.assert_close(a[0, second:], b[0, second:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[0, second:], plain[0, second:])
    assert torch.isfinite(lm_loss(a, batch["labels"]))
