"""Endless streams with equal batches (issue #46): ``epochs=None`` and ``steps_per_epoch`` run
whole epochs one after another, each cut to the equal-batches count a finite epoch has, so any
rank's state resumes every rank, also on another world size; a setting that cannot be honoured
is refused when the loader is built; a state only its own rank can resume from is a warning at
save, not a refusal at load. In one process: each rank is a loader given its rank by hand."""

from __future__ import annotations

import json
import logging
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
from pack_helpers import cached
from synth import write_dataset

import wdsllm
from wdsllm.errors import ConfigError, StateError
from wdsllm.load.state import seal, unseal

KW = dict(batch_size=3, seed=4, shuffle_buffer=5, num_workers=2, _in_process=True)


def _data() -> Path:
    def build(d: Path) -> Path:
        write_dataset(d, [9, 14, 6, 11], max_len=30, seed=2)  # 40 documents: 20 a rank, 7 batches
        return d

    return cached("endless-equal", build)


def make(rank: int = 0, world: int = 2, **extra) -> wdsllm.Loader:
    return wdsllm.loader(_data(), rank=rank, world_size=world, **{**KW, "epochs": None, **extra})


def key(batch: dict) -> tuple:
    return batch["epoch"], tuple(batch["docs"][:, 0].tolist())


def take(loader: wdsllm.Loader, n: int) -> list[tuple]:
    return [key(b) for b in islice(loader, n)]


def test_every_rank_yields_the_same_batches_per_epoch_and_any_ranks_state_resumes_it():
    runs = [take(make(r), 30) for r in range(2)]
    per_epoch = [Counter(e for e, _ in run) for run in runs]
    assert per_epoch[0] == per_epoch[1] and per_epoch[0][0] == per_epoch[0][1] == 7  # 20 documents a rank
    for cut in (4, 6, 13):  # mid-epoch, at an epoch's end, in the third epoch
        saver = make(1)
        take(saver, cut)
        state = saver.state_dict()
        body = unseal(state)
        assert body["equal_batches"] and body["infinite"] and body["version"] >= 6
        for rank in range(2):
            resumed = make(rank)
            resumed.load_state_dict(state)
            assert take(resumed, 30 - cut) == runs[rank][cut:], f"rank {rank} from rank 1's state after {cut}"


def test_steps_per_epoch_loops_are_windows_of_the_stream_of_whole_epochs():
    endless = take(make(0), 20)
    loops = make(0, epochs=1, steps_per_epoch=4)
    got, state = [], None
    for loop in range(5):
        loops.set_epoch(loop)  # as a trainer does each loop (Lightning's LoaderEpochs): the stream goes on
        got += [key(b) for b in loops]
        if loop == 2:
            state = loops.state_dict()
    assert got == endless and len(loops) == 4
    resumed = make(1, epochs=1, steps_per_epoch=4)
    resumed.load_state_dict(state)  # rank 0's state, saved between loops
    assert [key(b) for b in resumed] == take(make(1), 16)[12:]


def test_an_endless_state_resumes_on_another_world_size_with_every_document_once():
    first = [take(make(r), 4) for r in range(2)]
    saver = make(0)
    take(saver, 4)
    state = saver.state_dict()
    seen = Counter(d for run in first for _, docs in run for d in docs)
    following = []
    for rank in range(3):
        resumed = make(rank, world=3)
        resumed.load_state_dict(state)
        batches = take(resumed, 20)
        seen.update(d for e, docs in batches if e == 0 for d in docs)
        following.append([b for b in batches if b[0] == 1][:2])
    assert max(seen.values()) == 1 and len(seen) >= 40 - 3 * 3, "the rest of epoch 0, each document once"
    fresh = [[b for b in take(make(r, world=3), 20) if b[0] == 1][:2] for r in range(3)]
    assert following == fresh, "the epochs after it follow the new layout's plan"


def test_a_setting_that_cannot_be_honoured_is_refused_when_the_loader_is_built(tmp_path):
    with pytest.raises(ConfigError, match="equal_batches=True cannot be honoured with resample=True"):
        make(resample=True, equal_batches=True)
    bare = tmp_path / "bare"
    write_dataset(bare, [5, 7], write_index=False)
    shards = sorted(str(p) for p in bare.glob("*.tar"))
    for extra in ({"epochs": None}, {"epochs": 1}):
        with pytest.raises(ConfigError, match="cannot be counted before reading"):
            wdsllm.loader(shards, rank=0, world_size=2, batch_size=2, equal_batches=True, **extra)
    # the default cannot be honoured there either: the endless stream streams on per worker, as before
    ld = wdsllm.loader(shards, rank=0, world_size=2, batch_size=2, epochs=None)
    assert not ld.cfg.keeps_equal_batches(2) and sum(1 for _ in islice(ld, 9)) == 9


def test_an_endless_state_of_streams_across_epochs_still_loads_where_it_is_asked_for():
    """States saved before state version 6 (or with equal_batches=False) are of workers streaming
    on across epochs: refused by name under the new default, resumed with equal_batches=False."""
    streamed = make(0, equal_batches=False)
    take(streamed, 5)
    body = unseal(streamed.state_dict())
    assert not body["equal_batches"]
    old = seal({**body, "version": 5})
    with pytest.raises(StateError, match="pass equal_batches=False to resume it"):
        make(0).load_state_dict(old)
    again = make(0, equal_batches=False)
    again.load_state_dict(old)
    assert take(again, 10) == take(make(0, equal_batches=False), 15)[5:]
    with pytest.raises(StateError, match="pass equal_batches=True"):
        make(0, equal_batches=False).load_state_dict(make_state_after(make(0), 3))


def make_state_after(loader: wdsllm.Loader, n: int) -> dict:
    take(loader, n)
    return loader.state_dict()


def test_a_state_only_its_rank_can_resume_from_is_a_warning_when_saved(caplog):
    caplog.set_level(logging.WARNING, logger="wdsllm.load.loader")
    per_rank = make(1, epochs=1, equal_batches=False)
    take(per_rank, 2)
    per_rank.state_dict()
    per_rank.state_dict()
    said = [r.getMessage() for r in caplog.records if "only this rank can resume from" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("rank 1's loader state")
    caplog.clear()
    for ld in (make(1, epochs=1, equal_batches=False), make(1), make(0, epochs=1)):
        take(ld, 2)
        ld.state_dict(kept_per_rank=ld.cfg.equal_batches is False)
    assert not [r for r in caplog.records if "only this rank" in r.getMessage()]
    assert json.loads(per_rank.state_dict()["state"])["rank"] == 1
