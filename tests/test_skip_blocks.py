"""``on_error="skip"`` over shards cut into blocks, with real DataLoader workers: exactly the
unreadable shard's documents are missing (and the shard counted), every other token comes once.

A worker that hands its tail to its rank's last worker (``load/handoff.py``) yields only the
batches its plan makes; a lost unit leaves holes of the planned lengths (``load/holes.py``), so
its other items keep their places and the last worker reads exactly the planned tail.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from synth import write_dataset

import wdsllm
from wdsllm.load import plan

MODES = {
    "fixed": dict(batch_size=2),
    "budget": dict(batching="bucket", max_tokens=160, window=40),
    "pack": dict(batching="pack", seq_len=32, batch_size=4, window=20),
    "concat": dict(batching="concat", seq_len=32, batch_size=3),
}
LOST = 1  # the shard cut short on disk


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Counter]:
    """Four shards, the second cut short, and every token of the other three (a multiset)."""
    out = tmp_path_factory.mktemp("skip_blocks")
    info = write_dataset(out, [23, 9, 31, 17], max_len=60, seed=3)
    bad = sorted(out.glob("*.tar"))[LOST]
    bad.write_bytes(bad.read_bytes()[:700])
    good = [tokens for item, tokens in info["expect"].items() if item >> 32 != LOST]
    return out, Counter(np.concatenate(good).tolist())


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> tuple[Path, Counter, Counter]:
    """Four shards, a group in the middle of the third one damaged (its checksum fails after the
    groups before it were read), the tokens of the other three and those of the damaged one."""
    out = tmp_path_factory.mktemp("skip_blocks_damaged")
    info = write_dataset(out, [23, 9, 31, 17], max_len=60, seed=3)
    bad = sorted(out.glob("*.tar"))[2]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    parts: dict[bool, list] = {True: [], False: []}
    for item, tokens in info["expect"].items():
        parts[item >> 32 == 2].append(tokens)
    return out, Counter(np.concatenate(parts[False]).tolist()), Counter(np.concatenate(parts[True]).tolist())


@pytest.fixture(scope="module")
def second(tmp_path_factory) -> tuple[Path, Counter]:
    """A second, whole source for a mixture, and its tokens."""
    out = tmp_path_factory.mktemp("skip_blocks_b")
    info = write_dataset(out, [12, 14], max_len=60, seed=5, task=1)
    return out, Counter(np.concatenate(list(info["expect"].values())).tolist())


@pytest.fixture
def fine_blocks(monkeypatch):
    monkeypatch.setattr(plan, "MIN_BLOCK_TOKENS", 64)  # the shards cut into blocks of a few groups


def _tokens(batch: dict) -> list[int]:
    ids = batch["input_ids"].numpy()
    return [t for i, n in enumerate(batch["lengths"].tolist()) for t in ids[i, : int(n)].tolist()]


def _epoch_tokens(dataset, world: int, workers: int, options: dict, lost: str, equal: bool = False) -> Counter:
    """Every token the ranks of one epoch yield; each rank names the lost shard only (``equal``:
    and they yield equal batch counts)."""
    got: Counter = Counter()
    counts = set()
    for rank in range(world):
        loader = wdsllm.loader(
            dataset,
            rank=rank,
            world_size=world,
            num_workers=workers,
            _in_process=workers > 2,
            equal_batches=equal,
            on_error="skip",
            shuffle_buffer=7,
            **options,
        )
        batches = list(loader)
        counts.add(len(batches))
        for batch in batches:
            got.update(_tokens(batch))
        assert {Path(url).name for url in loader.skipped_shards} == {lost}
        loader.close()
    assert len(counts) == 1 or not equal
    return got


@pytest.mark.parametrize(("world", "workers"), [(1, 2), (2, 2), (1, 3)])
@pytest.mark.parametrize("name", sorted(MODES))
def test_skip_over_blocks_loses_only_the_unreadable_shard(corpus, fine_blocks, name, world, workers):
    """2 real DataLoader workers; 3 run in this process (the same stages, the same split)."""
    path, tokens = corpus
    lost = sorted(path.glob("*.tar"))[LOST].name
    assert _epoch_tokens(str(path), world, workers, MODES[name], lost) == tokens  # nothing else lost, nothing twice


@pytest.mark.parametrize("name", sorted(MODES))
def test_a_mixture_loses_only_the_unreadable_shard(corpus, second, fine_blocks, name):
    """A mixture whose epoch takes each source once (quotas of the sources' sizes), 2 ranks."""
    (path, tokens), (other, other_tokens) = corpus, second
    mix = wdsllm.Mixture({"a": str(path), "b": str(other)}, weights={"a": 80, "b": 26}, unit="items", epoch_items=106)
    lost = sorted(path.glob("*.tar"))[LOST].name
    assert _epoch_tokens(mix, 2, 2, MODES[name], lost) == tokens + other_tokens


@pytest.mark.parametrize("name", sorted(MODES))
def test_a_shard_damaged_midway_loses_only_the_rest_of_its_slice(damaged, fine_blocks, name):
    """The slice holding the damage yields its items before it and loses the rest: holes stand
    in for those only, so each of its tokens comes at most once and every other one exactly once."""
    path, tokens, damaged_tokens = damaged
    got: Counter = _epoch_tokens(str(path), 2, 2, MODES[name], sorted(path.glob("*.tar"))[2].name)
    assert not tokens - got  # nothing of the good shards lost
    assert not (got - tokens) - damaged_tokens  # nothing twice, nothing beyond the damaged shard's


@pytest.mark.parametrize("name", sorted(MODES))
def test_equal_batches_repeat_for_a_lost_shard_and_lose_nothing_else(corpus, fine_blocks, name):
    """Ranks that lost items top up to the equal count by repeating their own: every token of a
    good shard comes at least once, and nothing of the lost one."""
    path, tokens = corpus
    lost = sorted(path.glob("*.tar"))[LOST].name
    got = _epoch_tokens(str(path), 2, 2, MODES[name], lost, equal=True)
    assert not tokens - got
    assert set(got) <= set(tokens)


@pytest.mark.parametrize("world", [1, 2])
def test_a_packed_dataset_loses_only_the_unreadable_shards_rows(tmp_path, fine_blocks, world):
    """Rows of a packed dataset, with their documents and boundaries: a hole is a row too."""
    info = write_dataset(tmp_path, [23, 9, 31, 17], max_len=60, seed=3, mode="packed", seq_len=16)
    bad = sorted(tmp_path.glob("*.tar"))[LOST]
    bad.write_bytes(bad.read_bytes()[:700])
    rows: Counter = Counter()
    for rank in range(world):
        options = dict(rank=rank, world_size=world, num_workers=2, equal_batches=False, on_error="skip")
        loader = wdsllm.loader(str(tmp_path), batch_size=3, shuffle_buffer=7, docs=True, boundaries=True, **options)
        for batch in loader:
            rows.update(batch["rows"].tolist())
            assert (batch["docs"][:, 0] >= 0).all()
        loader.close()
    assert rows == Counter(item for item in info["expect"] if item >> 32 != LOST)


def _rows(batch: dict) -> list[list[int]]:
    ids = batch["input_ids"].numpy()
    return [ids[i, : int(n)].tolist() for i, n in enumerate(batch["lengths"].tolist())]


@pytest.mark.parametrize("equal", [False, True])
@pytest.mark.parametrize("name", sorted(MODES))
def test_a_resume_after_a_lost_shard_equals_the_uninterrupted_run(corpus, fine_blocks, name, equal):
    """A state saved after the unreadable shard was skipped (its holes cut out, or, under equal
    batches, the worker topping up): the resumed batches are the uninterrupted run's rest."""
    path, _ = corpus
    options = dict(
        MODES[name], rank=1, world_size=2, num_workers=2, equal_batches=equal, on_error="skip", shuffle_buffer=7
    )
    with wdsllm.loader(str(path), **options) as loader:
        whole, skipped = [], []
        for batch in loader:
            whole.append(_rows(batch))
            skipped.append(len(loader.skipped_shards))
    assert skipped[-1] >= 1  # each block of the lost shard counted
    first = next(i for i, n in enumerate(skipped) if n)
    for cut in sorted({first + 1, (first + len(whole)) // 2, len(whole) - 1}):
        with wdsllm.loader(str(path), **options) as loader:
            it = iter(loader)
            head = [_rows(next(it)) for _ in range(cut)]
            state = loader.state_dict()
        with wdsllm.loader(str(path), **options) as resumed:
            resumed.load_state_dict(state)
            rest = [_rows(b) for b in resumed]
        assert head + rest == whole, (name, cut)


def test_batches_that_lost_items_are_counted_in_a_warning(corpus, fine_blocks, caplog):
    """Each worker task that cut holes out of its batches says how many batches and items."""
    path, _ = corpus
    options = dict(MODES["fixed"], num_workers=2, _in_process=True, on_error="skip", shuffle_buffer=7)
    with caplog.at_level("WARNING", logger="wdsllm"), wdsllm.loader(str(path), **options) as loader:
        sizes = [len(b["input_ids"]) for b in loader]
    lines = [r.getMessage() for r in caplog.records if "of unreadable units and come smaller" in r.getMessage()]
    assert lines
    lost = sum(int(line.split(" lost ")[1].split()[0]) for line in lines)
    # the lost shard's 9 documents; each batch that held some comes smaller, the rank's others are full
    assert lost == 9 and sum(sizes) == 80 - 9
