"""Where a process sits in a parallel layout: its data-parallel coordinates, its replica peers,
its context-parallel slice and its pipeline stage.

Only the data-parallel (DP) coordinates split the data. Every other dim of a DeviceMesh (tensor,
context, pipeline parallel) is a replica dim: the peers that share a DP coordinate yield the same
batches, and a context-parallel (CP) slice or a pipeline stage's view is cut from that batch
afterwards, never planned separately. The layout comes from one of three places, never mixed:

- ``mesh=`` with ``dp=`` (the DP dim names, flattened row-major into one DP rank), ``cp=`` and
  ``pp=`` naming dims of it;
- ``dp_group=`` with ``replica_group=`` (and ``cp_group=``/``pp_group=``), Megatron style;
- ``rank=``/``world_size=`` by hand, or nothing: the rank of torch.distributed, which is only
  right where every rank is a DP rank, so a current mesh with other dims is refused.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ConfigError
from .config import resolve_world
from .options import AGREE_ALL, AGREE_PEERS, LayoutOptions

log = logging.getLogger(__name__)


class ProcessGroupLike(Protocol):
    """What the layout asks of a ``torch.distributed`` process group (``ProcessGroup`` has it)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...


@dataclass(frozen=True)
class ReplicaGroup:
    """The peers that must yield the same batches: their group, this process's place in it, and
    the global rank of the peer that reads for them under ``replicas="broadcast"``."""

    group: Any
    rank: int
    size: int
    leader: int  # the global rank of the group's rank 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class CpSlice:
    """This process's context-parallel rank among ``size`` peers, and how rows are cut."""

    rank: int
    size: int
    split: str

    @property
    def chunks(self) -> int:
        """Equal chunks a row is cut into: 2 x CP for zigzag (each rank takes 2), CP for contiguous."""
        return 2 * self.size if self.split == "zigzag" else self.size


@dataclass(frozen=True)
class PpStage:
    """This process's pipeline stage among ``stages``, and under ``replicas="read"`` with middle
    stages, ``feed``: the group of its pipeline's first stage (the leader) and middle stages, over
    which the first stage tells the middle ones its progress, so that they read nothing (None on
    the last stage, and where there is no middle stage)."""

    stage: int
    stages: int
    feed: ReplicaGroup | None = None

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def follows(self) -> bool:
        """Whether this is a middle stage that follows its first stage instead of reading."""
        return self.feed is not None and not self.first


@dataclass(frozen=True)
class Layout:
    """The resolved layout: the DP coordinates that split the data, and what the replica dims ask."""

    dp_rank: int
    dp_size: int
    explicit: bool  # given (mesh, groups, rank=): never looked up again
    coords: tuple[tuple[str, int], ...] = ()  # every mesh dim's coordinate, for messages
    replicas: ReplicaGroup | None = None  # None: no peer must match this process
    cp: CpSlice | None = None
    pp: PpStage | None = None
    mode: str = "read"
    agree_every: int | None = None
    #: the process group of the data-parallel ranks where the world holds other ranks too (None:
    #: the default group is the data-parallel one): what a reduction across DP ranks runs over
    dp_group: Any = None
    #: every rank's seat as compared at construction (``seats.Roster``: names a peer by its
    #: coordinates), or None where nothing was compared
    roster: Any = None

    def where(self) -> str:
        """This process's coordinates, as messages name them."""
        if self.coords:
            return " ".join(f"{name}={index}" for name, index in self.coords)
        return f"dp={self.dp_rank}"

    @property
    def alone(self) -> bool:
        """Whether nothing but the data-parallel split applies (no peers, no slice, no stage)."""
        return self.replicas is None and self.cp is None and self.pp is None

    @property
    def broadcasts(self) -> bool:
        return self.mode == "broadcast" and self.replicas is not None and self.replicas.size > 1

    @property
    def reads(self) -> bool:
        """Whether this process reads shards itself (every process but a broadcast's receivers and
        the middle pipeline stages that follow their first stage)."""
        if self.pp is not None and self.pp.follows:
            return False
        return not self.broadcasts or self.replicas.is_leader


def _dist() -> Any:
    """torch.distributed where torch is imported and a process group is up, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def _dp_dims(mesh: Any, dp: str | tuple[str, ...] | None) -> tuple[str, ...]:
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise ConfigError("the DeviceMesh has no dim names: build it with mesh_dim_names=(...) and name the dp dims")
    if dp is None:
        if len(names) > 1:
            raise ConfigError(
                f"the mesh has dims {names}: say which split the data (dp='batch' on torchtitan's data-loading mesh, "
                "dp=('dp_replicate', 'dp_shard') or dp='dp'); the others are replica dims whose peers get the same "
                "batches"
            )
        return names
    dims = (dp,) if isinstance(dp, str) else tuple(dp)
    unknown = [d for d in dims if d not in names]
    if unknown or not dims:
        raise ConfigError(f"dp={dp!r} names no dim of the mesh, whose dims are {names}")
    if len(set(dims)) < len(dims):
        raise ConfigError(f"dp={dp!r} names a dim twice")
    return dims


def _replica_group(dist: Any, mesh: Any, replica_dims: tuple[str, ...]) -> ReplicaGroup | None:
    """The group of this process's peers along every replica dim (one mesh dim: its own group;
    several: a group per DP coordinate, made by every rank together)."""
    if not replica_dims:
        return None
    group = _dims_group(dist, mesh, replica_dims)
    return ReplicaGroup(group, group.rank(), group.size(), dist.get_global_rank(group, 0))


def _dims_group(dist: Any, mesh: Any, dims: tuple[str, ...]) -> Any:
    """This process's group along ``dims`` of the mesh (one dim: the mesh's own group; several: a
    group per coordinate of the other dims, made by every rank together)."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = tuple(mesh.mesh_dim_names)
    order = [names.index(d) for d in names if d not in dims] + [names.index(d) for d in dims]
    table = mesh.mesh.permute(*order).reshape(-1, _product(mesh.size(names.index(d)) for d in dims))
    group, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in table])
    return group


def _feed(dist: Any, pipelines: list[list[int]]) -> ReplicaGroup | None:
    """This process's place in the group of its pipeline's first and middle stages (each
    pipeline's global ranks in stage order), made by every rank together; None on a last stage."""
    if len(pipelines[0]) < 3:
        return None
    feeds = [pipeline[:-1] for pipeline in pipelines]
    group, _ = dist.new_subgroups_by_enumeration(feeds)
    if group is None:
        return None
    feed = next(f for f in feeds if dist.get_rank() in f)
    return ReplicaGroup(group, feed.index(dist.get_rank()), len(feed), feed[0])


def _mesh_pipelines(mesh: Any, pp: str) -> list[list[int]]:
    """Every pipeline of the mesh: the global ranks along the ``pp`` dim, one list per coordinate
    of the other dims."""
    names = tuple(mesh.mesh_dim_names)
    order = [names.index(d) for d in names if d != pp] + [names.index(pp)]
    return [row.tolist() for row in mesh.mesh.permute(*order).reshape(-1, mesh.size(names.index(pp)))]


def _group_pipelines(dist: Any, pp_group: Any) -> list[list[int]]:
    """Every rank's pipeline (its ``pp_group``'s global ranks in stage order), gathered over the
    world: each rank knows its own group only."""
    mine = [dist.get_global_rank(pp_group, s) for s in range(pp_group.size())]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({tuple(p): list(p) for p in every}.values())


def _product(sizes: Any) -> int:
    out = 1
    for size in sizes:
        out *= int(size)
    return out


#: where a 1-D mesh is wrong, the recipe that is right
_MESH_RECIPE = (
    "pass the whole mesh and name its data-parallel dims (torchtitan: the data-loading mesh "
    "parallel_dims.get_optional_mesh(['pp', 'batch', 'cp', 'tp'], include_singleton_axes=True) with dp='batch'; "
    "docs/parallel.md, 'A DeviceMesh (torchtitan style)')"
)


def _made_from(mesh: Any) -> list[str]:
    """The tensor, context and pipeline parallel dims of more than one rank that were unflattened
    from ``mesh``'s root (torchtitan's ParallelDims makes them from its 1-D ``world`` mesh); read from
    torch's registry of the root's groups, where this torch keeps one (else none are known)."""
    try:
        groups = list(mesh._get_root_mesh()._pg_registry.values())
        descs = {(g.group_desc, g.size()) for g in groups}
    except AttributeError:  # a torch without the registry: nothing to go by
        return []
    return sorted({d.removeprefix("mesh_") for d, size in descs if d in ("mesh_tp", "mesh_cp", "mesh_pp") and size > 1})


def _refuse_partial_mesh(dist: Any, mesh: Any, names: tuple[str, ...]) -> None:
    """A 1-D mesh splits the data by its one dim, which is right only where its ranks are every
    rank and every one data-parallel: refuse one smaller than the process group (where the other
    ranks stand is unknown), or one whose root tensor, context or pipeline groups were made from."""
    size, world = mesh.size(), dist.get_world_size()
    if size < world:
        raise ConfigError(
            f"the 1-D mesh {names} holds {size} of the process group's {world} ranks: the loader cannot tell the "
            f"peers that must share batches from the ranks that split the data; {_MESH_RECIPE}"
        )
    peers = _made_from(mesh)
    if peers:
        raise ConfigError(
            f"the 1-D mesh {names} holds every rank, but {', '.join(peers)} groups were made from it (torchtitan's "
            f"world mesh): its ranks are not all data-parallel, and peers would get different documents; "
            + _MESH_RECIPE
        )


@dataclass(frozen=True)
class Seat:
    """Where this process sits, known before the loader makes any process group: what the ranks
    compare before the first collective (``agree.agree_on_layout``). ``facts``: the layout's
    entries of the loader's description (the dims named and their order, the sizes); ``groups``:
    each group this process is in, by role (``dp``, ``replica``, ``cp``, ``pp``), as (the global
    rank of its rank 0, this process's rank in it, its size); ``problem``: what this process
    refused, which every rank then raises."""

    dp_rank: int
    dp_size: int
    coords: tuple[tuple[str, int], ...]
    facts: dict[str, tuple[str, Any]]
    groups: dict[str, tuple[int, int, int]]
    #: the mesh (its coordinates name the other ranks in messages), or None
    mesh: Any = None
    problem: str | None = None

    @classmethod
    def refused(cls, problem: str) -> Seat:
        return cls(-1, 0, (), {}, {}, None, problem)


class Agree(Protocol):
    """What the loader checks once every rank knows its seat, before any process group is made:
    that the ranks agree (raising on every rank where they do not); it returns the roster that
    names each peer, or None."""

    def __call__(self, seat: Seat, group: Any) -> Any: ...


def _members(mesh: Any, coord: dict[str, int], free: tuple[str, ...]) -> list[int]:
    """The global ranks that share this process's coordinate on every dim not in ``free``."""
    names = tuple(mesh.mesh_dim_names)
    index = tuple(slice(None) if n in free else coord[n] for n in names)
    return sorted(int(g) for g in mesh.mesh[index].flatten().tolist())


def _placed(members: list[int], me: int) -> tuple[int, int, int]:
    """(rank 0's global rank, this process's rank, size) of a group of ``members`` (a process
    group orders its ranks by global rank)."""
    return members[0], members.index(me), len(members)


def _mesh_seat(opts: LayoutOptions, dist: Any) -> Seat:
    mesh = opts.mesh
    names = tuple(mesh.mesh_dim_names or ())
    dp = _dp_dims(mesh, opts.dp)
    if len(names) == 1:
        _refuse_partial_mesh(dist, mesh, names)
    for role, dim in (("cp", opts.cp), ("pp", opts.pp)):
        if dim is not None and (dim not in names or dim in dp):
            raise ConfigError(f"{role}={dim!r} must name a non-data-parallel dim of the mesh {names}")
    coord = dict(zip(names, (int(c) for c in mesh.get_coordinate()), strict=True))
    dp_rank, dp_size = 0, 1
    for d in dp:  # row-major over the DP dims, in the order given
        dp_rank, dp_size = dp_rank * mesh.size(names.index(d)) + coord[d], dp_size * mesh.size(names.index(d))
    me = dist.get_rank()
    replica_dims = tuple(d for d in names if d not in dp)
    groups = {"dp": _placed(_members(mesh, coord, dp), me), "replica": _placed(_members(mesh, coord, replica_dims), me)}
    for role, dim in (("cp", opts.cp), ("pp", opts.pp)):
        if dim is not None:
            groups[role] = _placed(_members(mesh, coord, (dim,)), me)
    shape = " ".join(f"{n}={mesh.size(i)}" for i, n in enumerate(names))
    facts = {"dp": (AGREE_ALL, dp), "mesh": (AGREE_ALL, shape), "dp_size": (AGREE_ALL, dp_size)}
    facts["dp_rank"] = (AGREE_PEERS, dp_rank)
    return Seat(dp_rank, dp_size, tuple(coord.items()), facts, groups, mesh)


def _mesh_layout(opts: LayoutOptions, dist: Any, seat: Seat, roster: Any) -> Layout:
    """The layout of a seat on a mesh: the groups it needs, made by every rank together."""
    mesh, coord = opts.mesh, dict(seat.coords)
    names = tuple(mesh.mesh_dim_names)
    dp = seat.facts["dp"][1]
    cp = CpSlice(coord[opts.cp], mesh.size(names.index(opts.cp)), opts.cp_split) if opts.cp else None
    pp = None
    if opts.pp:
        feed = _feed(dist, _mesh_pipelines(mesh, opts.pp)) if opts.replicas == "read" else None
        pp = PpStage(coord[opts.pp], mesh.size(names.index(opts.pp)), feed)
    replica_dims = tuple(d for d in names if d not in dp)
    return Layout(
        seat.dp_rank,
        seat.dp_size,
        explicit=True,
        coords=seat.coords,
        replicas=_replica_group(dist, mesh, replica_dims),
        cp=cp,
        pp=pp,
        mode=opts.replicas,
        agree_every=opts.agree_every,
        dp_group=_dims_group(dist, mesh, dp) if replica_dims else None,
        roster=roster,
    )


def _group_place(dist: Any, group: Any) -> tuple[int, int, int]:
    return dist.get_global_rank(group, 0), group.rank(), group.size()


def _groups_seat(opts: LayoutOptions, dist: Any) -> Seat:
    dp_rank, dp_size = opts.dp_group.rank(), opts.dp_group.size()
    if opts.replica_group is None and dp_size < dist.get_world_size():
        raise ConfigError(
            f"dp_group has {dp_size} of the {dist.get_world_size()} ranks: pass replica_group= (the peers that must "
            "yield the same batches, e.g. Megatron's tensor x context x pipeline peers)"
        )
    groups = {"dp": _group_place(dist, opts.dp_group), "replica": (dist.get_rank(), 0, 1)}
    for role, group in (("replica", opts.replica_group), ("cp", opts.cp_group), ("pp", opts.pp_group)):
        if group is not None:
            groups[role] = _group_place(dist, group)
    facts = {"dp_size": (AGREE_ALL, dp_size), "dp_rank": (AGREE_PEERS, dp_rank)}
    for role in ("replica", "cp", "pp"):
        facts[f"{role}_size"] = (AGREE_ALL, groups[role][2] if role in groups else None)
    return Seat(dp_rank, dp_size, (("dp", dp_rank), ("replica", groups["replica"][1])), facts, groups)


def _groups_layout(opts: LayoutOptions, dist: Any, seat: Seat, roster: Any) -> Layout:
    """The layout of a seat in Megatron-style groups (a pipeline's feed, made by every rank)."""
    replicas = None
    if opts.replica_group is not None:
        g = opts.replica_group
        replicas = ReplicaGroup(g, g.rank(), g.size(), dist.get_global_rank(g, 0))
    cp = CpSlice(opts.cp_group.rank(), opts.cp_group.size(), opts.cp_split) if opts.cp_group is not None else None
    pp = None
    if opts.pp_group is not None:
        g = opts.pp_group
        feed = _feed(dist, _group_pipelines(dist, g)) if opts.replicas == "read" and g.size() >= 3 else None
        pp = PpStage(g.rank(), g.size(), feed)
    dp_group = opts.dp_group if seat.dp_size < dist.get_world_size() else None
    return Layout(
        seat.dp_rank,
        seat.dp_size,
        True,
        seat.coords,
        replicas,
        cp,
        pp,
        opts.replicas,
        opts.agree_every,
        dp_group,
        roster,
    )


def _refuse_current_mesh() -> None:
    """Under ``with mesh:`` (a current DeviceMesh) with dims besides one, the global rank would
    split the data between peers that must share it: refuse rather than guess."""
    module = sys.modules.get("torch.distributed.device_mesh")
    if module is None or _dist() is None:
        return
    try:
        mesh = module._mesh_resources.get_current_mesh()
    except (RuntimeError, IndexError, AttributeError):  # no mesh is current
        return
    if mesh.ndim > 1:
        names = tuple(mesh.mesh_dim_names or ())
        raise ConfigError(
            f"a DeviceMesh with dims {names or mesh.ndim} is current: the global rank would split the data between "
            "peers that must share it; pass mesh= and dp= (docs/parallel.md)"
        )


def _check_pairs(opts: LayoutOptions) -> None:
    """cp_rank/cp_size and pp_stage/pp_stages come together, the first inside the second."""
    for low, high in (("cp_rank", "cp_size"), ("pp_stage", "pp_stages")):
        lo, hi = getattr(opts, low), getattr(opts, high)
        if (lo is None) != (hi is None):
            raise ConfigError(f"pass {low}= and {high}= together")
        if lo is not None and lo >= hi:
            raise ConfigError(f"{low} {lo} is outside {high} {hi}")


def _from_rank(opts: LayoutOptions) -> Layout:
    """``rank=``/``world_size=`` given, or the global rank; a CP slice or a stage given by hand."""
    if opts.rank is None:
        _refuse_current_mesh()
    rank, world = resolve_world(opts.rank, opts.world_size)
    if opts.rank is None and world > 1:
        log.info(
            "the data is split by the global rank (%d of %d): every rank is a data-parallel rank; with tensor, "
            "context or pipeline parallel peers pass mesh= and dp= (docs/parallel.md)",
            rank,
            world,
        )
    cp = CpSlice(opts.cp_rank, opts.cp_size, opts.cp_split) if opts.cp_rank is not None else None
    pp = PpStage(opts.pp_stage, opts.pp_stages) if opts.pp_stage is not None else None
    return Layout(rank, world, opts.rank is not None, (), None, cp, pp, opts.replicas, opts.agree_every)


def world_seat(rank: int, world: int) -> Seat:
    """The seat of a data-parallel rank of the whole world (plain DDP: no replica peers)."""
    facts = {"dp_size": (AGREE_ALL, world), "dp_rank": (AGREE_PEERS, rank)}
    return Seat(rank, world, (("dp", rank),), facts, {"dp": (0, rank, world), "replica": (rank, 0, 1)})


def _refuse_hand(opts: LayoutOptions) -> None:
    hand = [n for n in ("cp_rank", "pp_stage") if getattr(opts, n) is not None]
    if hand:
        raise ConfigError(f"{', '.join(hand)} are for layouts without a mesh or groups; name the dim or group")


def _agreeing_group(dist: Any, opts: LayoutOptions) -> Any:
    """The group whose ranks compare their seats: the world, or a mesh's own ranks where the mesh
    holds fewer (made by those ranks alone)."""
    if opts.mesh is None or opts.mesh.mesh.numel() == dist.get_world_size():
        return None
    return dist.new_group(sorted(opts.mesh.mesh.flatten().tolist()), use_local_synchronization=True)


def resolve_layout(opts: LayoutOptions, agree: Agree | None = None) -> Layout:
    """The layout ``opts`` describes (see the module's docstring for the three ways). With a mesh
    or groups, ``agree`` is called with this process's seat before any process group is made,
    on every rank, also where this process refused its layout (each rank then raises)."""
    if opts.mesh is None and opts.dp_group is None:
        _check_pairs(opts)
        return _from_rank(opts)
    dist = _dist()
    if dist is None:
        given = "mesh=" if opts.mesh is not None else "dp_group="
        raise ConfigError(f"{given} needs torch.distributed initialised (the process groups of the layout)")
    try:
        _check_pairs(opts)
        _refuse_hand(opts)
        seat = _mesh_seat(opts, dist) if opts.mesh is not None else _groups_seat(opts, dist)
    except ConfigError as exc:
        if agree is None:
            raise
        seat = Seat.refused(str(exc))
    roster = agree(seat, _agreeing_group(dist, opts)) if agree is not None else None
    if opts.mesh is not None:
        return _mesh_layout(opts, dist, seat, roster)
    return _groups_layout(opts, dist, seat, roster)


__all__ = ["Agree", "CpSlice", "Layout", "PpStage", "ReplicaGroup", "Seat", "resolve_layout", "world_seat"]
