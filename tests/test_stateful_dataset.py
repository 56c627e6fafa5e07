"""``wdsllm.dataset(...)`` under torchdata's StatefulDataLoader: per-worker state_dict and
load_state_dict, so that a resumed StatefulDataLoader continues exactly, without replaying."""

from __future__ import annotations

import json

import pytest
from pack_helpers import cached
from synth import write_dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import wdsllm
from wdsllm.errors import StateError
from wdsllm.load.state import READABLE_DATASET_VERSIONS, seal, unseal


def _data():
    def build(d):
        write_dataset(d, [30, 25, 19, 22], max_len=30, seed=1)
        return d

    return cached("stateful-dataset", build)


def make(workers: int, **kw) -> StatefulDataLoader:
    kw = {"batch_size": 4, "seed": 5, "shuffle_buffer": 7, **kw}
    return StatefulDataLoader(wdsllm.dataset(_data(), **kw), batch_size=None, num_workers=workers)


def ids(batch: dict) -> list:
    return batch["docs"][:, 0].tolist() if "docs" in batch else [batch["doc"]]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "kw", [{}, {"batching": "bucket", "window": 9}, {"batch_size": None}], ids=["fixed", "bucket", "items"]
)
def test_stateful_dataloader_resumes_exactly(workers, kw):
    full = [ids(b) for b in make(workers, **kw)]
    for k in (3, len(full) // 2):
        first = make(workers, **kw)
        it = iter(first)
        got = [ids(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        del it
        second = make(workers, **kw)
        second.load_state_dict(state)
        assert got + [ids(b) for b in second] == full, f"resume after {k} batches"


def test_dataset_state_is_checked():
    pipe = wdsllm.dataset(_data(), batch_size=4, seed=5)
    it = iter(pipe)
    next(it)
    state = pipe.state_dict()
    body = unseal(state, "wdsllm.dataset", READABLE_DATASET_VERSIONS)
    other = wdsllm.dataset(_data(), batch_size=4, seed=5)
    for bad, match in [
        (dict(body, position=[0, -1, None]), r"position\[1\]"),
        (dict(body, position=[0, 10**6, None]), "beyond the worker's"),
        (dict(body, worker=1, num_workers=2), "worker 1 of 2"),
        (dict(body, world_size=2, rank=1), "rank 1 of 2"),
    ]:
        with pytest.raises(StateError, match=match):
            other.load_state_dict(seal(bad, "wdsllm.dataset"))
    with pytest.raises(StateError, match="other settings"):
        wdsllm.dataset(_data(), batch_size=5, seed=5).load_state_dict(state)
    with pytest.raises(StateError, match="not a wdsllm dataset state"):
        other.load_state_dict(wdsllm.loader(_data(), batch_size=4, seed=5).state_dict())


def test_a_position_of_another_epoch_is_not_applied(caplog):
    pipe = wdsllm.dataset(_data(), batch_size=4, seed=5)
    it = iter(pipe)
    next(it)
    state = pipe.state_dict()
    later = wdsllm.dataset(_data(), batch_size=4, seed=5)
    later.load_state_dict(state)
    later.set_epoch(1)
    fresh = wdsllm.dataset(_data(), batch_size=4, seed=5)
    fresh.set_epoch(1)
    assert [ids(b) for b in later] == [ids(b) for b in fresh]
    assert "starting epoch 1 from its beginning" in caplog.text
