"""A check that replica peers agree: a 64-bit digest of the batch, all-gathered over the group.

Peers that must yield the same batches (tensor, context and pipeline parallel peers of one
data-parallel rank) compare a digest of (the settings that decide the batches, the batch's
fields) on the first batch of every pass (an epoch, a resume) and every N steps if asked. The
common case costs one hash of the batch and one all-gather of one int64. Only when digests
differ do the peers exchange their per-field digests and settings, so that the error names each
peer's mesh coordinates and the first field that differs. Every peer takes part in the same
collectives at the same steps, and every peer raises, so a disagreement never leaves one peer
waiting on another: peers built with another seed, batching or source fail at the first batch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ReplicaMismatchError
from .layout import Layout


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


def settings_of(layout: Layout, config: dict[str, Any], identity: dict[str, str]) -> dict[str, str]:
    """The settings replica peers must share, as strings: the batch settings, the dataset and the
    data-parallel coordinates (peers of one group split no data between them)."""
    out = {k: repr(v) for k, v in sorted(config.items())}
    out.update(identity)
    out["dp_rank"], out["dp_size"] = str(layout.dp_rank), str(layout.dp_size)
    return out


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


class Agreement:
    """The check of one loader: its layout's group, its settings, and when to check."""

    def __init__(self, layout: Layout, settings: dict[str, str], device: torch.device | None = None):
        self.layout = layout
        self.settings = settings
        self.device = device or torch.device("cpu")
        self.checks = 0  # checks made (tests, the benchmark)

    @property
    def active(self) -> bool:
        return self.layout.replicas is not None and self.layout.replicas.size > 1

    def due(self, step: int) -> bool:
        """Whether the batch at ``step`` of a pass is checked: the first, and every N-th if asked."""
        every = self.layout.agree_every
        return self.active and (step == 0 or (every is not None and step % every == 0))

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
        dist.all_gather(gathered, mine, group=group)
        self.checks += 1
        if len({int(t.item()) for t in gathered}) == 1:
            return
        peers: list[Any] = [None] * self.layout.replicas.size
        dist.all_gather_object(peers, Facts(self.layout.where(), self.settings, fields), group=group)
        raise ReplicaMismatchError(
            f"replica peers yield different {what} ({where}): the first difference is {_first_difference(peers)}; "
            f"peers: {', '.join(p.where for p in peers)}. Replica peers (tensor, context, pipeline parallel) must be "
            "built with the same source and settings (docs/parallel.md)"
        )

    def check_state(self, sealed: dict[str, str]) -> None:
        """The saved states of replica peers are identical (one state per data-parallel
        coordinate): the state's fields take the batch fields' place in the check."""
        try:
            fields = json.loads(sealed["state"])
        except (KeyError, TypeError, ValueError):
            fields = dict(sealed)
        fields.pop("digest", None)  # the seal of the other fields, which name the difference
        self.check({k: fields[k] for k in sorted(fields)}, "at state_dict()", "states")


__all__ = ["Agreement", "digest_of", "field_digests", "settings_of"]
