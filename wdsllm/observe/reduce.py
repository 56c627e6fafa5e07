"""The data wait across the data-parallel group: which rank waits most, and how much.

Opt-in (``ObserveOptions.reduce_every``): one ``all_gather`` of a few numbers per rank every N
steps. It is a collective, so every rank of the group must reach it at the same point: the loader
calls it inside the same ``next()`` (the N-th, 2N-th, ...) on every rank, which holds while the
ranks yield the same number of batches (``equal_batches``, the default with several ranks).
Without it nothing is communicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .wait import WaitSummary

#: what each rank contributes, in this order
FIELDS = ("total", "share", "p95", "max")


def _device(group: Any) -> torch.device:
    """NCCL gathers CUDA tensors; every other backend gathers CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_wait(summary: WaitSummary, group: Any = None) -> dict[str, float]:
    """Every rank's window of data wait gathered over ``group`` (None: the default group): the
    max and mean over ranks of the window's total wait and share, and the rank that waited most
    (``data_wait_slowest_rank``; the lowest such rank on a tie). A collective: call it at the
    same point on every rank."""
    mine = torch.tensor([getattr(summary, f) for f in FIELDS], dtype=torch.float64, device=_device(group))
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()
    totals, shares = table[:, 0], table[:, 1]
    slowest = int(torch.argmax(totals))
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    return {
        "data_wait_ranks": float(world),
        "data_wait_rank_max_s": float(totals.max()),
        "data_wait_rank_mean_s": float(totals.mean()),
        "data_wait_rank_max_share": float(shares.max()),
        "data_wait_rank_mean_share": float(shares.mean()),
        "data_wait_rank_max_p95_s": float(table[:, 2].max()),
        "data_wait_slowest_rank": float(ranks[slowest]),
    }
