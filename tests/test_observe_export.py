"""The exporters: JSON lines written during a run and drawn by ``wdsllm metrics``, a real
TensorBoard SummaryWriter, the HF Trainer's and Lightning's callbacks."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from click.testing import CliRunner
from pack_helpers import cached
from synth import write_dataset

import wdsllm
from wdsllm.cli.app import cli
from wdsllm.observe.export import MetricsLog, read_metrics, selected


def _data() -> Path:
    return cached("observe-export", lambda d: write_dataset(d, [40, 30], seed=8) and d)


def _run(path: Path, every: int = 2) -> int:
    with wdsllm.loader(_data(), batch_size=4) as loader, MetricsLog(path, every=every) as log:
        steps = 0
        for steps, _ in enumerate(loader, 1):
            log.write(steps, loader.metrics())
    return steps


def test_a_run_written_as_json_lines_is_summed_up_and_drawn(tmp_path):
    path = tmp_path / "data.jsonl"
    steps = _run(path)
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(2, steps + 1, 2))
    assert all(0 <= r["data_wait_share"] <= 1 for r in records)
    out = CliRunner().invoke(cli, ["metrics", str(path), "--plot", str(tmp_path / "data.png"), "--json"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output)
    assert summary["lines"] == len(records) and summary["steps"] == records[-1]["step"]
    assert summary["slowest_stage"] in summary["stages_s"]
    assert (tmp_path / "data.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_line_is_named(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"step": 1, "data_wait_s": 0.1}\n{"step": 2, "data_wait_s": "slow"}\n')
    out = CliRunner().invoke(cli, ["metrics", str(path)])
    assert out.exit_code != 0 and "line 2" in out.output and "data_wait_s" in out.output


def test_tensorboard_summary_writer_gets_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(tmp_path / "tb")
    with wdsllm.loader(_data(), batch_size=4) as loader:
        for step, _ in enumerate(loader):
            for key, value in selected(loader.metrics()).items():  # the docs' example
                writer.add_scalar(key, value, step)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    shares = events.Scalars("data/data_wait_share")
    assert [e.step for e in shares] == list(range(len(shares))) and len(shares) == 18


def test_hf_callback_adds_the_figures_to_each_log(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from wdsllm.integrations.hf import LoaderMetrics

    with wdsllm.loader(_data(), batch_size=4) as loader:
        sum(1 for _ in loader)
        callback = LoaderMetrics(loader, jsonl=str(tmp_path / "hf.jsonl"))
        logs = {"loss": 1.0}
        state = TrainerState(global_step=18)
        callback.on_log(TrainingArguments(tmp_path / "out"), state, TrainerControl(), logs=logs)
        callback.on_train_end(None, state, None)
    assert logs["loss"] == 1.0 and 0 <= logs["data/data_wait_share"] <= 1 and "data/slowest_stage" in logs
    (record,) = read_metrics(tmp_path / "hf.jsonl")
    assert record["step"] == 18 and record["steps"] == 18


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(60000, 2)

    def train_dataloader(self):
        return wdsllm.loader(_data(), batch_size=4)

    def training_step(self, batch, index):
        return self.embed(batch["input_ids"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_callback_logs_through_the_trainers_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from wdsllm.integrations.lightning import LoaderMetrics

    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        callbacks=[LoaderMetrics(every=3, jsonl=str(tmp_path / "pl.jsonl"))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(_Tiny())
    header, *rows = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()
    assert "data/data_wait_share" in header.split(",") and rows
    assert [r["step"] for r in read_metrics(tmp_path / "pl.jsonl")] == [3, 6, 9, 12, 15, 18]


@pytest.mark.parametrize("every", [0, -1])
def test_metrics_log_refuses_a_bad_period(tmp_path, every):
    with pytest.raises(ValueError, match="every must be positive"):
        MetricsLog(tmp_path / "x.jsonl", every=every)
