"""The ranks of a layout, one row each, gathered once at construction: do they fit together?

Every rank sends one row of integers (``row_of``): the digests of its description's two scopes
(``describe.py``), whether it refused its own layout, its data-parallel (DP) coordinate and
size, and each group it is in as (rank 0's global rank, its rank in it, its size). From the
table of every rank's row, each rank reaches the same verdict (``problems``): the descriptions
agree (every rank's shared part, each DP coordinate's peers' part), the DP ranks times the
replica group cover the ranks, each replica group holds exactly the ranks of one DP coordinate,
a context- or pipeline-parallel group lies inside one replica group, and a DP group holds one
rank of each DP coordinate. Megatron-style groups are the user's own; a mesh's follow from it
and are checked the same way. No torch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from .describe import Description
from .layout import Seat
from .options import AGREE_ALL, AGREE_PEERS

ROLES = ("dp", "replica", "cp", "pp")
#: a row: the digests, the refusal flag, the global rank, the DP coordinate and size, then
#: (rank 0's global rank, rank, size) per role (-1, 0, 0 where this rank is in no such group)
SHARED, PEERS, REFUSED, GLOBAL, DP_RANK, DP_SIZE = range(6)
WIDTH = 6 + 3 * len(ROLES)


def _at(role: str) -> int:
    return 6 + 3 * ROLES.index(role)


def row_of(seat: Seat, description: Description, global_rank: int) -> list[int]:
    """This rank's row."""
    row = [description.digest(AGREE_ALL), description.digest(AGREE_PEERS), int(seat.problem is not None)]
    row += [global_rank, seat.dp_rank, seat.dp_size]
    for role in ROLES:
        row += list(seat.groups.get(role, (-1, 0, 0)))
    return row


class Roster:
    """Every rank's row, and this rank's way of naming a rank by its coordinates."""

    def __init__(self, table: np.ndarray, mesh: Any = None):
        self.table = table
        self.mesh = mesh
        self._rows = {int(r[GLOBAL]): r for r in table}

    def where(self, global_rank: int) -> str:
        """The coordinates of ``global_rank`` as messages name them (``layout.Layout.where``)."""
        row = self._rows.get(global_rank)
        if row is None or row[REFUSED]:
            return f"global rank {global_rank}"
        if self.mesh is not None:
            names = tuple(self.mesh.mesh_dim_names)
            at = (self.mesh.mesh == global_rank).nonzero()[0].tolist()
            return " ".join(f"{n}={int(c)}" for n, c in zip(names, at, strict=True))
        if row[_at("replica") + 2] <= 1:
            return f"dp={int(row[DP_RANK])}"
        return f"dp={int(row[DP_RANK])} replica={int(row[_at('replica') + 1])}"

    def peers(self, role: str, global_rank: int) -> list[int]:
        """The global ranks in ``global_rank``'s group of ``role``, by the rows."""
        leader = self._rows[global_rank][_at(role)]
        return sorted(int(r[GLOBAL]) for r in self.table if r[_at(role)] == leader)


def _grouped(table: np.ndarray, column: int) -> dict[int, list[np.ndarray]]:
    out: dict[int, list[np.ndarray]] = defaultdict(list)
    for row in table:
        out[int(row[column])].append(row)
    return out


def _group_problems(roster: Roster, role: str, inside: str | None) -> list[str]:
    """A group of ``role`` whose ranks' rows disagree on it (its size, their ranks in it), or
    that spills out of the group of ``inside`` its ranks must share."""
    out = []
    at = _at(role)
    for leader, rows in _grouped(roster.table, at).items():
        if leader < 0:
            continue
        where = roster.where(int(rows[0][GLOBAL]))
        sizes = {int(r[at + 2]) for r in rows}
        ranks = sorted(int(r[at + 1]) for r in rows)
        if sizes != {len(rows)} or ranks != list(range(len(rows))):
            out.append(f"the {role} group of {where} is not the same group on each of its ranks")
        elif inside is not None and len({int(r[_at(inside)]) for r in rows}) > 1:
            others = sorted({roster.where(int(r[GLOBAL])) for r in rows})
            out.append(
                f"the {role} group of {where} holds ranks of different {inside} groups ({'; '.join(others)}): "
                f"{role.upper()} peers must be replica peers of one data-parallel coordinate"
            )
    return out


def _dp_problems(roster: Roster) -> list[str]:
    """The DP coordinates times the replica groups cover the ranks, each replica group is one DP
    coordinate's ranks, and each DP group holds one rank of each DP coordinate."""
    table, world = roster.table, len(roster.table)
    dp_size = int(table[0][DP_SIZE])
    replica_size = int(table[0][_at("replica") + 2])
    if dp_size * replica_size != world:
        return [
            f"the data-parallel size {dp_size} times the replica group's size {replica_size} is "
            f"{dp_size * replica_size}, not the {world} ranks: every rank must be in one data-parallel group "
            "and one replica group (dp_group= and replica_group=)"
        ]
    out = []
    for dp_rank, rows in sorted(_grouped(table, DP_RANK).items()):
        leaders = {int(r[_at("replica")]) for r in rows}
        if len(rows) != replica_size or len(leaders) != 1:
            ranks = "; ".join(roster.where(int(r[GLOBAL])) for r in rows)
            out.append(f"the ranks of data-parallel coordinate {dp_rank} ({ranks}) are not one replica group")
    for rows in _grouped(table, _at("dp")).values():
        if len({int(r[DP_RANK]) for r in rows}) != len(rows) or len(rows) != dp_size:
            out.append(
                f"the data-parallel group of {roster.where(int(rows[0][GLOBAL]))} is not one rank per coordinate"
            )
    return out


def problems(roster: Roster) -> list[str]:
    """What does not fit in the layout's groups (the same list on every rank)."""
    out = _dp_problems(roster)
    out += _group_problems(roster, "replica", None)
    for role in ("cp", "pp"):
        out += _group_problems(roster, role, "replica")
    return out


def disagree(table: np.ndarray) -> tuple[bool, bool]:
    """(whether the ranks' shared parts differ, whether some DP coordinate's peers differ)."""
    shared = len({int(r[SHARED]) for r in table}) > 1
    peers = any(len({int(r[PEERS]) for r in rows}) > 1 for rows in _grouped(table, DP_RANK).values())
    return shared, peers


__all__ = ["ROLES", "WIDTH", "Roster", "disagree", "problems", "row_of"]
