"""Lightning with a wdsllm.loader returned from train_dataloader() (issue #17): every epoch is a
new epoch (Lightning stops after len(loader) batches without exhausting the iterator, and never
calls set_epoch on a loader), and a mid-epoch checkpoint resumes exactly."""

from __future__ import annotations

from collections import Counter

import lightning as L
import pytest
import torch
from test_hf import _docs_data
from transformers import LlamaConfig, LlamaForCausalLM

import wdsllm
from wdsllm.integrations.lightning import LoaderEpochs

VOCAB = 512


class Module(L.LightningModule):
    def __init__(self, data, records: list):
        super().__init__()
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        self.model = LlamaForCausalLM(cfg)
        self.data = data
        self.records = records

    def train_dataloader(self):
        self.loader = wdsllm.loader(self.data, batch_size=6, seed=3, shuffle_buffer=16)
        return self.loader

    def training_step(self, batch, index):
        labels = batch["labels"]
        loss = self.model(
            input_ids=batch["input_ids"] % VOCAB,
            attention_mask=batch["attention_mask"],
            labels=torch.where(labels < 0, labels, labels % VOCAB),
        ).loss
        self.records.append(
            {"epoch": batch["epoch"], "docs": batch["docs"][:, 0].tolist(), "loss": float(loss.detach())}
        )
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StopAt(L.Callback):
    def __init__(self, step: int, path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def fit(callbacks: list, ckpt=None, **kw) -> list[dict]:
    records: list = []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **kw,
    )
    trainer.fit(Module(_docs_data()[0], records), ckpt_path=ckpt)
    return records


@pytest.mark.parametrize("callbacks", [[], [LoaderEpochs()]], ids=["loader-alone", "callback"])
def test_every_epoch_is_a_new_epoch(callbacks):
    records = fit(callbacks)
    everything = set(_docs_data()[1]["expect"])
    orders = []
    for epoch in (0, 1):
        docs = [d for r in records if r["epoch"] == epoch for d in r["docs"]]
        assert set(docs) == everything and max(Counter(docs).values()) == 1, f"epoch {epoch}"
        orders.append(docs)
    assert orders[0] != orders[1], "epoch 1 repeated epoch 0's order"


def test_a_short_epoch_still_moves_on_with_the_callback():
    """limit_train_batches ends each epoch early: the callback sets the epoch from the trainer."""
    records = fit([LoaderEpochs()], limit_train_batches=3)
    assert [r["epoch"] for r in records] == [0, 0, 0, 1, 1, 1]
    assert records[0]["docs"] != records[3]["docs"]


def test_mid_epoch_checkpoint_resumes_exactly(tmp_path):
    """Saved at step 18, in the second epoch (14 batches each): resumed from Lightning's checkpoint."""
    full = fit([LoaderEpochs()])
    path = tmp_path / "stop.ckpt"
    first = fit([LoaderEpochs(), StopAt(18, path)])
    rest = fit([LoaderEpochs()], ckpt=str(path))
    assert [(r["epoch"], r["docs"]) for r in first + rest] == [(r["epoch"], r["docs"]) for r in full]
    assert [r["loss"] for r in first + rest] == pytest.approx([r["loss"] for r in full], rel=1e-5)
