"""That replica peers agree: once on their description at construction, then on their batches.

At construction, before the loader's first collective (``agree_on_layout``): every rank of the
layout sends one row of integers (``seats.row_of``: the digests of its description, ``describe.py``,
and the groups it is in) in one all-gather; every rank reaches the same verdict from the table, so
a rank built with another worker count, ``agree_every``, ``replicas`` mode, ``cp_split``, dims
named in another order, or groups that do not fit together fails at once on every rank, never
with a hang or silently other batches. Only then are the descriptions themselves exchanged, to
name the setting that differs and the coordinates of the ranks on each side.

Then on batches (``Agreement``): peers that must yield the same batches (tensor, context and
pipeline parallel peers of one data-parallel rank) compare a digest of (their settings, the
batch's fields) on the first batch of every pass (an epoch, a resume) and every N steps if
asked. The common case costs one hash of the batch and one all-gather of one int64. Only when
digests differ do the peers exchange their per-field digests and settings, so that the error
names each peer's mesh coordinates and the first field that differs. Every peer takes part in
the same collectives at the same steps, and every peer raises, so a disagreement never leaves
one peer waiting on another.

A collective that fails because a peer is gone (its process died: gloo reports a closed
connection, NCCL a timeout) is a ``ReplicaError``, not the backend's error alone. A batch check
names exactly the peers that never reached it (``arrivals``: each peer counts its arrival in the
default group's store first); elsewhere, or where the store is gone with the dead peer, the error
names the peers it waited on (``collective``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, ReplicaError, ReplicaMismatchError, WdsllmError
from .arrivals import Arrivals
from .describe import Description, first_difference
from .layout import Layout, Seat
from .options import AGREE_ALL, AGREE_PEERS
from .seats import DP_RANK, REFUSED, Roster, disagree, problems, row_of


def _tensor_digest(value: torch.Tensor) -> bytes:
    array = value.detach().cpu().contiguous().numpy()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{array.dtype}{array.shape}".encode())
    h.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return h.digest()


def field_digests(batch: dict) -> dict[str, str]:
    """Each field's digest (hex), in the batch's order; a tensor that another key already holds
    (Hugging Face's names of cu_seqlens, labels sharing input_ids) is named, not hashed again."""
    seen: dict[int, str] = {}
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                out[key] = "=" + seen[id(value)]
                continue
            seen[id(value)] = key
            out[key] = _tensor_digest(value).hex()
        else:
            out[key] = hashlib.blake2b(repr(value).encode(), digest_size=8).hexdigest()
    return out


@dataclass(frozen=True)
class Facts:
    """What a peer tells the others when digests differ: where it sits, its settings, its fields."""

    where: str
    settings: dict[str, str]
    fields: dict[str, str]


def digest_of(settings: dict[str, str], fields: dict[str, str]) -> int:
    """The 64-bit digest all-gathered: settings and fields together, as a signed int64."""
    text = json.dumps([sorted(settings.items()), list(fields.items())]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def _first_difference(peers: list[Facts]) -> str:
    base = peers[0]
    for other in peers[1:]:
        for key in sorted(set(base.settings) | set(other.settings)):
            a, b = base.settings.get(key), other.settings.get(key)
            if a != b:
                return f"setting {key!r}: {a} at {base.where}, {b} at {other.where}"
    for other in peers[1:]:
        for key in [*base.fields, *(k for k in other.fields if k not in base.fields)]:
            if base.fields.get(key) != other.fields.get(key):
                a, b = base.fields.get(key), other.fields.get(key)
                return f"field {key!r} (digest {a} at {base.where}, {b} at {other.where})"
    return "no field (the digests differ in what they cover)"


@contextmanager
def collective(what: str, suspects: Callable[[], str]) -> Iterator[None]:
    """Around a collective over peers: the backend's error, when a peer is gone or broke the
    collective, as a ``ReplicaError`` naming ``what`` was done and the peers it waited on."""
    try:
        yield
    except WdsllmError:
        raise
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError, ...) are RuntimeErrors
        raise ReplicaError(
            f"{what} failed: a peer is gone or broke off ({suspects()}); the backend said: {exc}"
        ) from exc


def peer_names(layout: Layout, role: str = "replica") -> str:
    """The coordinates of this process's peers in its group of ``role``, for messages."""
    import torch.distributed as dist

    roster = layout.roster
    if roster is None:
        return f"the peers of {layout.where()}"
    me = dist.get_rank()
    return "; ".join(roster.where(g) for g in roster.peers(role, me) if g != me) or "none"


def _absent_peers(layout: Layout, arrivals: Arrivals | None) -> str:
    """The peers that never reached the failed check, by their coordinates (else the group's)."""
    absent = arrivals.absent() if arrivals is not None else None
    if not absent:
        return peer_names(layout)
    return "did not reach it: " + "; ".join(layout.roster.where(g) for g in absent)


def _device_of(group: Any) -> torch.device:
    """Where collectives over ``group`` put their tensors (NCCL: this rank's GPU)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_layout(description: Description, seat: Seat, group: Any = None) -> Roster:
    """Compare every rank's seat and description over ``group`` (None: the world) in one
    all-gather, before any other collective of the loader; raise the same error on every rank
    where a rank refused its layout (``ConfigError``), the descriptions differ
    (``ReplicaMismatchError``: the setting, and the coordinates on each side) or the groups do not
    fit together (``ConfigError``). The roster names each rank by its coordinates."""
    import torch.distributed as dist

    description = description.with_facts(seat.facts)
    mine = torch.tensor(row_of(seat, description, dist.get_rank()), dtype=torch.int64, device=_device_of(group))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with collective("comparing the layout's settings at construction", lambda: "the ranks of the layout"):
        dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu().numpy()
    roster = Roster(table, seat.mesh)
    refused = bool(table[:, REFUSED].any())
    if refused or any(disagree(table)):
        _raise_difference(description, seat, group, roster, refused)
    found = problems(roster)
    if found:
        raise ConfigError(f"the layout's groups do not fit together: {'; '.join(found)} (docs/parallel.md)")
    return roster


def _raise_difference(description: Description, seat: Seat, group: Any, roster: Roster, refused: bool) -> None:
    """Exchange what each rank said (only now: the common case sends the digests alone) and
    raise, naming the first difference and where each side is."""
    import torch.distributed as dist

    me = dist.get_rank()
    told: list[Any] = [None] * dist.get_world_size(group)
    with collective("naming what differs between the ranks", lambda: "the ranks of the layout"):
        dist.all_gather_object(told, (roster.where(me), description, seat.problem), group=group)
    if refused:
        said = "; ".join(f"{where}: {problem}" for where, _, problem in told if problem is not None)
        raise ConfigError(f"a rank refused its layout, so every rank stops: {said}")
    found = first_difference([(w, d) for w, d, _ in told], AGREE_ALL)
    if found is not None:
        raise ReplicaMismatchError(
            f"the ranks of this layout differ in setting {found[0]!r}: {found[1]}. Every rank (data-parallel ranks "
            "and their replica peers) must be built with the same settings (docs/parallel.md)"
        )
    by_dp: dict[int, list[tuple[str, Description]]] = {}
    for row, (where, d, _) in zip(roster.table, told, strict=True):
        by_dp.setdefault(int(row[DP_RANK]), []).append((where, d))
    for dp_rank, peers in sorted(by_dp.items()):
        found = first_difference(peers, AGREE_PEERS)
        if found is not None:
            raise ReplicaMismatchError(
                f"replica peers of data-parallel coordinate {dp_rank} differ in setting {found[0]!r}: {found[1]}. "
                "Replica peers (tensor, context, pipeline parallel) must be built with the same source and settings "
                "(docs/parallel.md)"
            )
    raise ReplicaMismatchError("the ranks' descriptions differ in what their digests cover")  # not reached


class Agreement:
    """The check of one loader: its layout's group, its settings, and when to check."""

    def __init__(self, layout: Layout, settings: dict[str, str], device: torch.device | None = None):
        self.layout = layout
        self.settings = settings
        self.device = device or torch.device("cpu")
        self.checks = 0  # checks made (tests, the benchmark)
        self._arrivals: Arrivals | None = None  # made at the first check, where the roster is known

    @property
    def active(self) -> bool:
        return self.layout.replicas is not None and self.layout.replicas.size > 1

    def due(self, step: int) -> bool:
        """Whether the batch at ``step`` of a pass is checked: the first, and every N-th if asked."""
        every = self.layout.agree_every
        return self.active and (step == 0 or (every is not None and step % every == 0))

    def _arrivals_of_peers(self) -> Arrivals | None:
        import torch.distributed as dist

        roster = self.layout.roster
        if self._arrivals is None and roster is not None:
            me = dist.get_rank()
            self._arrivals = Arrivals(roster.peers("replica", me), me)
        return self._arrivals

    def check(self, batch: dict, where: str, what: str = "batches") -> None:
        """All-gather the batch's digest over the replica group; differing peers all raise."""
        self.check_fields(field_digests(batch), where, what)

    def check_fields(self, fields: dict[str, str], where: str, what: str = "batches") -> None:
        """:meth:`check` with the batch's field digests made already (by this peer, or by the
        first pipeline stage for a middle stage, which holds no batch)."""
        import torch.distributed as dist

        mine = torch.tensor([digest_of(self.settings, fields)], dtype=torch.int64, device=self.device)
        group = self.layout.replicas.group
        gathered = [torch.empty_like(mine) for _ in range(self.layout.replicas.size)]
        arrivals = self._arrivals_of_peers()
        suspects = lambda: _absent_peers(self.layout, arrivals)  # noqa: E731 - asked only when it failed
        with collective(f"comparing {what} with the replica peers ({where})", suspects):
            if arrivals is not None:
                arrivals.arrive()
            dist.all_gather(gathered, mine, group=group)
        self.checks += 1
        if len({int(t.item()) for t in gathered}) == 1:
            return
        peers: list[Any] = [None] * self.layout.replicas.size
        with collective(f"naming what differs between the replica peers ({where})", suspects):
            dist.all_gather_object(peers, Facts(self.layout.where(), self.settings, fields), group=group)
        raise ReplicaMismatchError(
            f"replica peers yield different {what} ({where}): the first difference is {_first_difference(peers)}; "
            f"peers: {', '.join(p.where for p in peers)}. Replica peers (tensor, context, pipeline parallel) must be "
            "built with the same source and settings (docs/parallel.md)"
        )


__all__ = ["Agreement", "agree_on_layout", "collective", "digest_of", "field_digests", "peer_names"]
