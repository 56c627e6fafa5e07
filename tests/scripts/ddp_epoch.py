"""Run under torchrun: every rank streams one epoch and reports what it saw.

Each step does an all_reduce, as DDP's gradient sync would: if ranks yielded different numbers of
batches, a rank would wait forever here (the test's timeout turns that into a failure).
Several runs, separated by ``--then``, go one after the other in one launch.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from launch_runs import split_runs

import wdsllm


def main() -> None:
    parsed = [_parser().parse_args(run) for run in split_runs(sys.argv[1:])]
    dist.init_process_group("gloo")
    for args in parsed:
        run(args)
        dist.barrier()
    dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--equal-batches", type=int, default=1)
    return ap


def run(args: argparse.Namespace) -> None:
    """One run: every epoch of this rank's loader; the report goes to OUT/rank{r}.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = wdsllm.loader(
        args.data,
        batch_size=args.batch_size,
        num_workers=args.workers,
        seed=3,
        shuffle_buffer=16,
        equal_batches=bool(args.equal_batches),
    )
    report = {"rank": rank, "world": world, "epochs": []}
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        ids, batches = [], 0
        for batch in loader:
            ids.extend(batch["docs"][:, 0].tolist())
            batches += 1
            if args.equal_batches:
                step = torch.ones(1)
                dist.all_reduce(step)  # a collective per step, like DDP
        report["epochs"].append({"ids": ids, "batches": batches, "dropped_batches": loader.dropped_batches})
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    loader.close()


if __name__ == "__main__":
    main()
