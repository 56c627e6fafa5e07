"""One rank of tests/test_steering_ranks.py: two gloo processes steer one loader each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import wdsllm
from wdsllm.errors import SteeringError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    loader = wdsllm.loader(args.data, batch_size=4, seed=1)
    report: dict = {"errors": []}
    report["skip"] = loader.skip(2, 4)  # the same on both ranks: taken
    it = iter(loader)
    docs = [[int(d[0]) for d in next(it)["docs"].tolist()] for _ in range(3)]
    try:  # another document on each rank: refused on both, nothing excluded
        loader.exclude(docs=[5 + args.rank])
    except SteeringError as exc:
        report["errors"].append(str(exc))
    report["log"] = loader.steering.log.to_json()
    docs += [[int(d[0]) for d in b["docs"].tolist()] for b in it]
    report["docs"] = docs
    report["planned"] = loader.planned_step
    Path(args.out, f"rank{args.rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
