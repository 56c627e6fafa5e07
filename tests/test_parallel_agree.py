"""Ranks of a parallel layout agree on everything that shapes their batches, or all stop at once.

Real multi-process gloo runs (``peers.run``: 2 or 4 processes, a DeviceMesh or Megatron-style
groups). Every rank compares one description of its loader at construction, before the loader's
first collective: a peer built with another worker count, ``agree_every``, ``replicas`` mode,
``cp_split``, dp dims, or dp dims in another order, and groups that do not fit together (a CP
group outside the replica group, sizes that do not cover the world), are a named error on every
rank within seconds, never a hang or silently other batches. ``state_dict()`` needs no peer:
rank 0 alone may save. A peer that dies is a ``ReplicaError`` naming it.
"""

from __future__ import annotations

import os

import pytest
from peers import outcome, run
from synth import write_dataset

pytestmark = pytest.mark.timeout(180)

BASE = {"batch_size": 2, "seed": 1, "shuffle_buffer": 8, "watchdog_s": None}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("agree") / "ds"
    write_dataset(root, [20, 20], max_len=24, seed=3)
    return str(root)


def _docs(loader, steps: int = 4) -> list[list[int]]:
    """The documents of the first ``steps`` batches (every rank steps together), then closed."""
    out = []
    for step, batch in enumerate(loader):
        out.append(batch["docs"][:, 0].tolist() if "docs" in batch else [])
        if step + 1 == steps:
            break
    loader.close()
    return out


def _layouts_that_disagree(rank: int, world: int, data: str) -> dict:
    """Each case builds a loader on every rank, one side built otherwise, and steps a few batches."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import wdsllm

    def steps(**kw) -> list:
        return _docs(wdsllm.loader(data, **{**BASE, **kw}))

    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = int(tp_mesh.get_coordinate()[1])
    on_tp = {"mesh": tp_mesh, "dp": "dp", "pad_to_multiple_of": 4}
    out = {"equal": outcome(lambda: steps(**on_tp))}
    out["num_workers"] = outcome(lambda: steps(**on_tp, num_workers=tp))
    out["agree_every"] = outcome(lambda: steps(**on_tp, agree_every=1 if tp else None))
    out["replicas"] = outcome(lambda: steps(**on_tp, replicas="broadcast" if tp else "read"))
    out["dp_names"] = outcome(lambda: steps(**{**on_tp, "dp": ("dp", "tp") if rank == 3 else "dp"}))
    out["refused"] = outcome(lambda: steps(**{**on_tp, "dp": "data" if rank == 3 else "dp"}))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    order = ("dp_shard", "dp_replicate") if rank >= 2 else ("dp_replicate", "dp_shard")
    out["hsdp_order"] = outcome(lambda: steps(mesh=hsdp, dp=order))
    cp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = int(cp_mesh.get_coordinate()[1])
    split = "contiguous" if cp else "zigzag"
    out["cp_split"] = outcome(lambda: steps(mesh=cp_mesh, dp="dp", cp="cp", pad_to_multiple_of=8, cp_split=split))
    # Megatron style: rank = dp * 2 + peer; every rank makes every group, in the same order
    dp_groups = [dist.new_group([peer, 2 + peer]) for peer in range(2)]
    peer_groups = [dist.new_group([2 * d, 2 * d + 1]) for d in range(2)]
    alone = [dist.new_group([r]) for r in range(world)]
    dp_rank, peer = divmod(rank, 2)
    groups = {"dp_group": dp_groups[peer], "replica_group": peer_groups[dp_rank], "pad_to_multiple_of": 8}
    out["groups_equal"] = outcome(lambda: steps(**groups, cp_group=peer_groups[dp_rank]))
    out["cp_outside"] = outcome(lambda: steps(**groups, cp_group=dp_groups[peer]))
    out["not_covered"] = outcome(lambda: steps(dp_group=dp_groups[peer], replica_group=alone[rank]))
    return out


@pytest.fixture(scope="module")
def disagreeing(data) -> list[dict]:
    reports = run(4, _layouts_that_disagree, data)
    for rank, rep in enumerate(reports):
        assert rep is not None and "crash" not in rep, f"rank {rank}: {rep}"
    return reports


def _failed(reports: list[dict], case: str, error: str) -> list[str]:
    """Every rank's message for ``case``, after checking that every rank raised ``error``."""
    got = [rep[case] for rep in reports]
    assert all(g.get("error") == error for g in got), [(g.get("error"), g.get("message", g.get("value"))) for g in got]
    return [g["message"] for g in got]


def test_ranks_built_alike_construct_and_replica_peers_yield_the_same_batches(disagreeing):
    for case in ("equal", "groups_equal"):
        got = [rep[case] for rep in disagreeing]
        assert all("value" in g for g in got), got
        assert got[0]["value"] == got[1]["value"] and got[2]["value"] == got[3]["value"], case
        assert got[0]["value"] != got[2]["value"], "data-parallel ranks read different documents"


@pytest.mark.parametrize(
    "case,setting",
    [
        ("num_workers", "num_workers"),
        ("agree_every", "agree_every"),
        ("replicas", "replicas"),
        ("cp_split", "cp_split"),
    ],
)
def test_a_peer_built_with_another_setting_fails_on_every_rank_at_construction(disagreeing, case, setting):
    """Another worker count (other batches from the second on), ``agree_every`` or ``replicas``
    mode (collectives that do not match: a hang), ``cp_split`` (slices that do not reassemble):
    every rank raises, naming the setting and the coordinates of each side."""
    for message in _failed(disagreeing, case, "ReplicaMismatchError"):
        assert f"differ in setting {setting!r}" in message, message
        side = "cp=1" if case == "cp_split" else "tp=1"
        assert f"at dp=0 {side[:2]}=0" in message and side in message, message


def test_dp_dims_named_otherwise_or_in_another_order_fail_on_every_rank(disagreeing):
    """A rank naming other dp dims, and HSDP ranks naming the dp dims in another order (which
    would read one share twice and another never), fail before any group is made."""
    for message in _failed(disagreeing, "dp_names", "ReplicaMismatchError"):
        assert "differ in setting 'dp': ('dp',) at dp=0 tp=0" in message and "('dp', 'tp') at dp=1 tp=1" in message
    for message in _failed(disagreeing, "hsdp_order", "ReplicaMismatchError"):
        assert "('dp_replicate', 'dp_shard') at dp_replicate=0 dp_shard=0" in message, message
        assert "('dp_shard', 'dp_replicate') at dp_replicate=1 dp_shard=0" in message, message


def test_a_layout_one_rank_refuses_stops_every_rank(disagreeing):
    for message in _failed(disagreeing, "refused", "ConfigError"):
        assert "a rank refused its layout" in message and "global rank 3: dp='data' names no dim" in message


def test_groups_that_do_not_fit_together_fail_on_every_rank_at_construction(disagreeing):
    for message in _failed(disagreeing, "cp_outside", "ConfigError"):
        assert "the cp group of dp=0 replica=0 holds ranks of different replica groups" in message, message
    for message in _failed(disagreeing, "not_covered", "ConfigError"):
        assert "data-parallel size 2 times the replica group's size 1 is 2, not the 4 ranks" in message, message


def _state_alone(rank: int, world: int, data: str) -> dict:
    """After two steps rank 0 alone asks for its state (the usual ``if rank == 0: save``); then
    every rank does, and each resumes from its reader's saved state: the rest equals the rest of
    the uninterrupted pass."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import wdsllm

    meshes = {
        "read": (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), "read", {}),
        "broadcast": (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), "broadcast", {}),
        "pipeline": (init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "pp")), "read", {"pp": "pp"}),
    }
    out = {}
    for name, (mesh, mode, extra) in meshes.items():
        kw = {**BASE, "mesh": mesh, "dp": "dp", "replicas": mode, **extra}
        loader = wdsllm.loader(data, **kw)
        it = iter(loader)
        next(it), next(it)
        alone = outcome(lambda: loader.state_dict()["state"]) if rank == 0 else None  # noqa: B023
        dist.barrier()
        state = loader.state_dict()
        rest = [b["docs"][:, 0].tolist() if "docs" in b else [] for b in it]
        every = [None] * world
        dist.all_gather_object(every, state)
        reader = 0 if name == "pipeline" else 2 * int(mesh.get_coordinate()[0])  # its DP coordinate's
        again = wdsllm.loader(data, **kw)
        again.load_state_dict(every[reader])
        resumed = [b["docs"][:, 0].tolist() if "docs" in b else [] for b in again]
        out[name] = {"alone": alone, "state": state["state"], "rest": rest, "resumed": resumed}
        again.close()
        loader.close()
    return out


def test_rank_zero_alone_may_save_and_every_peer_holds_its_readers_state(data):
    reports = run(4, _state_alone, data)
    assert all(rep is not None and "crash" not in rep for rep in reports), reports
    for name in ("read", "broadcast", "pipeline"):
        alone = reports[0][name]["alone"]
        assert "value" in alone, f"{name}: rank 0's state_dict() alone: {alone}"
        assert alone["value"] == reports[0][name]["state"], "asked alone or with its peers, the same state"
        peers = [(0, 1), (2, 3)] if name != "pipeline" else [(0, 1, 2, 3)]
        for group in peers:
            states = {reports[r][name]["state"] for r in group}
            assert len(states) == 1, f"{name}: the peers {group} hold different states"
        for rep in reports:
            assert rep[name]["resumed"] == rep[name]["rest"], f"{name}: the resumed pass differs"


def _peer_dies(rank: int, world: int, data: str, mode: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import wdsllm

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    loader = wdsllm.loader(data, **BASE, mesh=mesh, dp="dp", replicas=mode, agree_every=1)
    it = iter(loader)
    next(it)
    if rank == (0 if mode == "broadcast" else 1):  # the reader of a broadcast, a peer under read
        os._exit(0)
    return outcome(lambda: [next(it) for _ in range(3)] and None)


@pytest.mark.parametrize("mode,dead", [("read", "dp=0 tp=1"), ("broadcast", "its reader dp=0 tp=0")])
def test_a_peer_that_dies_is_a_replica_error_naming_it(data, mode, dead):
    reports = run(2, _peer_dies, data, mode)
    (survivor,) = [rep for rep in reports if rep is not None]
    assert survivor.get("error") == "ReplicaError", survivor
    assert dead in survivor["message"] and "the backend said" in survivor["message"], survivor["message"]


def _plain_ddp(rank: int, world: int, data: str) -> dict:
    """Plain data parallel (the global rank, no mesh) with ``reduce_every``: the wait's reduction
    is the loader's one collective; one rank reduces every 3 steps, the other every 2."""
    import wdsllm

    same = outcome(lambda: _docs(wdsllm.loader(data, **BASE, reduce_every=2)))
    other = outcome(lambda: _docs(wdsllm.loader(data, **BASE, reduce_every=2 + rank)))
    return {"same": same, "other": other}


def test_plain_data_parallel_ranks_that_reduce_at_other_steps_fail_at_the_first_iteration(data):
    reports = run(2, _plain_ddp, data)
    assert all(rep is not None and "crash" not in rep for rep in reports), reports
    assert all("value" in rep["same"] for rep in reports), reports
    assert reports[0]["same"]["value"] != reports[1]["same"]["value"]
    for message in _failed(reports, "other", "ReplicaMismatchError"):
        assert "differ in setting 'reduce_every': 2 at dp=0; 3 at dp=1" in message, message


def _one_of_four_dies(rank: int, world: int, data: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import wdsllm

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    loader = wdsllm.loader(data, **BASE, mesh=mesh, dp="dp", replicas="read", agree_every=1)
    it = iter(loader)
    next(it)
    if rank == 2:
        os._exit(0)
    return outcome(lambda: [next(it) for _ in range(3)] and None)


def test_in_a_group_of_four_the_peer_that_died_is_named_not_its_living_peers(data):
    """#43: in a replica group of more than two, the error named every other peer of the group;
    each peer counts its arrival at a check in the store first, so the survivors name the one
    that never came."""
    reports = run(4, _one_of_four_dies, data)
    survivors = [rep for rep in reports if rep is not None]
    assert len(survivors) == 3 and reports[2] is None
    for survivor in survivors:
        assert survivor.get("error") == "ReplicaError", survivor
        message = survivor["message"]
        assert "(did not reach it: dp=0 tp=2)" in message and "the backend said" in message, message


def _pending_on_peers(rank: int, world: int, data: str) -> dict:
    """A broadcast's reader and receiver both exclude a shard, for a later step and for the next
    one: the receiver takes it where its reader does."""
    from torch.distributed.device_mesh import init_device_mesh

    import wdsllm

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, call_at, at in (("ahead", 1, 5), ("now", 4, None)):
        loader = wdsllm.loader(data, mesh=mesh, dp="dp", replicas="broadcast", **BASE)
        docs, states = [], []
        for step, batch in enumerate(loader):
            docs.append(batch["docs"][:, 0].tolist())
            if step == call_at:
                loader.exclude(shards=[1], at=at)
            if step in (3, 6, 9):
                states.append(loader.state_dict()["state"])
        out[name] = {"docs": docs, "states": states, "log": loader.steering.log.to_json()}
        loader.close()
    return out


def test_a_change_made_ahead_is_taken_by_a_broadcasts_receiver_where_its_reader_takes_it(data):
    reports = run(2, _pending_on_peers, data)
    assert all(rep is not None and "crash" not in rep for rep in reports), reports
    for name in ("ahead", "now"):
        reader, receiver = reports[0][name], reports[1][name]
        assert reader["docs"] == receiver["docs"] and reader["states"] == receiver["states"], name
        assert [c["at"] for c in reader["log"]] == [5] and reader["log"] == receiver["log"], name
    assert reports[0]["ahead"]["docs"] == reports[0]["now"]["docs"]
