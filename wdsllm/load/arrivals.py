"""Which replica peers reached a collective, so that a peer that is gone is named exactly.

Before each batch check (``agree.Agreement``: the first batch of a pass and every ``agree_every``
steps, where a collective runs anyway) a peer counts its arrival in the default process group's
store (one ``add`` on its own key: no wait, no extra collective). When the collective fails, the
survivors read every peer's count: a peer whose count is behind theirs never reached the
collective, and is the one named. A live peer that is slower to arrive gets a short grace before
it is counted absent. Where the store cannot be reached (a process group built without one), the
message names the group's other peers, as before.
"""

from __future__ import annotations

import time
from typing import Any

#: how long survivors wait for a slower live peer to arrive before naming it absent
ARRIVAL_GRACE_S = 3.0
_POLL_S = 0.05


def default_store() -> Any | None:
    """The default process group's key-value store (None where torch keeps none)."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # torch without it, or no default group
        return None


class Arrivals:
    """Arrival counts of one group's peers (``members``: their global ranks) for this peer."""

    def __init__(self, members: list[int], me: int) -> None:
        self.members = members
        self.me = me
        self.store = default_store() if len(members) > 1 else None
        self._prefix = "wdsllm/arrived/" + "-".join(map(str, members)) + "/"
        self._count = 0  # this peer's count after its latest arrival

    def arrive(self) -> None:
        """Count this peer's arrival at the next collective (before it runs)."""
        if self.store is not None:
            self._count = int(self.store.add(self._prefix + str(self.me), 1))

    def absent(self) -> list[int] | None:
        """The peers that did not reach this peer's latest collective, after the grace (None: not
        known, without a store); read only once that collective failed."""
        if self.store is None:
            return None
        deadline = time.monotonic() + ARRIVAL_GRACE_S
        while True:
            try:
                behind = [g for g in self.members if g != self.me and self._reached(g) < self._count]
            except RuntimeError:  # the store itself is gone (its host was the dead peer)
                return None
            if not behind or time.monotonic() >= deadline:
                return behind
            time.sleep(_POLL_S)

    def _reached(self, peer: int) -> int:
        return int(self.store.add(self._prefix + str(peer), 0))  # adding 0 reads without waiting


__all__ = ["ARRIVAL_GRACE_S", "Arrivals", "default_store"]
