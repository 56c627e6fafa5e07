"""Run under torchrun: the Hugging Face Trainer on a wdsllm.loader, and its resume (issue #17).

Phases, one after another in the same processes: a full run of 2 epochs; then for each STOP a run
that saves and stops at global step STOP, and a run resumed from that checkpoint with a fresh
loader, model and Trainer. Every micro-batch's global step, epoch, documents, shape and loss go to
OUT/rank{R}.json.
"""

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments, set_seed

import wdsllm
from wdsllm.integrations.hf import Trainer

#: a tiny vocabulary keeps the model small; token ids are taken modulo it (the data path is under test)
VOCAB = 512


def tiny_llama() -> LlamaForCausalLM:
    set_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


class Recording(Trainer):
    records: list

    def compute_loss(self, model, inputs, *args, **kwargs):
        small = dict(inputs, input_ids=inputs["input_ids"] % VOCAB)
        small["labels"] = torch.where(inputs["labels"] < 0, inputs["labels"], inputs["labels"] % VOCAB)
        loss = super().compute_loss(model, small, *args, **kwargs)
        self.records.append(
            {
                "step": self.state.global_step,
                "epoch": inputs["epoch"],
                "shape": list(inputs["input_ids"].shape),
                "docs": inputs["docs"][:, 0].tolist(),
                "loss": float(loss.detach()),
            }
        )
        return loss


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


def run(data: str, out: str, args: argparse.Namespace, stop: int | None = None, resume: str | None = None) -> dict:
    loader = wdsllm.loader(data, batch_size=args.batch_size, seed=3, num_workers=1, shuffle_buffer=16)
    targs = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=1,  # not used: the loader's batch_size is
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        report_to=[],
        logging_strategy="no",
        save_strategy="no" if stop is None else "steps",
        save_steps=stop or 1,
        seed=0,
        learning_rate=1e-3,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Recording(model=tiny_llama(), args=targs, train_loader=loader, callbacks=[StopAt(stop)] if stop else [])
    trainer.records = []
    trainer.train(resume_from_checkpoint=resume)
    return {"records": trainer.records, "global_step": trainer.state.global_step, "len": len(loader)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--stops", default="3,6")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    report = {"full": run(args.data, os.path.join(args.out, "full"), args)}
    for stop in map(int, args.stops.split(",")):
        ckpt = os.path.join(args.out, f"stop{stop}")
        report[f"first{stop}"] = run(args.data, ckpt, args, stop=stop)
        report[f"resume{stop}"] = run(args.data, ckpt, args, resume=os.path.join(ckpt, f"checkpoint-{stop}"))
    report["world"] = int(os.environ["WORLD_SIZE"])
    report["threads"] = torch.get_num_threads()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
