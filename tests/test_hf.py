"""Hugging Face transformers with wdsllm (issue #17): the Trainer integration under torchrun, the
wrong wirings refused, and padding-free packing with the key names HF models read."""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise

import pytest
import torch
from pack_helpers import SHAKESPEARE, cached, pack_api
from synth import write_dataset
from test_distributed import torchrun
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers import Trainer as HFTrainer

import wdsllm
from wdsllm.errors import UsageError
from wdsllm.integrations import model_inputs
from wdsllm.integrations.hf import Trainer


def _docs_data():
    """(path, what synth wrote) of a small docs-mode dataset."""

    def build(d):
        return d, write_dataset(d, [23, 19, 21, 17], max_len=30, seed=7)

    return cached("hf-docs", build)


@pytest.mark.timeout(240)
def test_trainer_two_ranks_each_document_once_and_resume_exact(tmp_path):
    """torchrun, 2 ranks, gloo, CPU, a tiny Llama, gradient accumulation 2 over an odd number of
    batches: every document of each epoch once across ranks, batches of the loader's shape, and a
    run resumed from checkpoint-3 (mid epoch 0) or checkpoint-6 (mid epoch 1) trains on exactly
    the micro-batches of the uninterrupted run, with the same losses."""
    data, info = _docs_data()
    torchrun("hf_trainer.py", 2, "--data", str(data), "--out", str(tmp_path), "--batch-size", "6", timeout=200)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    everything = set(info["expect"])
    for rep in reports:
        full = rep["full"]
        assert full["global_step"] == 8 and full["len"] == 7
        assert len(full["records"]) == 14
    for epoch in (0, 1):
        seen = Counter(
            d for rep in reports for rec in rep["full"]["records"] if rec["epoch"] == epoch for d in rec["docs"]
        )
        assert set(seen) == everything and max(seen.values()) == 1, f"epoch {epoch}: not every document once"
        for rep in reports:
            shapes = [rec["shape"] for rec in rep["full"]["records"] if rec["epoch"] == epoch]
            assert all(len(s) == 2 for s in shapes), "batches are [B, L]: not batched again"
            assert [s[0] for s in shapes[:-1]] == [6] * (len(shapes) - 1) and shapes[-1][0] <= 6
    for rep in reports:
        full = rep["full"]["records"]
        for stop in (3, 6):
            first, resumed = rep[f"first{stop}"]["records"], rep[f"resume{stop}"]["records"]
            assert rep[f"resume{stop}"]["global_step"] == 8
            joined = first + resumed
            assert [(r["step"], r["epoch"], r["docs"]) for r in joined] == [
                (r["step"], r["epoch"], r["docs"]) for r in full
            ], f"resume from checkpoint-{stop} trained on other batches"
            assert [r["loss"] for r in joined] == pytest.approx([r["loss"] for r in full], rel=1e-5)


def _args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=2,
        disable_tqdm=True,
        **kw,
    )


def tiny_llama(vocab: int = 60000, attn: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def test_plain_trainer_on_the_dataset_is_refused(tmp_path):
    """Row 1: the Trainer batches wdsllm.dataset's batches again; refused, saying what to do."""
    pipe = wdsllm.dataset(_docs_data()[0], batch_size=4)
    trainer = HFTrainer(model=tiny_llama(vocab=60000), args=_args(tmp_path), train_dataset=pipe)
    with pytest.raises(UsageError, match="integrations.hf.Trainer"):
        trainer.train()
    loader = wdsllm.loader(_docs_data()[0], batch_size=4)
    with pytest.raises(UsageError, match="train_loader="):
        Trainer(model=tiny_llama(vocab=60000), args=_args(tmp_path), train_dataset=pipe, train_loader=loader)
    with pytest.raises(UsageError, match="needs train_loader"):
        Trainer(model=tiny_llama(vocab=60000), args=_args(tmp_path))


# ----------------------------------------------------------------------------------------------
# Padding-free packing


def _packed_data():
    def build(d):
        path = d / "head.txt"
        path.write_bytes(SHAKESPEARE.read_bytes()[:20_000])
        pack_api([path], d / "ds", mode="packed", seq_len=64)
        return d / "ds"

    return cached("hf-packed", build)


def _alone(model, batch) -> tuple[float, int]:
    """The summed loss and target count of every document of the batch, each run alone."""
    total, count = 0.0, 0
    for r in range(batch["input_ids"].shape[0]):
        pos = batch["position_ids"][r]
        starts = [*(pos == 0).nonzero().flatten().tolist(), len(pos)]
        for a, z in pairwise(starts):
            ids, labels = batch["input_ids"][r, a:z], batch["labels"][r, a:z].clone()
            labels[0] = -100  # nothing predicts a document's first token (nor one cut by the row's start)
            n = int((labels[1:] != -100).sum())
            if n:
                total += float(model(input_ids=ids[None], labels=labels[None], use_cache=False).loss) * n
                count += n
    return total, count


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_loss_equals_its_documents_run_alone(attn):
    """A tiny random LlamaForCausalLM: the loss of packed rows, called with model_inputs(batch)
    (position_ids, cu_seq_lens_q/k, max_length_q/k, use_cache=False), equals the losses of their
    documents run one by one; without the boundaries it does not."""
    batch = next(iter(wdsllm.dataset(_packed_data(), batch_size=2, boundaries=True, seed=1)))
    assert {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= set(batch)
    assert int((batch["position_ids"] == 0).sum()) > 4, "the rows hold several documents"
    model = tiny_llama(vocab=50257, attn=attn, seed=1)
    with torch.no_grad():
        packed = float(model(**model_inputs(batch)).loss)
        total, count = _alone(model, batch)
        leaky = float(model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss)
    assert packed == pytest.approx(total / count, rel=1e-5, abs=1e-6)
    assert leaky != pytest.approx(total / count, rel=1e-5, abs=1e-6), "the check must be able to fail"


def test_model_inputs_keeps_only_what_the_model_reads():
    batch = next(iter(wdsllm.dataset(_packed_data(), batch_size=2, boundaries=True, seed=1)))
    inputs = model_inputs(batch)
    assert set(inputs) == {
        "input_ids",
        "labels",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "use_cache",
    }
    assert inputs["use_cache"] is False
    assert set(model_inputs(batch, flash_keys=False)) == {"input_ids", "labels", "position_ids", "use_cache"}
    docs = next(iter(wdsllm.dataset(_docs_data()[0], batch_size=2)))
    assert set(model_inputs(docs)) == {"input_ids", "attention_mask", "labels"}
