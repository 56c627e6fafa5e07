"""The wrong wirings of issue #17 fail with a message that says what to do (rows 1-3 and the
accelerate "each document twice"), instead of training on the wrong data."""

from __future__ import annotations

import traceback

import pytest
from accelerate.data_loader import IterableDatasetShard
from pack_helpers import cached
from synth import write_dataset
from torch.utils.data import DataLoader

import wdsllm
from wdsllm.errors import NotADatasetError, UsageError


def _data():
    def build(d):
        write_dataset(d, [30, 25], max_len=30, seed=3)
        return d

    return cached("guards", build)


def ids(batch) -> list:
    return batch["docs"][:, 0].tolist()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataloader_with_a_batch_size_is_refused(workers):
    """Row 1: DataLoader(batch_size=B) over our batches stacks B of them into one."""
    pipe = wdsllm.dataset(_data(), batch_size=4)
    assert len(list(DataLoader(pipe, batch_size=None, num_workers=workers))) == len(list(pipe))
    with pytest.raises(UsageError, match="batch_size=None") as info:
        next(iter(DataLoader(pipe, batch_size=4, num_workers=workers)))
    # torch re-raises a worker's error from a frame that the traceback keeps, with the iterator in
    # it: left to a garbage collection (in a later test), its worker is stopped only after 5 s
    traceback.clear_frames(info.tb)


def test_accelerate_sharding_of_the_dataset_is_refused():
    """Row 2: accelerate's IterableDatasetShard splits the rank's share across ranks again."""
    pipe = wdsllm.dataset(_data(), batch_size=4)
    shard = IterableDatasetShard(pipe, batch_size=4, num_processes=2, process_index=0)
    with pytest.raises(UsageError, match="do not accelerator.prepare"):
        next(iter(shard))


def test_the_loader_is_not_a_dataset():
    """Row 3: resuming by skipping batches reads loader.dataset; Trainer(train_dataset=loader)
    indexes it."""
    ld = wdsllm.loader(_data(), batch_size=4)
    with pytest.raises(NotADatasetError, match="integrations.hf.Trainer") as info:
        ld.dataset  # noqa: B018
    assert isinstance(info.value, AttributeError)  # code that probes for .dataset falls back
    assert getattr(ld, "dataset", None) is None
    with pytest.raises(UsageError, match="cannot be indexed"):
        next(iter(DataLoader(ld, batch_size=2)))


def test_rank_and_world_are_looked_up_again_when_iteration_starts(monkeypatch):
    """A loader built before the launcher set up the process (accelerate's Accelerator() under
    mpirun) believed it was rank 0 of 1 and read the whole epoch on every rank."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    early = wdsllm.loader(_data(), batch_size=4, seed=2)
    pipe = wdsllm.dataset(_data(), batch_size=4, seed=2)
    assert (early.rank, early.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    want = [ids(b) for b in wdsllm.loader(_data(), batch_size=4, seed=2, rank=1, world_size=2)]
    assert len(early) == len(want)
    assert [ids(b) for b in early] == want
    assert (early.rank, early.world_size) == (1, 2)
    assert [ids(b) for b in pipe] == [
        ids(b) for b in wdsllm.dataset(_data(), batch_size=4, seed=2, rank=1, world_size=2)
    ]
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="after the loader started iterating"):
        iter(early)


def test_explicit_rank_and_world_stay():
    ld = wdsllm.loader(_data(), batch_size=4, rank=0, world_size=1)
    ld._settle_world()
    assert (ld.rank, ld.world_size) == (0, 1)
