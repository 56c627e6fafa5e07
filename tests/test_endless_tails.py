"""Short batches in streams without an end, with real DataLoader workers.

An endless stream's epochs (``epochs=None``, and the ``steps_per_epoch`` loops over it) are
planned as finite epochs are, tails handed to each rank's last worker included: each epoch
boundary costs a rank at most one short batch, and every epoch still yields each token once.
A resampled stream draws shards without epochs, so none of its batches is short.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from synth import write_dataset

import wdsllm
from wdsllm.errors import StateError
from wdsllm.load.state import seal, unseal

MODES = {
    "fixed": dict(batch_size=8),
    "budget": dict(batching="bucket", max_tokens=160, window=40),
    "pack": dict(batching="pack", seq_len=32, batch_size=8, window=40),
    "concat": dict(batching="concat", seq_len=32, batch_size=3),
}
EPOCHS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, Counter]:
    out = tmp_path_factory.mktemp("endless_tails")
    info = write_dataset(out, [23, 7, 31], max_len=60, seed=3)
    return str(out), Counter(np.concatenate(list(info["expect"].values())).tolist())


def _rows(batch: dict) -> list[list[int]]:
    ids = batch["input_ids"]
    return [ids[i, : int(n)].tolist() for i, n in enumerate(batch["lengths"].tolist())]


def _short(name: str, rows: list[list[int]]) -> bool:
    options = MODES[name]
    if name == "concat" and any(len(r) < options["seq_len"] for r in rows):
        return True
    return len(rows) < options["batch_size"]


def _first_epochs(path: str, name: str, **extra) -> dict[int, list]:
    """The batches of the first EPOCHS epochs of an endless stream (they interleave: a worker
    starts its next epoch while another one ends this one)."""
    with wdsllm.loader(path, num_workers=2, shuffle_buffer=7, **MODES[name]) as finite:
        per_epoch = len(finite)
    got: dict[int, list] = {e: [] for e in range(EPOCHS)}
    with wdsllm.loader(path, num_workers=2, shuffle_buffer=7, epochs=None, **MODES[name], **extra) as loader:
        for batch in itertools.islice(loader, 3 * EPOCHS * per_epoch):
            if batch["epoch"] in got:
                got[batch["epoch"]].append(_rows(batch))
            if all(len(b) == per_epoch for b in got.values()):
                return got
    raise AssertionError(f"the first {EPOCHS} epochs did not come whole: {[len(b) for b in got.values()]}")


@pytest.mark.parametrize("name", sorted(MODES))
def test_each_epoch_of_an_endless_stream_ends_with_one_short_batch_per_rank(corpus, name):
    path, tokens = corpus
    for epoch, batches in _first_epochs(path, name).items():
        assert Counter(t for rows in batches for row in rows for t in row) == tokens, epoch  # each token once
        if name != "budget":  # a budget's batches vary with the lengths anywhere in the epoch
            assert sum(_short(name, rows) for rows in batches) <= 1, epoch


def test_steps_per_epoch_loops_run_over_the_endless_stream(corpus):
    """A loop of ``steps_per_epoch`` is a window of the endless stream: the same batches, so the
    same one short batch per data epoch, wherever the loops cut it."""
    path, _ = corpus
    with wdsllm.loader(path, num_workers=2, shuffle_buffer=7, epochs=None, **MODES["pack"]) as endless:
        stream = [_rows(b) for b in itertools.islice(endless, 30)]
    with wdsllm.loader(path, num_workers=2, shuffle_buffer=7, steps_per_epoch=7, **MODES["pack"]) as loops:
        looped = [_rows(b) for _ in range(5) for b in loops][:30]
    assert looped == stream


@pytest.mark.parametrize("name", ["fixed", "pack"])
def test_a_resampled_stream_has_no_short_batch(corpus, name):
    path, _ = corpus
    with wdsllm.loader(path, num_workers=2, shuffle_buffer=7, resample=True, **MODES[name]) as loader:
        batches = [_rows(b) for b in itertools.islice(loader, 60)]
    assert not any(_short(name, rows) for rows in batches)


def test_an_endless_state_saved_before_the_handoff_is_refused(corpus):
    """Loader state version 4 let every worker of an endless stream end each epoch short: where
    workers hand their tails over now its positions name other batches."""
    path, _ = corpus
    options = dict(num_workers=2, shuffle_buffer=7, epochs=None, _in_process=True, **MODES["pack"])
    with wdsllm.loader(path, **options) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        body = unseal(loader.state_dict())
    body["version"] = 4
    body.pop("tails")
    with wdsllm.loader(path, **options) as old, pytest.raises(StateError, match="endless stream"):
        old.load_state_dict(seal(body))
