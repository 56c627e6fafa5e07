"""Run under torchrun: every rank streams one epoch of documents split at max_len, twice (ranks
free, then equal batches with a collective per step), and reports the pieces and batch sizes."""

import argparse
import json
import os

import torch
import torch.distributed as dist

import wdsllm


def epoch(data: str, equal: bool, workers: int) -> dict:
    loader = wdsllm.loader(
        data, batch_size=4, max_len=8, num_workers=workers, seed=5, shuffle_buffer=7, equal_batches=equal
    )
    pieces, sizes = [], []
    for batch in loader:
        pieces.extend(tuple(x) for x in batch["docs"].tolist())
        sizes.append(len(batch["input_ids"]))
        if equal:
            dist.all_reduce(torch.ones(1))  # a collective per step, like DDP: unequal counts hang here
    out = {"pieces": pieces, "sizes": sizes, "len": len(loader), "dropped": loader.dropped_batches}
    loader.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"free": epoch(args.data, False, args.workers), "equal": epoch(args.data, True, args.workers)}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
