"""One of 2 gloo ranks: iterate a loader that gathers the data wait every 2 steps, report metrics.

Each rank reads the whole dataset (rank=0 of 1 for the data), so both take the same steps; the
process group (2 ranks) is what the reduction gathers over. The rank given a URL reads through a
slow store, so its data wait is the larger.
"""

import argparse
import json
import os

import torch.distributed as dist

import wdsllm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    loader = wdsllm.loader(
        args.data, batch_size=4, rank=0, world_size=1, reduce_every=2, fetch_process=False, watchdog_s=None
    )
    steps = 0
    for _ in loader:
        steps += 1
    report = {"steps": steps, "metrics": loader.metrics()}
    with open(os.path.join(args.out, f"rank{args.rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    loader.close()


if __name__ == "__main__":
    main()
