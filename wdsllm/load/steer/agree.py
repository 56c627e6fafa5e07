"""Every rank takes the same change at the same planned step, or none does.

A change made while the run trains (``skip``, ``exclude``, ``set_weights``) is a collective: every
process of the job calls it with the same arguments at the same planned step. The call gathers
each process's (planned step, change) over the default process group before anything changes;
where any differs, every process raises ``SteeringError`` naming the first two that differ, so a
change made on some ranks only can never split the run silently.
"""

from __future__ import annotations

import json
from typing import Any

from ...errors import SteeringError


def agree_on_change(what: str, planned: int, change: Any) -> None:
    """Gather ``(planned, change)`` over every process (none without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    mine = json.dumps([planned, change], sort_keys=True, default=str)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for rank, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            raise SteeringError(
                f"{what} was called differently on the ranks: rank 0 gave {gathered[0]}, rank {rank} gave {theirs} "
                "([planned step, arguments]); every process calls it with the same arguments at the same step "
                "(docs/steering.md), and nothing was changed"
            )


__all__ = ["agree_on_change"]
