"""Run under torchrun: every rank streams one epoch of raw text (tokenized in its workers) with a
count sidecar, and reports what it saw. Each step does an all_reduce, as DDP's gradient sync
would: ranks with different batch counts would hang here (the test's timeout fails that)."""

import argparse
import json
import os

import torch
import torch.distributed as dist

import wdsllm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--counts", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = wdsllm.loader(
        args.data,
        tokenizer=args.tokenizer,
        counts=args.counts,
        unit_bytes=40_000,
        batch_size=4,
        num_workers=2,
        seed=5,
        shuffle_buffer=32,
    )
    ids, batches = [], 0
    for batch in loader:
        ids.extend(batch["docs"][:, 0].tolist())
        batches += 1
        dist.all_reduce(torch.ones(1))
    report = {"rank": rank, "ids": ids, "batches": batches, "len": len(loader), "dropped": loader.dropped_batches}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
