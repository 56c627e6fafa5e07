"""Replica peers yield the same batches: each reads for itself, or one reads and broadcasts.

Two ways behind one Protocol (:class:`Replicas`):

- ``read`` (the default): every peer runs the loader itself; the plan is a function of the
  data-parallel coordinates and the settings, so peers make the same batches without talking.
- ``broadcast``: the group's rank 0 (the leader) reads and sends each batch over the replica
  group; the others read no shard bytes. A batch goes as a header (its fields' names, dtypes,
  shapes and which tensors are one tensor under two names, and the plain values) and one flat
  buffer per dtype, so variable shapes (lengths, cu_seqlens, position_ids, docs, sources) cost
  nothing extra. On gloo the buffers are CPU tensors; on NCCL they travel on this rank's device
  (receivers then yield device tensors). A failure of the leader is sent as such, so its peers
  raise :class:`~wdsllm.errors.ReplicaError` instead of waiting for a batch that never comes.

Both check agreement (``agree.Agreement``) and then cut this process's view: its context-parallel
slice (``cpsplit``), then its pipeline stage's fields (:func:`stage_view`).

Under ``read`` with middle pipeline stages, a middle stage reads nothing either: its view holds no
data, so its pipeline's first stage sends it the view and the progress over the same wire (a
header without buffers, and the batch's field digests where the agreement check is due) over the
group of the first and middle stages (``PpStage.feed``). The last stage reads for itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch

from ..errors import ReplicaError
from .agree import Agreement, collective, field_digests, peer_names
from .collate import HF_CU_SEQ_LENS, HF_MAX_LENGTH, IGNORE_INDEX
from .cpsplit import RANGES_KEY, cp_slice
from .cursor import Progress
from .layout import Layout, PpStage, ReplicaGroup

#: what a pipeline's first stage takes (the model's inputs) and its last (the loss's)
INPUT_KEYS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cu_seqlens", "max_seqlen", RANGES_KEY, *HF_CU_SEQ_LENS}
    | set(HF_MAX_LENGTH)
)
LABEL_KEYS = frozenset({"labels", "shift_labels"})
#: what the batch says of itself, kept where any data is (not on middle stages)
META_KEYS = frozenset({"lengths", "docs", "sources", "rows"})
LOSS_MASK = "loss_mask"


def stage_view(batch: dict, pp: PpStage | None) -> dict:
    """What pipeline stage ``pp`` takes of ``batch``: the first the inputs, the last the labels and
    ``loss_mask`` (the positions that count in the loss), both for one stage, a middle stage only
    the epoch (it reads nothing from the batch, but steps with the others)."""
    if pp is None:
        return batch
    keep = {"epoch"}
    if pp.first:
        keep |= INPUT_KEYS | META_KEYS
    if pp.last:
        keep |= LABEL_KEYS | META_KEYS
    out = {k: v for k, v in batch.items() if k in keep}
    if pp.last:
        labels = batch["shift_labels"] if "shift_labels" in batch else batch["labels"]
        out[LOSS_MASK] = labels != IGNORE_INDEX
    return out


class Replicas(Protocol):
    """The stage between a loader's own batches and its caller, for one layout."""

    def batches(
        self, own: Iterator[dict], progress: Callable[[], Progress], follow: Callable[[Progress, bool], None]
    ) -> Iterator[dict]:
        """This process's batches: from ``own`` (a lazy iterator, never started by a receiver),
        checked and cut to this process's view; a receiver mirrors its reader's ``progress``
        (``follow``), so that its own state is the reader's and no state is asked over the wire."""
        ...


def _device(layout: Layout) -> torch.device:
    """Where collectives over the replica group put their tensors (NCCL: this rank's GPU)."""
    if layout.replicas is None:
        return torch.device("cpu")
    import torch.distributed as dist

    if dist.get_backend(layout.replicas.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _View:
    """The checks and the cut that both ways share."""

    def __init__(self, layout: Layout, settings: dict[str, str]):
        self.layout = layout
        self.device = _device(layout)
        self.agreement = Agreement(layout, settings, self.device)

    def view(self, batch: dict) -> dict:
        if self.layout.cp is not None:
            batch = cp_slice(batch, self.layout.cp)
        return stage_view(batch, self.layout.pp)

    def checked(self, step: int, batch: dict, fields: dict[str, str] | None = None) -> dict:
        """The batch checked where due (``fields``: its digests, where made already) and cut."""
        if self.agreement.due(step):
            self.check_fields(step, batch, fields or field_digests(batch))
        return self.view(batch)

    def check_fields(self, step: int, batch: dict, fields: dict[str, str]) -> None:
        self.agreement.check_fields(fields, f"epoch {batch.get('epoch')}, batch {step} of this pass")


class ReadReplicas(_View):
    """Every peer reads (but middle pipeline stages, which follow their first stage); the first
    batch of a pass (and every N-th if asked) is compared."""

    def __init__(self, layout: Layout, settings: dict[str, str]):
        super().__init__(layout, settings)
        pp = layout.pp
        #: the first stage's wire to its middle stages (None: this process has no part in one)
        self.feed = Wire(pp.feed, self.device) if pp is not None and pp.feed is not None else None
        self.middle = PpStage(1, pp.stages) if pp is not None else None  # what a middle stage takes
        if self.feed is not None:
            self.feed.suspects = lambda: _feed_peers(layout)

    def batches(
        self, own: Iterator[dict], progress: Callable[[], Progress], follow: Callable[[Progress, bool], None]
    ) -> Iterator[dict]:
        if self.feed is None:
            return (self.checked(step, batch) for step, batch in enumerate(own))
        if self.layout.pp.first:
            return self._feed(own, progress)
        return self._follow(follow)

    def _feed(self, own: Iterator[dict], progress: Callable[[], Progress]) -> Iterator[dict]:
        """The first stage: reads, and sends each step's middle view (and digests where due)."""
        for step, batch, fields in _lead(own, progress, self.feed, self._middle_message, self.layout.where()):
            yield self.checked(step, batch, fields)

    def _middle_message(self, step: int, batch: dict) -> tuple[dict, dict[str, str] | None]:
        return stage_view(batch, self.middle), field_digests(batch) if self.agreement.due(step) else None

    def _follow(self, follow: Callable[[Progress, bool], None]) -> Iterator[dict]:
        """A middle stage: its view and its first stage's progress, checked with the digests sent."""
        for step, view, digests in _received(self.feed, follow):
            if digests is not None:
                self.check_fields(step, view, digests)
            yield view


def _feed_peers(layout: Layout) -> str:
    """Who a pipeline's first stage and middle stages wait on: the first stage (the reader)."""
    feed = layout.pp.feed
    roster = layout.roster
    return f"its first stage {roster.where(feed.leader) if roster is not None else feed.leader}"


# -- the wire: a batch as a header and one buffer per dtype --------------------------------------


def _header(batch: dict, progress: Progress, digests: dict | None) -> tuple[dict, list[torch.Tensor]]:
    fields, tensors, names = [], [], {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            if id(value) in names:  # one tensor under two names stays one tensor
                fields.append((key, "alias", names[id(value)]))
                continue
            names[id(value)] = key
            fields.append((key, "tensor", (str(value.dtype).removeprefix("torch."), tuple(value.shape))))
            tensors.append(value)
        else:
            fields.append((key, "value", value))
    return {"kind": "batch", "fields": fields, "progress": progress, "digests": digests}, tensors


def _by_dtype(dtypes: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        out.setdefault(dtype, []).append(i)
    return out


class Received(NamedTuple):
    """What a peer receives: the batch (None at the end of the leader's pass), the leader's
    progress, and the batch's field digests where the leader sent them."""

    batch: dict | None
    progress: Progress
    digests: dict[str, str] | None


class Wire:
    """Batches from a group's leader to its peers (``torch.distributed`` collectives): a replica
    group's, or a pipeline's first stage's to its middle stages."""

    def __init__(self, peers: ReplicaGroup, device: torch.device, suspects: Callable[[], str] | None = None):
        self.group = peers.group
        self.leader = peers.leader
        self.device = device
        self.is_leader = peers.is_leader
        #: who this end waits on, for the error when a peer is gone
        self.suspects = suspects or (lambda: "the peers of this group")

    def _collective(self) -> Any:
        what = "sending batches to the replica peers" if self.is_leader else "receiving the reader's batches"
        return collective(what, self.suspects)

    def share(self, message: Any) -> Any:
        """``message`` (any picklable value) from the leader, on every peer."""
        import torch.distributed as dist

        box = [message]
        with self._collective():
            dist.broadcast_object_list(box, src=self.leader, group=self.group, device=self.device)
        return box[0]

    def send(self, batch: dict, progress: Progress, digests: dict[str, str] | None = None) -> None:
        import torch.distributed as dist

        header, tensors = _header(batch, progress, digests)
        self.share(header)
        for indices in _by_dtype([str(t.dtype) for t in tensors]).values():
            flat = torch.cat([tensors[i].reshape(-1) for i in indices]).to(self.device)
            with self._collective():
                dist.broadcast(flat, src=self.leader, group=self.group)

    def send_end(self, progress: Progress) -> None:
        self.share({"kind": "end", "progress": progress})

    def send_error(self, exc: BaseException, where: str) -> None:
        self.share({"kind": "error", "message": f"{type(exc).__name__}: {exc}", "where": where})

    def receive(self) -> Received:
        """The next batch (None at the end of the leader's pass), the leader's progress, digests."""
        import torch.distributed as dist

        header = self.share(None)
        if header["kind"] == "error":
            raise ReplicaError(f"the reader of this replica group ({header['where']}) failed: {header['message']}")
        if header["kind"] == "end":
            return Received(None, header["progress"], None)
        specs = [(k, info) for k, how, info in header["fields"] if how == "tensor"]
        received: dict[str, torch.Tensor] = {}
        for indices in _by_dtype([dtype for _, (dtype, _) in specs]).values():
            dtype = getattr(torch, specs[indices[0]][1][0])
            sizes = [_numel(specs[i][1][1]) for i in indices]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            with self._collective():
                dist.broadcast(flat, src=self.leader, group=self.group)
            for i, part in zip(indices, flat.split(sizes), strict=True):
                key, (_, shape) = specs[i]
                received[key] = part.view(shape)
        batch: dict[str, Any] = {}
        for key, how, info in header["fields"]:
            batch[key] = received[key] if how == "tensor" else received[info] if how == "alias" else info
        return Received(batch, header["progress"], header["digests"])


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


#: what a leader sends of a batch at a step: the batch to send, and its field digests or None
Message = Callable[[int, dict], tuple[dict, "dict[str, str] | None"]]


def _lead(
    own: Iterator[dict], progress: Callable[[], Progress], wire: Wire, message: Message, where: str
) -> Iterator[tuple[int, dict, Any]]:
    """The leader's steps: each batch read is sent (as ``message`` makes it, with the digests it
    made) before it is yielded;
    the end of the pass, or the reader's failure, is sent too, so no peer waits for a batch that
    never comes."""
    step = 0
    while True:
        try:
            batch = next(own, None)
        except Exception as exc:  # the peers hear of it instead of waiting for a batch
            wire.send_error(exc, where)
            raise
        if batch is None:
            wire.send_end(progress())
            return
        sent, digests = message(step, batch)
        wire.send(sent, progress(), digests)
        yield step, batch, digests
        step += 1


def _received(wire: Wire, follow: Callable[[Progress, bool], None]) -> Iterator[tuple[int, dict, Any]]:
    """A peer's steps: each batch received, its leader's progress mirrored first (``follow``)."""
    step = 0
    while True:
        batch, progress, digests = wire.receive()
        follow(progress, batch is None)
        if batch is None:
            return
        yield step, batch, digests
        step += 1


def _whole(step: int, batch: dict) -> tuple[dict, None]:
    return batch, None


class BroadcastReplicas(_View):
    """The leader reads and sends; its peers receive (and read no shard bytes)."""

    def __init__(self, layout: Layout, settings: dict[str, str]):
        super().__init__(layout, settings)
        self.wire = Wire(layout.replicas, self.device, lambda: _wire_peers(layout))

    def batches(
        self, own: Iterator[dict], progress: Callable[[], Progress], follow: Callable[[Progress, bool], None]
    ) -> Iterator[dict]:
        if self.layout.replicas.is_leader:
            return self._lead(own, progress)
        return self._receive(follow)

    def _lead(self, own: Iterator[dict], progress: Callable[[], Progress]) -> Iterator[dict]:
        for step, batch, _ in _lead(own, progress, self.wire, _whole, self.layout.where()):
            yield self.checked(step, batch)

    def _receive(self, follow: Callable[[Progress, bool], None]) -> Iterator[dict]:
        for step, batch, _ in _received(self.wire, follow):
            yield self.checked(step, batch)


def _wire_peers(layout: Layout) -> str:
    """Who a broadcast's end waits on: the receivers its reader sends to, or a receiver's reader."""
    if layout.replicas.is_leader:
        return f"its receivers {peer_names(layout)}"
    roster = layout.roster
    return f"its reader {roster.where(layout.replicas.leader) if roster is not None else layout.replicas.leader}"


def replicas_for(layout: Layout, settings: dict[str, str]) -> Replicas:
    """The way ``layout`` asks for (``broadcast`` only where there are peers to send to)."""
    return BroadcastReplicas(layout, settings) if layout.broadcasts else ReadReplicas(layout, settings)


__all__ = [
    "INPUT_KEYS",
    "LABEL_KEYS",
    "BroadcastReplicas",
    "ReadReplicas",
    "Received",
    "Replicas",
    "Wire",
    "replicas_for",
    "stage_view",
]
