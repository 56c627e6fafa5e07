"""examples/train_parallel.py under torchrun --nproc-per-node 4 (gloo, CPU): dp2 x tp2 and
dp2 x cp2 train on the same batches, so each data-parallel rank's losses agree between the two
layouts (the CP slices, labels shifted before the cut, make up the whole rows), and the peers on
the tensor or context dim report the same losses."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pack_helpers import shakespeare_packed

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_parallel.py"


def _run(data: Path, out: Path, layout: str) -> dict[tuple, list[float]]:
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(port), str(EXAMPLE), "--data", str(data), "--layout", layout]
    cmd += ["--steps", "4", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["steps"] == 4 for r in reports)
    return {tuple(sorted(r["coords"].items())): r["losses"] for r in reports}


@pytest.mark.timeout(600)
def test_tp_and_cp_layouts_train_each_dp_rank_on_the_same_batches(tmp_path):
    data = shakespeare_packed()
    tp = _run(data, tmp_path / "tp", "dp2tp2")
    cp = _run(data, tmp_path / "cp", "dp2cp2")
    for dp in range(2):
        assert tp[(("dp", dp), ("tp", 0))] == tp[(("dp", dp), ("tp", 1))]
        assert cp[(("cp", 0), ("dp", dp))] == cp[(("cp", 1), ("dp", dp))]
        assert cp[(("cp", 0), ("dp", dp))] == pytest.approx(tp[(("dp", dp), ("tp", 0))], abs=1e-4)
    assert tp[(("dp", 0), ("tp", 0))] != tp[(("dp", 1), ("tp", 0))], "the data-parallel ranks read different rows"
