"""Run under torchrun: two epochs of one shard cut into blocks, and epoch 1 again, interrupted and
resumed; every rank reports the documents of each.

--min-block-tokens sets ``plan.MIN_BLOCK_TOKENS`` before the loader is made (its DataLoader workers
fork from this process and keep it): a small shard then cuts into blocks as a shard of the default
size does. Each step does an all_reduce, as DDP's gradient sync would.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import wdsllm
from wdsllm.load import plan


def _step() -> None:
    flag = torch.ones(1)
    dist.all_reduce(flag)  # a collective per step: ranks with different batch counts would hang here


def _loader(data: str, workers: int) -> wdsllm.Loader:
    return wdsllm.loader(data, batch_size=8, num_workers=workers, seed=5, shuffle_buffer=32)


def _ids(batch: dict) -> list[int]:
    return batch["docs"][:, 0].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--min-block-tokens", type=int, required=True)
    ap.add_argument("--resume-at", type=int, default=30)
    args = ap.parse_args()
    plan.MIN_BLOCK_TOKENS = args.min_block_tokens
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = _loader(args.data, args.workers)
    report: dict = {"epochs": [], "batches": []}
    for epoch in range(2):
        loader.set_epoch(epoch)
        ids = []
        for batch in loader:
            ids.extend(_ids(batch))
            _step()
        report["epochs"].append(ids)
        report["batches"].append(len(ids))
    loader.close()
    first = _loader(args.data, args.workers)
    first.set_epoch(1)
    resumed = []
    for step, batch in enumerate(first):
        resumed.extend(_ids(batch))
        _step()
        if step + 1 == args.resume_at:
            break
    state = first.state_dict()
    first.close()
    second = _loader(args.data, args.workers)
    second.load_state_dict(json.loads(json.dumps(state)))  # through JSON, as a checkpoint is
    for batch in second:
        resumed.extend(_ids(batch))
        _step()
    second.close()
    report["resumed"] = resumed
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
