"""Run under torchrun: a parallel layout (a DeviceMesh, or Megatron-style process groups) reads
one epoch; every rank reports its coordinates and, per step, what it yielded.

Each step does an all_reduce over the whole world, as a training step's collectives would: a rank
with fewer steps than the others would leave them waiting (the test's timeout makes that a
failure). ``--other-seed-at DIM`` builds the peers at coordinate 1 of that dim with another seed:
they must all raise ReplicaMismatchError at construction, which is reported, not a hang.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from launch_runs import split_runs
from torch.distributed.device_mesh import init_device_mesh

import wdsllm
import wdsllm.storage
from wdsllm.load.agree import field_digests

LAYOUTS = {  # mesh dims, in order, and the role of each
    "dp2tp2": (("dp", 2), ("tp", 2)),
    "dp2cp2": (("dp", 2), ("cp", 2)),
    "pp2dp2": (("pp", 2), ("dp", 2)),
    "pp3dp2": (("pp", 3), ("dp", 2)),
    "dp1pp3": (("dp", 1), ("pp", 3)),
    "dp2tp1": (("dp", 2),),
    "dp1tp2": (("dp", 1), ("tp", 2)),
    "dp4": (("dp", 4),),
    "dp2tp2cp2": (("dp", 2), ("tp", 2), ("cp", 2)),
}


def _layout_options(args: argparse.Namespace) -> tuple[dict, dict]:
    """The loader's layout keywords and this rank's coordinates."""
    dims = LAYOUTS[args.layout]
    names = tuple(n for n, _ in dims)
    if args.groups:  # Megatron style: the same layout from plain process groups
        return _groups(dims)
    mesh = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=names)
    kw = {"mesh": mesh, "dp": "dp"}
    if "cp" in names:
        kw["cp"] = "cp"
    if "pp" in names:
        kw["pp"] = "pp"
    return kw, dict(zip(names, mesh.get_coordinate(), strict=True))


def _groups(dims: tuple) -> tuple[dict, dict]:
    """dp x (tp, cp or pp): rank = dp * size + peer; every rank makes every group, in the same
    order. The peers' group is the replica group, and also the CP or PP group where the dim is."""
    (_, dp_size), (other, size) = dims
    rank = dist.get_rank()
    dp_groups = [dist.new_group([d * size + t for d in range(dp_size)]) for t in range(size)]
    peer_groups = [dist.new_group([d * size + t for t in range(size)]) for d in range(dp_size)]
    dp, peer = divmod(rank, size)
    kw = {"dp_group": dp_groups[peer], "replica_group": peer_groups[dp]}
    if other in ("cp", "pp"):
        kw[f"{other}_group"] = peer_groups[dp]
    return kw, {"dp": dp, other: peer}


def main() -> None:
    """Every run the command line names (runs are separated by ``--then``), one after the other
    in one process group: one launch checks several layouts."""
    parsed = [_parser().parse_args(run) for run in split_runs(sys.argv[1:])]
    dist.init_process_group("gloo")
    for args in parsed:
        run(args)
        dist.barrier()  # the next run starts on every rank together, as a new launch would
    dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", required=True, choices=list(LAYOUTS))
    ap.add_argument("--groups", action="store_true")
    ap.add_argument("--replicas", default="read")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--other-seed-at", default=None)
    ap.add_argument("--save-at", type=int, default=None, help="save every rank's state after this step, then stop")
    ap.add_argument("--resume", default=None, help="a directory of states saved by --save-at")
    ap.add_argument("--dcp", action="store_true", help="save and resume through torch.distributed.checkpoint")
    ap.add_argument("--state-at", type=int, default=None, help="every rank's state after this step, reported")
    ap.add_argument("--agree-every", type=int, default=None)
    return ap


def run(args: argparse.Namespace) -> None:
    """One run: this rank's loader in the layout reads the epoch; its report goes to --out."""
    layout, coords = _layout_options(args)
    seed = 7 + (1 if args.other_seed_at and coords.get(args.other_seed_at) == 1 else 0)
    kw = {"batch_size": 3, "pad_to_multiple_of": 4, "seed": seed, "shuffle_buffer": 16, "num_workers": args.workers}
    kw["agree_every"] = args.agree_every
    try:
        loader = wdsllm.loader(args.data, replicas=args.replicas, **layout, **kw)
    except wdsllm.ReplicaMismatchError as exc:  # settings compared at construction: every rank raises
        report = {"coords": coords, "steps": [], "error": {"type": type(exc).__name__, "message": str(exc)}}
        report["error"]["step"] = "construction"
        with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(report, f)
        return  # the launch's next run follows (main: a barrier, the group kept)
    if args.resume and args.dcp:
        dcp.load({"dataloader": loader}, checkpoint_id=args.resume)
    elif args.resume:
        mine = os.path.join(args.resume, f"state-dp{loader.rank}.json")  # else another DP rank's: an elastic resume
        with open(mine if os.path.exists(mine) else os.path.join(args.resume, "state-dp0.json")) as f:
            loader.load_state_dict(json.load(f))
    report = {"coords": coords, "dp_rank": loader.rank, "dp_size": loader.world_size, "steps": []}
    try:
        for step, batch in enumerate(loader):
            report["steps"].append(_step(batch))
            dist.all_reduce(torch.ones(1))  # a collective per step, like a training step's
            if args.state_at is not None and step + 1 == args.state_at:
                report["state"] = loader.state_dict()["state"]  # every rank: replica peers' are compared
            if args.save_at is not None and step + 1 == args.save_at:
                if args.dcp:  # DCP asks every rank for the state (replica peers' are compared)
                    dcp.save({"dataloader": loader}, checkpoint_id=args.out)
                    break
                state = loader.state_dict()  # every rank: replica peers' states are compared
                with open(os.path.join(args.out, f"state-dp{loader.rank}.json"), "w") as f:
                    json.dump(state, f)
                break
    except wdsllm.WdsllmError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "step": len(report["steps"])}
    report["received_bytes"] = wdsllm.storage.stats()["received_bytes"]  # from remote stores
    if "error" not in report:  # what a middle stage answers is its first stage's
        report["len"], report["epoch"] = len(loader), loader.epoch
    loader.close()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)


def _step(batch: dict) -> dict:
    out = {"digest": field_digests({k: v for k, v in batch.items() if k != "epoch"})}
    if "docs" in batch:
        out["docs"] = batch["docs"][:, 0].tolist()
    if "input_ids" in batch:
        out["input_ids"] = batch["input_ids"].tolist()
    if "cp_token_ranges" in batch:
        out["ranges"] = batch["cp_token_ranges"].tolist()
    return out


if __name__ == "__main__":
    main()
