"""The description ranks compare is made from the option records (an option added later is in it
by construction), and the verdict on a table of ranks' rows is the same for every rank. No
processes here: tests/test_parallel_agree.py runs the comparison on real gloo ranks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace

import numpy as np
import pytest

from wdsllm.load import describe as describe_module
from wdsllm.load import seats
from wdsllm.load.describe import describe
from wdsllm.load.layout import Seat
from wdsllm.load.options import AGREE_NONE, AGREE_PEERS, FACE_RECORDS, Options, option, split_options

#: the options that may differ between ranks, each for a reason its declaration gives
NOT_COMPARED = {
    "prefetch_factor",
    "persistent_workers",
    "pin_memory",
    "multiprocessing_context",
    "retry",
    "cache_dir",
    "cache_size",
    "fetch_process",
    "rank",
    "world_size",
    "mesh",
    "dp_group",
    "replica_group",
    "cp_group",
    "pp_group",
    "cp_rank",
    "pp_stage",
    "wait_window",
    "watchdog_s",
    "watchdog_raise",
}


def test_every_option_of_every_record_is_described_unless_declared_otherwise():
    face = split_options("ds", {}, {"num_workers": 2, "cp_split": "contiguous"}, face="test")
    got = describe(face, {}, {"dataset": ("all", "abc")})
    every = {f.name for record in FACE_RECORDS for f in fields(record)}
    assert set(got.shared) == every - NOT_COMPARED | {"dataset"}
    assert got.shared["num_workers"] == "2" and got.shared["cp_split"] == "'contiguous'"
    assert not got.peers


def test_an_option_added_later_is_compared_without_a_list_to_update(monkeypatch):
    @dataclass(frozen=True)
    class Later(Options):
        KEYWORD = "later"
        knob: int = option(3, "a setting added later", low=0)
        scratch: str = option("/tmp", "a local path", agree=AGREE_NONE)
        own: int = option(0, "a peers-only setting", agree=AGREE_PEERS)

    monkeypatch.setattr(describe_module, "FACE_RECORDS", (Later,))
    got = describe(SimpleNamespace(later=Later(knob=5, own=1)), {}, {})
    assert got.shared == {"knob": "5"} and got.peers == {"own": "1"}


def _row(dp_rank, dp_size, me, *, replica, cp=None, shared=1, peers=1):
    seat = Seat(dp_rank, dp_size, (), {}, {"dp": (dp_rank, 0, dp_size)})
    row = seats.row_of(seat, SimpleNamespace(digest=lambda scope: shared if scope == "all" else peers), me)
    at = 6 + 3 * seats.ROLES.index("dp")
    row[at : at + 3] = [me % 2, dp_rank, dp_size]  # the DP group: one rank of each coordinate
    at = 6 + 3 * seats.ROLES.index("replica")
    row[at : at + 3] = replica
    if cp is not None:
        at = 6 + 3 * seats.ROLES.index("cp")
        row[at : at + 3] = cp
    return row


def _table(*rows) -> seats.Roster:
    return seats.Roster(np.array(rows, dtype=np.int64))


def test_a_layout_whose_groups_fit_has_no_problem():
    roster = _table(
        _row(0, 2, 0, replica=(0, 0, 2), cp=(0, 0, 2)),
        _row(0, 2, 1, replica=(0, 1, 2), cp=(0, 1, 2)),
        _row(1, 2, 2, replica=(2, 0, 2), cp=(2, 0, 2)),
        _row(1, 2, 3, replica=(2, 1, 2), cp=(2, 1, 2)),
    )
    assert seats.problems(roster) == [] and seats.disagree(roster.table) == (False, False)


@pytest.mark.parametrize(
    "rows,found",
    [
        (  # CP peers in two replica groups
            [
                _row(0, 2, 0, replica=(0, 0, 2), cp=(0, 0, 2)),
                _row(0, 2, 1, replica=(0, 1, 2), cp=(1, 0, 2)),
                _row(1, 2, 2, replica=(2, 0, 2), cp=(0, 1, 2)),
                _row(1, 2, 3, replica=(2, 1, 2), cp=(1, 1, 2)),
            ],
            "holds ranks of different replica groups",
        ),
        (  # every rank its own replica group, 2 DP coordinates: 2 ranks of 4
            [_row(r // 2, 2, r, replica=(r, 0, 1)) for r in range(4)],
            "is 2, not the 4 ranks",
        ),
        (  # a replica group that is not one DP coordinate's ranks
            [
                _row(0, 2, 0, replica=(0, 0, 2)),
                _row(1, 2, 1, replica=(0, 1, 2)),
                _row(0, 2, 2, replica=(2, 0, 2)),
                _row(1, 2, 3, replica=(2, 1, 2)),
            ],
            "are not one replica group",
        ),
    ],
)
def test_groups_that_do_not_fit_are_named(rows, found):
    problems = seats.problems(_table(*rows))
    assert any(found in p for p in problems), problems


def test_peers_that_differ_in_their_own_part_are_found_per_data_parallel_coordinate():
    rows = [_row(r // 2, 2, r, replica=(r - r % 2, r % 2, 2), peers=10 + r // 2) for r in range(4)]
    assert seats.disagree(np.array(rows)) == (False, False), "DP ranks may differ in the peers' part"
    rows[3] = _row(1, 2, 3, replica=(2, 1, 2), peers=99)
    assert seats.disagree(np.array(rows)) == (False, True)
    rows[0] = _row(0, 2, 0, replica=(0, 0, 2), shared=2, peers=10)
    assert seats.disagree(np.array(rows))[0]
