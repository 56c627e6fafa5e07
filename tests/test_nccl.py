"""Every collective the loader makes, over NCCL on a GPU (issue #44): the agreement check,
broadcast replicas with variable-length fields, the pipeline feed and the wait reduction
(``reduce_every``), under a 1-D and a 2-D CUDA DeviceMesh, in a process group of world size 1
(one GPU cannot hold two NCCL ranks; ``tests/scripts/nccl_collectives.py`` says how a group of
one plays both ends). The collectives' tensors are on the GPU, and nothing copies a batch to the
GPU that the user did not ask for: the loader's batches stay on the CPU (pinned, as asked).

Without CUDA the NCCL test is skipped, saying so; the same script over gloo on CPU keeps it
honest on every machine. ``tools/gpu_check.sh`` runs this module on a GPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from synth import write_dataset
from test_distributed import torchrun

NO_NCCL = (
    "no CUDA device here (torch.cuda.is_available() is False): NCCL runs on GPUs only; "
    "tools/gpu_check.sh runs this test on a GPU machine"
    if not torch.cuda.is_available()
    else "torch was built without NCCL"
    if not dist.is_nccl_available()
    else ""
)


def _report(tmp_path: Path, backend: str) -> dict:
    data = tmp_path / "ds"
    write_dataset(data, [23, 7, 31, 2, 18], max_len=30)
    out = tmp_path / "out"
    out.mkdir()
    torchrun("nccl_collectives.py", 1, "--data", str(data), "--out", str(out), "--backend", backend)
    return json.loads((out / "report.json").read_text())


def _check(report: dict, backend: str, device: str) -> None:
    assert (report["backend"], report["world"], report["device"]) == (backend, 1, device)
    for mesh in ("1d", "2d"):
        got = report[mesh]
        assert got["batches"] > 1 and len(got["cu_seqlens_lengths"]) > 1  # fields of several lengths
        # the loader's batches stay where the loader made them: on the CPU, pinned where asked
        assert got["devices"] == got["batch_devices_after_checks"] == got["first_stage_devices"] == ["cpu"]
        assert got["pinned"] is (True if device.startswith("cuda") else None)
        assert got["data_wait_ranks"] == 1.0  # reduce_every=1 ran each step over the mesh's DP group
        # the collectives' own tensors on the group's device
        assert got["agreement"] == {"device": device, "checks": got["batches"]}
        assert got["wire_device"] == got["feed_device"] == got["reduce_device"] == device
        assert got["round_trips"] == [True] * got["batches"] and got["end"]
        assert got["middle_view"] == ["epoch"] and got["middle_checks"] == 1 and got["followed"] == [[0, 1, None]]
        assert [r["data_wait_ranks"] for r in got["reduced"]] == [1.0, 1.0]
        assert [r["data_wait_rank_max_share"] for r in got["reduced"]] == [0.25, 0.25]
    assert report["1d"]["layout_replicas"] is None and report["2d"]["layout_replicas"] == 1


@pytest.mark.skipif(bool(NO_NCCL), reason=NO_NCCL)
@pytest.mark.timeout(300)
def test_every_collective_runs_over_nccl_with_its_tensors_on_the_gpu(tmp_path):
    _check(_report(tmp_path, "nccl"), "nccl", "cuda:0")


@pytest.mark.timeout(300)
def test_the_same_collectives_over_gloo_at_world_size_1(tmp_path):
    _check(_report(tmp_path, "gloo"), "gloo", "cpu")
