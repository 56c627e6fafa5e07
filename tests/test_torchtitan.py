"""wdsllm in torchtitan 0.3 (issue #46), against the real wheel: the data loader its config
system builds, torchtitan's batch format with next-token labels, endless streams whose state goes
through ``CheckpointManager`` and resumes exactly (per data-parallel rank where it must, on
another data-parallel size where it can), and the meshes torchtitan users reach for.

The fast tests run in this process (one rank). The torchrun test runs 4 gloo processes with
torchtitan's own ``ParallelDims``, ``CheckpointManager`` and training-step methods
(tests/scripts/titan_run.py), with the three CPU shims of tests/titan_shims.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
import torch
from pack_helpers import cached
from synth import write_dataset

pytest.importorskip("torchtitan")
import titan_shims

titan_shims.install()

import tyro  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402

import wdsllm  # noqa: E402
from wdsllm.integrations.torchtitan import WdsllmDataLoader  # noqa: E402

SEQ = 16
SCRIPT = Path(__file__).parent / "scripts" / "titan_run.py"
#: the keywords torchtitan's trainer builds its data loader with (Trainer.__init__)
BUILD = dict(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SEQ, local_batch_size=2, snapshot_every_n_steps=None)


def _data() -> Path:
    def build(d: Path) -> Path:
        write_dataset(d / "rows", [8, 7, 6], mode="packed", seq_len=SEQ + 1, max_len=9, seed=3)
        write_dataset(d / "docs", [11, 7, 9], max_len=30, seed=1)
        write_dataset(d / "rows16", [4, 4], mode="packed", seq_len=SEQ, max_len=9, seed=3)
        return d

    return cached("torchtitan", build)


def _adapter(dataset: str, **options) -> WdsllmDataLoader:
    config = WdsllmDataLoader.Config(dataset_path=str(_data() / dataset), seed=3, shuffle_buffer=6, **options)
    return config.build(**BUILD)


class Nothing:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _checkpointer(adapter: WdsllmDataLoader, folder: Path) -> CheckpointManager:
    config = CheckpointManager.Config(
        enable=True, folder="ckpt", interval=1, keep_latest_k=0, initial_load_model_only=False
    )
    return CheckpointManager(
        config,
        dataloader=adapter,
        model_parts=[torch.nn.Linear(2, 2)],
        optimizers=Nothing(),
        lr_schedulers=Nothing(),
        states={},
        sd_adapter=None,
        base_folder=str(folder),
    )


def test_the_adapter_gives_torchtitans_batches_endlessly_and_resumes_through_its_checkpointer(tmp_path):
    for dataset in ("docs", "rows"):
        adapter = _adapter(dataset)
        steps = list(islice(adapter, 12))  # more than an epoch: the stream goes on
        read_with_the_row = 0
        for input_dict, labels in steps:
            assert set(input_dict) == {"input", "positions"}, "every other key would become a model keyword"
            inputs, positions = input_dict["input"], input_dict["positions"]
            assert inputs.shape == labels.shape == positions.shape == (2, SEQ)
            assert inputs.dtype == labels.dtype == positions.dtype == torch.int64
            known = labels[:, :-1] != -100
            assert torch.equal(labels[:, :-1][known], inputs[:, 1:][known]), "labels are the next tokens"
            read_with_the_row += int((labels[:, -1] != -100).sum())
        assert read_with_the_row > 6, "a row's last label is read with it (-100 only where a document ends)"
        adapter.close()
        adapter = _adapter(dataset)
        saver = _checkpointer(adapter, tmp_path / dataset)
        taken = list(islice(adapter, 5))
        assert saver.save(curr_step=5) and adapter.per_rank is False
        fresh = _adapter(dataset)
        assert _checkpointer(fresh, tmp_path / dataset).load(step=5)
        for (a, la), (b, lb) in zip(islice(fresh, 7), steps[5:]):
            assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb), "resumed exactly"
        assert [torch.equal(a["input"], b["input"]) for (a, _), (b, _) in zip(taken, steps)] == [True] * 5
        for ld in (adapter, fresh):
            ld.close()


def test_a_finite_run_ends_where_torchtitan_expects_it_to():
    adapter = _adapter("docs", epochs=1)
    assert 0 < sum(1 for _ in adapter) < 40


def test_rows_the_model_cannot_take_are_refused_by_name():
    with pytest.raises(wdsllm.ConfigError, match="pack with --seq-len 17"):
        _adapter("rows16")
    with pytest.raises(wdsllm.ConfigError, match="batching='concat' or 'pack'"):
        _adapter("docs", batching="bucket")
    with pytest.raises(wdsllm.ConfigError, match="dataset_path"):
        WdsllmDataLoader.Config().build(**BUILD)


def test_the_config_is_the_loaders_options_as_torchtitans_command_line_sets_them():
    default = WdsllmDataLoader.Config(dataset_path=str(_data() / "docs"))
    args = ["--dataset-path", str(_data() / "rows"), "--seed", "7", "--epochs", "3", "--no-boundaries"]
    config = tyro.cli(WdsllmDataLoader.Config, args=args, default=default)
    assert (config.seed, config.epochs, config.boundaries, config.equal_batches) == (7, 3, False, True)
    adapter = config.build(**BUILD)
    assert adapter.loader.cfg.seed == 7 and adapter.loader.cfg.epochs == 3 and adapter.loader.catalog.mode == "packed"
    with pytest.raises(TypeError):
        WdsllmDataLoader.Config(seq_len=SEQ)  # the trainer's: a build keyword, never a config field


def test_torchtitans_world_mesh_is_refused_with_the_recipe():
    """torchtitan 0.3's ``world_mesh`` is 1-D (``world``) whatever the parallelism: with tensor
    parallel groups made from it, splitting the data by it would give tensor peers different
    documents. A world of 4 in this process, on torch's fake backend (no collective is made)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed import ParallelDims

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
        with pytest.raises(wdsllm.ConfigError, match=r"tp groups were made from it .* dp='batch'"):
            wdsllm.loader(_data() / "rows", batch_size=2, mesh=dims.world_mesh)
        with pytest.raises(wdsllm.ConfigError, match=r"holds 2 of the process group's 4 ranks"):
            wdsllm.loader(_data() / "rows", batch_size=2, mesh=dims.get_mesh("batch"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, ckpt: Path, phase: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(_free_port()), str(SCRIPT), "--data", str(_data()), "--out", str(out)]
    cmd += ["--ckpt", str(ckpt), "--phase", phase, "--steps", "14", "--save-at", "7"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish (a rank hung?)\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(900)
def test_dp2_tp2_and_dp2_cp2_checkpoint_through_torchtitan_and_resume_exactly_also_as_dp4(tmp_path):
    """Each layout's adapter is built by its config with the trainer's keywords and fed through
    the trainer's ``batch_generator`` and ``post_dataloading_process``; saved at step 7 by
    ``CheckpointManager`` (DCP) and loaded in fresh processes, it yields steps 8-14 as the run that
    went on did; the dp2 x tp2 checkpoint loads as dp4 with no row twice."""
    first = _torchrun(tmp_path, tmp_path / "ckpt", "first")
    resumed = _torchrun(tmp_path, tmp_path / "ckpt", "resume")
    refused = first[0]["refused"]
    assert "tp groups were made from it" in refused["world"] and "dp='batch'" in refused["world"]
    assert "holds 2 of the process group's 4 ranks" in refused["batch"]
    for name in ("dp2tp2", "dp2cp2", "dp2tp2-own"):
        runs = [rep["layouts"][name] for rep in first]
        assert all(run["peers"] == [2, 2] for run in runs), "each DP rank's peers found (and checked) at build"
        assert [run["per_rank"] for run in runs] == [name == "dp2tp2-own"] * 4
        for rank, (run, again) in enumerate(zip(runs, (rep["layouts"][name] for rep in resumed))):
            assert all(step["next_token"] for step in run["steps"].values())
            epochs = [step["epoch"] for step in run["steps"].values()]
            assert epochs == sorted(epochs) and epochs[-1] >= 1, "endless: the stream runs into later epochs"
            assert {k: s["digest"] for k, s in again["steps"].items()} == {
                k: s["digest"] for k, s in run["steps"].items() if int(k) > 7
            }, f"{name} rank {rank}: resumed in fresh processes as the run went on"
        _check_peers(name, runs)
    _check_elastic([rep["layouts"]["dp2tp2"] for rep in first], [rep["layouts"]["dp4"] for rep in resumed])


def _check_peers(name: str, runs: list[dict]) -> None:
    """Tensor peers train on the same batches, DP ranks on different ones; CP peers get the whole
    row and torchtitan's step cuts its half for each (headtail: chunks r and 2CP-1-r)."""
    by_dp = {}
    for run in runs:
        digests = [s["digest"] for s in run["steps"].values()]
        assert by_dp.setdefault(run["dp_rank"], digests) == digests, f"{name}: peers of a DP rank differ"
    assert by_dp[0] != by_dp[1]
    for run in runs:
        for step in run["steps"].values():
            if name == "dp2cp2":
                assert step["shape"] == step["labels_shape"] == [2, SEQ // 2]
                q = SEQ // 4
                row, cut = step["whole"][0], step["cut"][0]
                assert cut in (row[:q] + row[3 * q :], row[q : 3 * q]), "headtail: chunks r and 2CP-1-r"
            else:
                assert step["shape"] == step["labels_shape"] == [2, SEQ] and step["cut"] == step["whole"]
            assert step["kwargs"] == ["positions"] and step["dtypes"] == ["torch.int64"] * 3


def _check_elastic(before: list[dict], after: list[dict]) -> None:
    """The rest of the saved epoch, dealt to 4 DP ranks: every row of it once, none of the 7
    steps before the save again; the later epochs follow dp4's plan."""
    epoch = before[0]["steps"]["7"]["epoch"]
    rows = Counter()
    for run in {run["dp_rank"]: run for run in before}.values():  # one of each DP rank's tensor peers
        rows.update(r for k, s in run["steps"].items() if int(k) <= 7 and s["epoch"] == epoch for r in s["rows"])
    assert {run["dp_rank"] for run in after} == {0, 1, 2, 3}
    for run in after:
        rows.update(r for s in run["steps"].values() if s["epoch"] == epoch for r in s["rows"])
        assert [s["epoch"] for s in run["steps"].values()][-1] > epoch
    assert max(rows.values()) == 1, "a row went to two data-parallel ranks"
    assert len(rows) >= 16
