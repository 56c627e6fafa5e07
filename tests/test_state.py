"""Loader state: the sealed form survives every checkpointer, and a state that does not fit is
refused with a StateError naming the field, before any worker starts (issue #19, item 11).

The property test mutates one field of a saved state at a time (deletes it, negates it, makes it
huge, changes its type), seals it again as if it had been saved that way, and loads it: the
loader either refuses it or resumes exactly where the unmutated state would have.
"""

from __future__ import annotations

import copy
import io
import json
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pack_helpers import cached
from synth import write_dataset

import wdsllm
from wdsllm.errors import StateError
from wdsllm.load.state import seal, unseal

CONFIGS = {
    "fixed": dict(batch_size=3),
    "bucket": dict(batching="bucket", batch_size=3, window=8),
    "pack": dict(batching="pack", seq_len=24, window=7, batch_size=2),
    "endless": dict(batch_size=3, epochs=None),
    "steps": dict(batch_size=4, steps_per_epoch=5),
}


def _data() -> Path:
    def build(d: Path) -> Path:
        write_dataset(d, [9, 14, 6, 11], max_len=30, seed=2)
        return d

    return cached("state-synth", build)


def make(config: str, world: int = 1, rank: int = 0, workers: int = 2, **extra) -> wdsllm.Loader:
    kw = dict(CONFIGS[config], seed=4, shuffle_buffer=5, **extra)
    return wdsllm.loader(_data(), rank=rank, world_size=world, num_workers=workers, _in_process=True, **kw)


def key(batch: dict) -> bytes:
    return batch["input_ids"].numpy().tobytes() + str(batch["epoch"]).encode()


def remainder(loader: wdsllm.Loader, config: str) -> list[bytes]:
    """What a resumed loader yields next: the rest of the pass (endless: 12 batches)."""
    if loader.infinite and CONFIGS[config].get("steps_per_epoch") is None:
        return [key(b) for b in islice(loader, 12)]
    return [key(b) for b in loader]


def saved_after(config: str, k: int, world: int = 1, rank: int = 0, workers: int = 2) -> dict:
    """The state after ``k`` batches, taken pass after pass (so it may lie in a later epoch or loop)."""
    ld = make(config, world, rank, workers)
    taken = 0
    while taken < k:
        before = taken
        for _ in ld:
            taken += 1
            if taken == k:
                break
        if taken == before:
            break
    return ld.state_dict()


# ----------------------------------------------------------------------------------------------
# The property


def leaves(x, path=()):
    """Every (path, value) of a nested JSON value, the containers included."""
    yield path, x
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from leaves(v, (*path, i))


def mutate(value, op: str):
    if op == "negate":
        return -value if isinstance(value, int) and not isinstance(value, bool) else not value
    if op == "huge":
        if isinstance(value, (bool, int, type(None))):
            return 2**62
        if isinstance(value, dict):
            return {**value, **{f"k{i}": i for i in range(1000)}}
        return value * 1000 if value else "x" * 1000
    if op == "type":
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, (int, float)):
            return str(value)
        if isinstance(value, str):
            return 7
        if isinstance(value, list):
            return {str(i): v for i, v in enumerate(value)}
        if isinstance(value, dict):
            return list(value.values())
        return 0
    raise AssertionError(op)


def apply(body: dict, path: tuple, op: str) -> dict:
    body = copy.deepcopy(body)
    parent = body
    for p in path[:-1]:
        parent = parent[p]
    if op == "delete":
        if isinstance(parent, list):
            parent.pop(path[-1])
        else:
            del parent[path[-1]]
    else:
        parent[path[-1]] = mutate(parent[path[-1]], op)
    return body


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    cut=st.integers(0, 14),
    workers=st.integers(0, 2),
    world=st.integers(1, 2),
    pick=st.integers(0, 10_000),
    op=st.sampled_from(["delete", "negate", "huge", "type"]),
)
def test_a_mutated_state_is_refused_or_resumes_exactly(config, cut, workers, world, pick, op):
    rank = world - 1
    saved = saved_after(config, cut, world, rank, workers)
    want = make(config, world, rank, workers)
    want.load_state_dict(saved)
    expected = remainder(want, config)
    body = unseal(saved)
    paths = [p for p, _ in leaves(body) if p and p[0] != "digest"]
    path = paths[pick % len(paths)]
    mutated = seal(apply(body, path, op))
    loader = make(config, world, rank, workers)
    try:
        loader.load_state_dict(mutated)
    except StateError as exc:
        assert str(exc), "a StateError says what is wrong"
        return
    assert remainder(loader, config) == expected, f"{op} of {path} was accepted and resumed elsewhere"


# ----------------------------------------------------------------------------------------------
# The failures of issue #19, item 11, one by one


def _refused(state: dict, match: str, config: str = "fixed", workers: int = 2) -> None:
    with pytest.raises(StateError, match=match):
        make(config, workers=workers).load_state_dict(state)


def _edit(state: dict, **changes) -> dict:
    body = unseal(state)
    body.update(changes)
    return seal(body)


def test_refuses_what_used_to_resume_in_the_wrong_place():
    state = saved_after("fixed", 5)
    body = unseal(state)
    w0 = body["workers"]["0"]
    _refused(_edit(state, workers=dict(body["workers"], **{"0": [0, -3, None]})), r"workers\.0\[1\]")
    _refused(_edit(state, workers=dict(body["workers"], **{"0": [0, 10**6, None]})), "beyond the worker's")
    _refused(_edit(state, num_workers=0), "'num_workers'")
    _refused(_edit(state, world_size=0), "'world_size'")
    _refused(_edit(state, epoch=3), "epoch")  # epoch 3 with epoch-0 positions
    _refused(_edit(state, yielded=-1), "'yielded'")
    _refused(_edit(state, yielded=4), "'yielded'")
    _refused(_edit(state, workers={"0": w0}), "positions|yielded")  # a worker key removed
    for field in ("epoch", "workers", "rank", "yielded", "plan"):
        body = unseal(state)
        del body[field]
        _refused(seal(body), f"'{field}' is missing")
    _refused(_edit(state, workers=dict(body["workers"], **{"0": ["0", 3]})), r"workers\.0\[0\].*integer")
    _refused(_edit(state, rank="0"), "'rank'.*integer")


def test_a_state_edited_without_resealing_is_refused():
    state = saved_after("fixed", 5)
    body = json.loads(state["state"])
    body["yielded"] += 1
    _refused({"format": state["format"], "state": json.dumps(body)}, "digest")
    _refused({"format": state["format"]}, "'state' entry is missing")
    _refused({"format": "wdsllm.loader/9", "state": state["state"]}, "format tag|version")
    _refused("not a state", "not a wdsllm loader state")


def test_refused_before_any_worker_starts():
    """Real DataLoader workers: the refusal is raised by load_state_dict itself, the loader is
    unchanged and still iterates from the start."""
    ld = wdsllm.loader(_data(), batch_size=3, num_workers=2, seed=4, shuffle_buffer=5)
    first = [key(b) for b in islice(ld, 3)]
    state = ld.state_dict()
    fresh = wdsllm.loader(_data(), batch_size=3, num_workers=2, seed=4, shuffle_buffer=5)
    with pytest.raises(StateError):
        fresh.load_state_dict(_edit(state, turn=[1]))
    assert fresh._dataloader is None
    assert [key(b) for b in islice(fresh, 3)] == first


def test_version_1_states_still_load():
    """The unsealed dict of the first state version (before #17) resumes exactly (one worker:
    where the worker split of that version is today's)."""
    state = saved_after("bucket", 6, workers=1)
    want = make("bucket", workers=1)
    want.load_state_dict(state)
    body = unseal(state)
    del body["digest"]
    body["version"] = 1
    old = make("bucket", workers=1)
    old.load_state_dict(json.loads(json.dumps(body)))
    assert remainder(old, "bucket") == remainder(want, "bucket")
    # what torch.distributed.checkpoint made of a version-1 state (issue #17, row 4): its template
    # had no worker keys, so they were dropped, and the epoch silently restarted
    truncated = dict(body, workers={})
    _refused(truncated, "no worker position", config="bucket", workers=1)


# ----------------------------------------------------------------------------------------------
# Checkpointers


def test_state_survives_dcp_torch_save_and_json(tmp_path):
    state = saved_after("bucket", 7)
    reference = make("bucket")
    reference.load_state_dict(state)
    want = remainder(reference, "bucket")

    # torch.distributed.checkpoint with the loader itself as the Stateful (single process)
    src = make("bucket")
    it = iter(src)
    for _ in range(7):
        next(it)
    dcp.save({"loader": src}, checkpoint_id=str(tmp_path / "dcp"))
    dst = make("bucket")
    dcp.load({"loader": dst}, checkpoint_id=str(tmp_path / "dcp"))
    assert remainder(dst, "bucket") == want

    buf = io.BytesIO()
    torch.save({"data": state}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["data"]
    via_torch = make("bucket")
    via_torch.load_state_dict(loaded)
    assert remainder(via_torch, "bucket") == want

    via_json = make("bucket")
    via_json.load_state_dict(json.loads(json.dumps(state)))
    assert remainder(via_json, "bucket") == want


def test_dcp_refuses_a_state_with_a_worker_removed(tmp_path):
    src = make("fixed")
    it = iter(src)
    for _ in range(5):
        next(it)
    body = unseal(src.state_dict())
    del body["workers"]["1"]
    dcp.save({"loader": seal(body)}, checkpoint_id=str(tmp_path / "dcp"))
    holder = {"loader": make("fixed").state_dict()}
    dcp.load(holder, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(StateError, match="workers"):
        make("fixed").load_state_dict(holder["loader"])


def test_another_ranks_state_needs_equal_batches():
    state = saved_after("fixed", 4, world=2, rank=1)
    equal = make("fixed", world=2, rank=0)
    equal.load_state_dict(state)  # equal batches: rank 1's state describes rank 0 too
    unequal = saved_after("fixed", 4, world=2, rank=1)
    body = unseal(unequal)
    with pytest.raises(StateError, match="rank 1's"):
        make("fixed", world=2, rank=0, equal_batches=False).load_state_dict(seal(dict(body, equal_batches=False)))


# ----------------------------------------------------------------------------------------------
# Epochs that end without the iterator being exhausted (Lightning)


def test_epoch_advances_when_its_last_batch_is_handed_out():
    """Lightning takes len(loader) batches and never asks for one more; the next pass must still
    be the next epoch, not the same one again."""
    ld = make("fixed")
    passes = []
    for _ in range(3):
        n = len(ld)
        passes.append([key(b) for b in islice(iter(ld), n)])
    assert passes[0] != passes[1] != passes[2]
    for e, got in enumerate(passes):
        fresh = make("fixed")
        fresh.set_epoch(e)
        assert got == [key(b) for b in fresh]
    assert ld.epoch == 3
    assert unseal(ld.state_dict())["epoch"] == 3
