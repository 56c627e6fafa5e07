"""Run under torchrun: an Accelerate loop on wdsllm.integrations.accelerate.prepare (issue #17).

The loader is built *before* the Accelerator, with RANK and WORLD_SIZE hidden, as under a launcher
that sets them only when Accelerator() starts the process group (mpirun): it must still read its
own rank's share. Phases in the same processes: a full run of 2 epochs with gradient accumulation
2; then for each STOP a run that saves with accelerator.save_state at the first optimizer step
after STOP micro-batches and stops, and a run resumed with load_state. Records go to
OUT/rank{R}.json.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM, set_seed

import wdsllm
from wdsllm.integrations import model_inputs
from wdsllm.integrations.accelerate import prepare

VOCAB = 512
LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


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


class Progress:
    """Micro-batches trained so far (saved with the accelerator's state)."""

    def __init__(self) -> None:
        self.micro = 0

    def state_dict(self) -> dict:
        return {"micro": self.micro}

    def load_state_dict(self, state: dict) -> None:
        self.micro = state["micro"]


def run(data: str, ckpt: str, batch_size: int, stop: int | None = None, resume: bool = False) -> dict:
    hidden = {k: os.environ.pop(k) for k in LAUNCHER_KEYS}
    loader = wdsllm.loader(data, batch_size=batch_size, seed=3, num_workers=1, shuffle_buffer=16)
    built_as = [loader.rank, loader.world_size]
    os.environ.update(hidden)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    loader = prepare(acc, loader)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    if resume:
        acc.load_state(ckpt)
    records = []
    for epoch in range(loader.epoch, 2):
        loader.set_epoch(epoch)
        for batch in loader:
            inputs = model_inputs(batch)
            inputs["input_ids"] = inputs["input_ids"] % VOCAB
            inputs["labels"] = torch.where(inputs["labels"] < 0, inputs["labels"], inputs["labels"] % VOCAB)
            with acc.accumulate(model):
                loss = model(**inputs).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            progress.micro += 1
            records.append(
                {
                    "micro": progress.micro,
                    "epoch": batch["epoch"],
                    "shape": list(batch["input_ids"].shape),
                    "docs": batch["docs"][:, 0].tolist(),
                    "loss": float(loss.detach()),
                    "sync": bool(acc.sync_gradients),
                    "device": str(batch["input_ids"].device),
                }
            )
            if stop is not None and progress.micro >= stop and acc.sync_gradients:
                acc.save_state(ckpt)
                return {"records": records, "built_as": built_as, "len": len(loader)}
    return {"records": records, "built_as": built_as, "len": len(loader), "rank": [loader.loader.rank]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--stops", default="4,10")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    report = {"full": run(args.data, "", args.batch_size)}
    for stop in map(int, args.stops.split(",")):
        ckpt = os.path.join(args.out, f"state{stop}")
        report[f"first{stop}"] = run(args.data, ckpt, args.batch_size, stop=stop)
        report[f"resume{stop}"] = run(args.data, ckpt, args.batch_size, resume=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
