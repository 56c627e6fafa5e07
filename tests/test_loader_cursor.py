"""The loader's cursor (issue #30): its get/set is the position half of the state dict, stats are a
typed record, and a state saved mid-epoch, between epochs or after a finished epoch restores the
same cursor in a fresh loader."""

from __future__ import annotations

from pathlib import Path

import pytest
from pack_helpers import cached
from synth import write_dataset

import wdsllm
from wdsllm.load import state as statemod
from wdsllm.load.cursor import Cursor, turn_after
from wdsllm.load.dataset import DataStats

POSITION = ("epoch", "yielded", "steps", "tails", "workers", "turn", "active")


def _data() -> Path:
    return cached("cursor-synth", lambda d: write_dataset(d, [9, 14, 6, 11], seed=2) and d)


def _loader(**kw) -> wdsllm.Loader:
    options = dict(batch_size=3, seed=5, shuffle_buffer=4, num_workers=2, _in_process=True)
    options.update(kw)
    return wdsllm.loader(str(_data()), **options)


def _position(state: dict) -> dict:
    st = statemod.LoaderState.load(state)
    return {k: getattr(st, k) for k in POSITION}


def _docs(batches) -> list[list[int]]:
    return [b["docs"][:, 0].tolist() for b in batches]


@pytest.mark.parametrize("taken", [0, 1, 4, 7])
def test_the_cursor_get_is_the_state_and_set_restores_it(taken):
    first = _loader()
    it = iter(first)
    for _ in range(taken):
        next(it)
    state = first.state_dict()
    assert _position(state) == first.cursor.get(in_epoch=taken > 0)
    rest = _docs(it)

    fresh = _loader()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state  # a restored cursor not yet begun answers with its state
    assert fresh.cursor.epoch == 0
    assert _docs(fresh) == rest


def test_after_a_finished_epoch_the_state_points_at_the_next():
    ld = _loader()
    everything = _docs(ld)
    position = _position(ld.state_dict())
    assert position["epoch"] == 1 and position["workers"] == {} and position["yielded"] == 0
    assert ld.cursor.completed == 0 and ld.cursor.epoch == 1
    fresh = _loader()
    fresh.load_state_dict(ld.state_dict())
    assert fresh.epoch == 1
    assert _docs(fresh) != everything  # epoch 1's order, not epoch 0 again


def test_an_abandoned_pass_does_not_move_a_later_one():
    ld = _loader()
    old = iter(ld)
    next(old)
    whole = _docs(ld)  # a new pass: the first is abandoned, and epoch 0 runs from its start
    assert whole == _docs(_loader())
    assert ld.cursor.epoch == 1
    for _ in old:  # the abandoned pass, run out later, does not end another epoch
        pass
    assert ld.cursor.epoch == 1 and ld.cursor.completed == 0


def test_turn_after_is_the_worker_after_the_last_served():
    assert turn_after({}, 3) == 0
    assert turn_after({0: (0, 2, None), 1: (0, 2, None), 2: (0, 1, None)}, 3) == 2
    assert turn_after({0: (0, 2, None), 1: (0, 2, None), 2: (0, 2, None)}, 3) == 0


def test_cursor_set_between_epochs_waits_for_nothing():
    cursor = Cursor(workers=2, epoch=3, completed=2)
    st = statemod.LoaderState.load(_loader().state_dict())
    cursor.set(st)
    assert (cursor.epoch, cursor.completed, cursor.restored, cursor.order) == (0, None, None, None)


def test_stats_are_a_typed_record_added_up_by_the_loader():
    total = DataStats()
    total.add(DataStats(truncated_tokens=3, skipped_shards=["a.tar"]))
    total.add(DataStats(skipped_docs=2, refilled_batches=1, skipped_shards=["b.tar"]))
    assert total == DataStats(3, ["a.tar", "b.tar"], 2, 1)
    ld = _loader(max_len=4, max_len_mode="truncate")
    for _ in ld:
        pass
    assert ld.truncated_tokens == ld.stats.truncated_tokens > 0
    assert ld.skipped_shards == [] and ld.skipped_docs == 0 and ld.refilled_batches == 0
