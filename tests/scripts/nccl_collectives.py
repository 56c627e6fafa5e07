"""Run under torchrun --nproc_per_node 1: every collective the loader makes, over a process group of
world size 1 (NCCL on the GPU, or ``--backend gloo`` on CPU), under a 1-D and a 2-D DeviceMesh of
that device. Writes a report of what each step saw (``--out``/report.json).

One GPU cannot hold two NCCL ranks, so a group of one plays both ends: its leader's sends are the
real broadcasts, and ``Loopback`` hands the header a send broadcast to the receive that follows
(through the group's broadcast again), so a receiver's decoding runs on the same device. Tensor
values a receiver gets from a group of one are its own uninitialised buffers: shapes, dtypes,
devices, aliases and plain values are what is compared (the values travel in the 2- and 3-rank
gloo tests).

- the loader over the mesh (``agree_every=1``, ``reduce_every=1``, ``replicas="broadcast"`` on
  the 2-D mesh): its batches stay on the CPU (pinned with ``pin_memory=True`` on CUDA);
- the agreement check (``agree.Agreement``): the digest all-gathered on the group's device;
- broadcast replicas (``replicas.Wire``): batches with variable-length fields (cu_seqlens,
  position_ids, lengths, docs) sent and received, one buffer per dtype on the device;
- the pipeline feed (``ReadReplicas`` of a first stage and of a middle stage): the middle view
  and the digests sent, the middle stage's check over the group;
- the wait reduction (``observe.reduce.reduce_wait``) over the default group and the mesh's.
"""

import argparse
import json
import os
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import wdsllm
from wdsllm.load import replicas as replicasmod
from wdsllm.load.agree import Agreement, field_digests
from wdsllm.load.layout import PpStage, ReplicaGroup, resolve_layout
from wdsllm.load.options import LayoutOptions
from wdsllm.observe.reduce import _device as reduce_device
from wdsllm.observe.reduce import reduce_wait
from wdsllm.observe.wait import WaitSummary

MESHES = {"1d": ((1,), ("dp",)), "2d": ((1, 1), ("dp", "tp"))}
OPTIONS = dict(batching="pack", seq_len=24, batch_size=3, boundaries=True, seed=3, shuffle_buffer=16)


class Loopback(replicasmod.Wire):
    """A group of one as its own receiver: a receive gets the header the last send broadcast."""

    last = None

    def share(self, message):
        out = super().share(self.last if message is None else message)
        if message is not None:
            self.last = message
        return out


def tensors(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


def devices(batches: list[dict]) -> list[str]:
    return sorted({str(v.device) for b in batches for v in tensors(b).values()})


def loader_run(mesh, names, data: str, pin: bool) -> dict:
    """An epoch of the loader over the mesh, with every check and the reduction each step."""
    extra = {"replicas": "broadcast"} if len(names) > 1 else {}
    loader = wdsllm.loader(data, mesh=mesh, dp="dp", agree_every=1, reduce_every=1, pin_memory=pin, **extra, **OPTIONS)
    batches = list(loader)
    out = {
        "batches": len(batches),
        "devices": devices(batches),
        "pinned": all(v.is_pinned() for b in batches for v in tensors(b).values()) if pin else None,
        "data_wait_ranks": loader.metrics().get("data_wait_ranks"),
        "cu_seqlens_lengths": sorted({len(b["cu_seqlens"]) for b in batches}),
    }
    loader.close()
    return out, batches


def wire_round_trips(peers: ReplicaGroup, device, batches: list[dict]) -> dict:
    """Each batch sent over the group and received back (through ``Loopback``)."""
    wire = Loopback(peers, device)
    checks = []
    for step, batch in enumerate(batches):
        batch = dict(batch, shift_labels=batch["labels"])  # one tensor under two names
        wire.send(batch, (0, step + 1, None))
        got = wire.receive()
        same = list(got.batch) == list(batch) and got.progress == (0, step + 1, None)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                mine = got.batch[key]
                same &= mine.shape == value.shape and mine.dtype == value.dtype and mine.device == device
            else:
                same &= got.batch[key] == value
        same &= got.batch["shift_labels"] is got.batch["labels"]
        checks.append(bool(same))
    wire.send_end((0, len(batches), 0))
    end = wire.receive()
    return {"wire_device": str(wire.device), "round_trips": checks, "end": end.batch is None and end.progress[2] == 0}


def pipeline_feed(layout, peers: ReplicaGroup, device, batches: list[dict]) -> dict:
    """A first stage feeding its middle stages (its pipeline's feed group), then a middle stage
    following what it sent, with the digests a first stage sends where the check is due."""
    first = replicasmod.ReadReplicas(replace(layout, replicas=peers, pp=PpStage(0, 3, peers)), {"seed": "3"})
    built_device = first.feed.device
    first.feed = Loopback(peers, device)
    fed = first.batches(iter(batches), lambda: (0, 1, None), lambda *_: None)
    kept = [next(fed)]
    header = dict(first.feed.last, digests=field_digests(batches[0]))  # batch 0's middle view, as sent
    kept += list(fed)
    middle = replicasmod.ReadReplicas(replace(layout, replicas=peers, pp=PpStage(1, 3, peers)), {"seed": "3"})
    middle.feed = Loopback(peers, device)
    middle.feed.last = header
    followed = []
    views = middle.batches(iter(()), lambda: (0, 0, None), lambda progress, ended: followed.append(list(progress)))
    view = next(views)
    return {
        "feed_device": str(built_device),
        "first_stage_devices": devices(kept),
        "first_stage_batches": len(kept),
        "middle_view": sorted(view),
        "middle_checks": middle.agreement.checks,
        "followed": followed,
    }


def run_mesh(name: str, data: str, device) -> dict:
    shape, names = MESHES[name]
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    out, batches = loader_run(mesh, names, data, pin=device.type == "cuda")
    layout = resolve_layout(LayoutOptions(mesh=mesh, dp="dp"))
    group = mesh.get_group(names[-1])
    peers = ReplicaGroup(group, group.rank(), group.size(), dist.get_global_rank(group, 0))
    out["layout_replicas"] = None if layout.replicas is None else layout.replicas.size
    agreement = Agreement(
        replace(layout, replicas=peers), {"seed": "3"}, replicasmod._device(replace(layout, replicas=peers))
    )
    for batch in batches:
        agreement.check(batch, "the check")
    out["agreement"] = {"device": str(agreement.device), "checks": agreement.checks}
    out["batch_devices_after_checks"] = devices(batches)
    out.update(wire_round_trips(peers, agreement.device, batches))
    out.update(pipeline_feed(layout, peers, agreement.device, batches))
    summary = WaitSummary(steps=4, last=0.01, total=0.5, share=0.25, p50=0.01, p95=0.01, max=0.02)
    reduced = [reduce_wait(summary, g) for g in (None, mesh.get_group("dp"))]
    out["reduce_device"] = str(reduce_device(mesh.get_group("dp")))
    out["reduced"] = [
        {k: r[k] for k in ("data_wait_ranks", "data_wait_rank_max_share", "data_wait_slowest_rank")} for r in reduced
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    args = ap.parse_args()
    if args.backend == "nccl":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    report = {"backend": dist.get_backend(), "world": dist.get_world_size(), "device": str(device)}
    for name in MESHES:
        report[name] = run_mesh(name, args.data, device)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
