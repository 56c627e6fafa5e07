"""Run under torchrun (4 gloo processes): wdsllm's torchtitan adapter in torchtitan's own parts.

torchtitan's ``ParallelDims`` builds the meshes; each layout's adapter is built by its config's
``build`` with the keywords torchtitan's trainer passes; its batches go through the trainer's
``batch_generator`` and ``post_dataloading_process`` (the trainer's own methods, on an object
holding what they read); its state goes through ``CheckpointManager`` (DCP).

``--phase first``: every layout runs ``--steps`` steps, saving at ``--save-at``. ``--phase
resume``: fresh processes load the step ``--save-at`` checkpoint of every layout and run to
``--steps``; and dp4 loads the dp2 x tp2 checkpoint (an elastic resume) and runs on. Every rank
writes what it saw per layout: each step's batch digest, the rows of packed data, the epoch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import titan_shims

titan_shims.install()

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

import wdsllm  # noqa: E402
import wdsllm.integrations.torchtitan as titan  # noqa: E402

SEQ = 16
#: layout -> (ParallelDims degrees, dataset, adapter options, hand the data-loading mesh over)
LAYOUTS = {
    "dp2tp2": (dict(dp_shard=2, tp=2), "rows", {}, False),
    "dp2cp2": (dict(dp_shard=2, cp=2), "docs", {}, True),
    "dp2tp2-own": (dict(dp_shard=2, tp=2), "docs", {"equal_batches": False}, False),
    "dp4": (dict(dp_shard=4), "rows", {}, False),
}


class Recorder:
    """Keeps each wdsllm batch the adapter turns into torchtitan's form (its epoch and, of packed
    data, its rows), then turns it as the adapter does."""

    def __init__(self) -> None:
        self.made, self.seen = titan.titan_batch, []
        titan.titan_batch = self

    def __call__(self, batch: dict) -> tuple:
        self.seen.append(batch)
        return self.made(batch)

    def close(self) -> None:
        titan.titan_batch = self.made


class Nothing:
    """An optimizer or scheduler with nothing to keep (the test is of the data loader's state)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def dims(degrees: dict) -> ParallelDims:
    full = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
    return ParallelDims(world_size=dist.get_world_size(), **full)


def trainer_of(parallel_dims: ParallelDims) -> SimpleNamespace:
    """What ``Trainer.batch_generator`` and ``Trainer.post_dataloading_process`` read of a trainer."""
    parallelism = SimpleNamespace(
        context_parallel_load_balancer="headtail", context_parallel_ptrr_mask_key=None, spmd_backend="partial_dtensor"
    )
    return SimpleNamespace(
        metrics_processor=SimpleNamespace(ntokens_since_last_log=0, data_loading_times=[]),
        model_config=None,
        model_parts=[],
        parallel_dims=parallel_dims,
        device=torch.device("cpu"),
        config=SimpleNamespace(parallelism=parallelism),
        ntokens_seen=0,
    )


def build(layout: str, data: str, ckpt: str) -> tuple:
    degrees, dataset, options, hand_mesh = LAYOUTS[layout]
    parallel_dims = dims(degrees)
    batch = parallel_dims.get_mesh("batch")
    config = titan.WdsllmDataLoader.Config(
        dataset_path=os.path.join(data, dataset), seed=3, shuffle_buffer=6, **options
    )
    extra = {}
    if hand_mesh:
        extra["mesh"] = parallel_dims.get_optional_mesh(list(titan.DATA_MESH_DIMS), include_singleton_axes=True)
    adapter = config.build(
        dp_world_size=batch.size(),
        dp_rank=batch.get_local_rank(),
        tokenizer=None,
        seq_len=SEQ,
        local_batch_size=2,
        snapshot_every_n_steps=None,
        **extra,
    )
    torch.manual_seed(0)
    checkpointer = CheckpointManager(
        CheckpointManager.Config(
            enable=True, folder=layout, interval=1, keep_latest_k=0, initial_load_model_only=False
        ),
        dataloader=adapter,
        model_parts=[torch.nn.Linear(2, 2)],
        optimizers=Nothing(),
        lr_schedulers=Nothing(),
        states={},
        sd_adapter=None,
        base_folder=ckpt,
    )
    return parallel_dims, adapter, checkpointer


def run(layout: str, args: argparse.Namespace, load: str | None = None) -> dict:
    """Steps of one layout: from its start, or from the --save-at checkpoint of layout ``load``."""
    parallel_dims, adapter, checkpointer = build(layout, args.data, args.ckpt)
    first = 1
    if load is not None:
        if load != layout:
            checkpointer.folder = os.path.join(args.ckpt, load)
        assert checkpointer.load(step=args.save_at)
        first = args.save_at + 1
    recorder = Recorder()
    trainer = trainer_of(parallel_dims)
    steps = Trainer.batch_generator(trainer, adapter)
    out = {"steps": {}, "dp_rank": adapter.dp_rank, "per_rank": adapter.per_rank, "peers": peers(adapter)}
    for step in range(first, args.steps + 1):
        input_dict, labels = next(steps)
        batch = recorder.seen.pop()
        record = {"digest": digest(input_dict["input"], input_dict["positions"], labels), "epoch": batch["epoch"]}
        if LAYOUTS[layout][1] == "rows":
            record["rows"] = batch["rows"].tolist()
        record.update(processed(trainer, input_dict, labels))
        out["steps"][step] = record
        if load is None and step == args.save_at:
            assert checkpointer.save(curr_step=step)
    out["tokens_counted"] = trainer.metrics_processor.ntokens_since_last_log
    checkpointer.close()
    adapter.close()
    recorder.close()
    return out


def processed(trainer: SimpleNamespace, input_dict: dict, labels: torch.Tensor) -> dict:
    """What the training step makes of the batch (CP: this rank's cut of the whole row)."""
    whole, positions = input_dict["input"].clone(), input_dict["positions"].clone()
    inputs, cut_labels, kwargs = Trainer.post_dataloading_process(trainer, dict(input_dict), labels)
    known = labels[:, :-1] != -100  # where a label is known it is the next position's token
    return {
        "shape": list(inputs.shape),
        "labels_shape": list(cut_labels.shape),
        "kwargs": sorted(kwargs),
        "whole": whole.tolist(),
        "cut": inputs.tolist(),
        "cut_positions": kwargs["positions"].tolist(),
        "next_token": bool(torch.equal(labels[:, :-1][known], whole[:, 1:][known])),
        "dtypes": [str(whole.dtype), str(labels.dtype), str(positions.dtype)],
    }


def peers(adapter: titan.WdsllmDataLoader) -> list:
    layout = adapter.loader.layout
    return [layout.replicas.size if layout.replicas else 1, adapter.loader.world_size]


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def refusals(args: argparse.Namespace) -> dict:
    """The meshes users reach for that do not say which ranks share data: refused, by name."""
    parallel_dims = dims({"dp_shard": 2, "tp": 2})
    out = {}
    for name, mesh in (("world", parallel_dims.world_mesh), ("batch", parallel_dims.get_mesh("batch"))):
        try:
            wdsllm.loader(os.path.join(args.data, "rows"), batch_size=2, mesh=mesh)
            out[name] = None
        except wdsllm.ConfigError as exc:
            out[name] = str(exc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--phase", choices=["first", "resume"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-at", type=int, required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    report = {"rank": dist.get_rank(), "layouts": {}}
    if args.phase == "first":
        report["refused"] = refusals(args)
        for layout in ("dp2tp2", "dp2cp2", "dp2tp2-own"):
            report["layouts"][layout] = run(layout, args)
    else:
        for layout in ("dp2tp2", "dp2cp2", "dp2tp2-own"):
            report["layouts"][layout] = run(layout, args, load=layout)
        report["layouts"]["dp4"] = run("dp4", args, load="dp2tp2")
    with open(os.path.join(args.out, f"{args.phase}-rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
