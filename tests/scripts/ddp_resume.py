"""Run under torchrun: stream batches, checkpoint the loader at a step, optionally die there.

--kill-at K: after K steps every rank saves its loader state and kills itself with SIGKILL
(a crash, not a clean exit). --resume DIR: every rank loads the state saved by rank 0 (equal
batches make any rank's state valid for all) and continues. Every rank writes the document ids
of each step it ran to OUT/rank{r}.json.

Several runs, separated by ``--then``, go one after the other in one launch (one start of the
processes for several checks); with --kill-at, a run stops after saving, and the processes die
after the last run.
"""

import argparse
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from launch_runs import split_runs

import wdsllm


def main() -> None:
    parsed = [_parser().parse_args(run) for run in split_runs(sys.argv[1:])]
    dist.init_process_group("gloo")
    killed = [run(args) for args in parsed]
    if any(killed):
        os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--resume", default="")
    ap.add_argument("--batching", default="fixed")
    return ap


def run(args: argparse.Namespace) -> bool:
    """One run; True where it stopped at --kill-at (its state saved, its loader left running)."""
    rank = dist.get_rank()
    extra = dict(batching="bucket", window=16) if args.batching == "bucket" else {}
    loader = wdsllm.loader(
        args.data, batch_size=4, num_workers=args.workers, seed=7, shuffle_buffer=12, persistent_workers=True, **extra
    )
    start_epoch = 0
    if args.resume:
        with open(os.path.join(args.resume, "state-rank0.json")) as f:
            state = json.load(f)
        loader.load_state_dict(state)
        start_epoch = loader.epoch  # the restored epoch
    steps = []
    step = 0
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            steps.append({"epoch": epoch, "ids": batch["docs"][:, 0].tolist()})
            flag = torch.ones(1)
            dist.all_reduce(flag)  # a collective per step, as DDP does
            step += 1
            if step == args.kill_at:
                with open(os.path.join(args.out, f"state-rank{rank}.json"), "w") as f:
                    json.dump(loader.state_dict(), f)
                with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
                    json.dump(steps, f)
                dist.barrier()
                return True
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(steps, f)
    dist.barrier()
    loader.close()
    return False


if __name__ == "__main__":
    main()
