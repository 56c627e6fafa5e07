"""Run under torchrun with 2 processes: the two tensor-parallel peers of one data-parallel rank
(a dp1 x tp2 mesh) read every batching mode, packed rows, a mixture and raw text, with
``replicas="read"`` and ``"broadcast"``; each reports, per case, the digests of every batch of an
epoch, and of a run saved after 2 batches and resumed in a new loader (with the number of
agreement checks the resumed loader made); and the error of peers that saved at different steps
and resumed."""

import argparse
import functools
import json
import os
from itertools import islice

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import wdsllm
from wdsllm.load.agree import field_digests


def cases(args: argparse.Namespace) -> dict:
    mix = wdsllm.Mixture({"a": args.docs, "b": args.other}, unit="items", epoch_items=30)
    raw = wdsllm.RawTextSource(args.raw, tokenizer=args.tokenizer)
    return {
        "fixed": (args.docs, {"batch_size": 3}),
        "bucket": (args.docs, {"batching": "bucket", "batch_size": 3, "window": 8}),
        "pack": (args.docs, {"batching": "pack", "batch_size": 2, "seq_len": 16, "window": 8, "boundaries": True}),
        "concat": (args.docs, {"batching": "concat", "batch_size": 2, "seq_len": 16}),
        "rows": (args.rows, {"batch_size": 2, "boundaries": True}),
        "mixture": (mix, {"batch_size": 3}),
        "raw": (raw, {"batch_size": 4}),
    }


def digests(batches) -> list[str]:
    return [json.dumps(field_digests({k: v for k, v in b.items() if k != "epoch"})) for b in batches]


def _saved_at_different_steps(docs: str, mesh) -> str | None:
    """Tensor peer r saves after 2 + r batches (no collective: each its own state), then each
    resumes from its own: the resumed pass's first batch differs (the error every peer raises)."""
    make = functools.partial(wdsllm.loader, docs, mesh=mesh, dp="dp", batch_size=3, seed=3)
    loader = make()
    list(islice(iter(loader), 2 + mesh.get_local_rank("tp")))
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    try:
        next(iter(resumed))
    except wdsllm.ReplicaMismatchError as exc:
        return str(exc)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("docs", "other", "rows", "raw", "tokenizer", "out"):
        ap.add_argument(f"--{name}", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    report = {}
    for name, (source, kw) in cases(args).items():
        for mode in ("read", "broadcast"):
            make = functools.partial(wdsllm.loader, source, mesh=mesh, dp="dp", replicas=mode, seed=3, **kw)
            full = digests(make())
            first = make()
            head = digests(islice(iter(first), 2))
            state = first.state_dict()
            resumed = make()
            resumed.load_state_dict(state)
            rest = digests(resumed)
            checks = resumed._replicas.agreement.checks
            report[f"{name}/{mode}"] = {"full": full, "resumed": head + rest, "checks": checks}
    report["state_mismatch"] = _saved_at_different_steps(args.docs, mesh)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
