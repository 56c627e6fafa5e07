"""``tools/bench_gpu.py --dry-run``: the GPU benchmark's loop, loader and report run on CPU with
tiny models, so the script cannot rot on machines without a GPU (issue #44)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pack_helpers import cached, pack_api, wiki_subset

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import bench_gpu  # noqa: E402 - the tool under test


def test_the_dry_run_trains_both_models_fed_and_synthetic_and_reports_them(tmp_path, capsys):
    data = cached("gpu-dry-run", lambda d: Path(pack_api([wiki_subset(300)], d / "out").output))
    out = tmp_path / "gpu.json"
    runs = bench_gpu.main(["--dry-run", "--data", str(data), "--steps", "2", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["124M", "10M"] == [r.model for r in runs]
    for row in rows:
        assert row["device"] == "cpu" and row["steps"] == 2 and row["batch"].endswith(f"x {bench_gpu.DRY_SEQ_LEN}")
        assert row["synthetic_tokens_per_s"] > 0 and row["fed_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["fed_tokens_per_s"] / row["synthetic_tokens_per_s"])
        assert 0 <= row["trainer_wait_share"] <= 1 and 0 <= row["loader_data_wait_share"] <= 1
        assert row["pinned"] is False  # no CUDA: the loader pins nothing
    printed = capsys.readouterr().out
    assert "| 124M (" in printed and "| 10M (" in printed and "fed / synthetic (goal)" in printed


def test_without_a_gpu_the_full_run_says_so():
    if bench_gpu_cuda():
        pytest.skip("this machine has CUDA: the full run would start")
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench_gpu.main(["--data", "unused"])


def bench_gpu_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
