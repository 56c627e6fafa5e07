"""Equal batches without silent drops: ranks split by what they yield, drops named, or repeats.

With ``max_len`` splitting a document becomes several pieces; the ranks are split by pieces (a
share may start or stop inside a document), so equal batch counts leave at most a batch over,
which is a WARNING with its count, or with ``uneven="repeat"`` is filled by repeats instead of
dropped.
Ranks are explicit in one process (``rank=``/``world_size=``): the split is the same as under a
process group.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
from synth import write_dataset

import wdsllm

MAX_LEN = 8
BATCH = 4


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory) -> tuple[str, dict]:
    """Shards whose documents are up to 60 tokens: 1 to 8 pieces each at max_len 8."""
    out = tmp_path_factory.mktemp("long_docs")
    info = write_dataset(out, [23, 7, 31, 2, 18, 11, 9], max_len=60, seed=3)
    return str(out), info


def _pieces(info: dict) -> Counter:
    return Counter({(doc, p): 1 for doc, toks in info["expect"].items() for p in range(-(-len(toks) // MAX_LEN))})


def _rank_pieces(path: str, rank: int, world: int, workers: int = 1, **options) -> tuple[list[tuple], int]:
    """(doc, piece) of every item rank ``rank`` yields, and its batch count (workers in turn)."""
    pipe = wdsllm.dataset(path, rank=rank, world_size=world, batch_size=BATCH, max_len=MAX_LEN, **options)
    got, batches = [], 0
    for w in range(workers):
        for batch in pipe.worker_iter(w, workers):
            batches += 1
            got.extend(tuple(x) for x in batch["docs"].tolist())
    return got, batches


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_by_pieces_differ_by_at_most_one_piece(long_docs, world):
    path, info = long_docs
    runs = [_rank_pieces(path, r, world, equal_batches=False)[0] for r in range(world)]
    counts = [len(run) for run in runs]
    assert Counter(p for run in runs for p in run) == _pieces(info)  # every piece once
    assert max(counts) - min(counts) <= 1, counts


def test_equal_batches_drop_at_most_the_unavoidable_and_warn_with_the_count(long_docs, caplog):
    path, info = long_docs
    total = sum(_pieces(info).values())
    yielded, dropped = Counter(), 0
    with caplog.at_level(logging.WARNING, logger="wdsllm"):
        for rank in range(2):
            loader = wdsllm.loader(path, rank=rank, world_size=2, batch_size=BATCH, max_len=MAX_LEN)
            expected, n = len(loader), 0
            for batch in loader:
                n += 1
                yielded.update(tuple(x) for x in batch["docs"].tolist())
            assert n == expected
            dropped += loader.dropped_batches
            loader.close()
    assert max(yielded.values()) == 1 and set(yielded) <= set(_pieces(info))
    assert total - sum(yielded.values()) <= dropped * BATCH
    assert dropped <= 1  # ranks differ by at most one piece: at most a batch over
    if dropped:
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any(f"{dropped} batches beyond" in m for m in warned)


@pytest.mark.parametrize("workers", [1, 2])
def test_repeat_policy_yields_every_piece_with_equal_batches(long_docs, workers):
    path, info = long_docs
    runs = [_rank_pieces(path, r, 3, workers, uneven="repeat", shuffle_buffer=7) for r in range(3)]
    assert len({batches for _, batches in runs}) == 1, [b for _, b in runs]
    seen = Counter(p for got, _ in runs for p in got)
    assert set(seen) == set(_pieces(info))
    lengths = set()
    for rank in range(3):
        loader = wdsllm.loader(
            path, rank=rank, world_size=3, batch_size=BATCH, max_len=MAX_LEN, uneven="repeat", shuffle_buffer=7
        )
        expected = len(loader)
        assert sum(1 for _ in loader) == expected and loader.dropped_batches == 0
        lengths.add(expected)
        loader.close()
    assert len(lengths) == 1


def test_repeat_policy_resumes_exactly(long_docs):
    path, _ = long_docs
    options = dict(rank=1, world_size=3, batch_size=BATCH, max_len=MAX_LEN, uneven="repeat", shuffle_buffer=7)
    whole = [b["docs"].numpy() for b in wdsllm.loader(path, **options)]
    loader = wdsllm.loader(path, **options)
    it = iter(loader)
    head = [next(it)["docs"].numpy() for _ in range(len(whole) - 2)]
    state = loader.state_dict()
    loader.close()
    resumed = wdsllm.loader(path, **options)
    resumed.load_state_dict(state)
    rest = [b["docs"].numpy() for b in resumed]
    resumed.close()
    assert len(head) + len(rest) == len(whole)
    assert all(np.array_equal(a, b) for a, b in zip(head + rest, whole))


# ----------------------------------------------------------------------------------------------
# At most one short batch per rank: each worker's share is planned in whole batches


def _ids(batch: dict) -> list[int]:
    return batch["rows"].tolist() if "rows" in batch else batch["docs"][:, 0].tolist()


@pytest.mark.parametrize("sizes", [[5], [9, 4, 12], [17, 23, 8, 3], [40, 1]])
@pytest.mark.parametrize("world", [1, 2])
def test_a_rank_ends_with_at_most_one_short_batch(tmp_path, sizes, world):
    info = write_dataset(tmp_path, sizes, seed=len(sizes), max_len=30)
    seen: Counter = Counter()
    for rank in range(world):
        loader = wdsllm.loader(tmp_path, rank=rank, world_size=world, num_workers=2, _in_process=True, batch_size=8)
        expected = len(loader)
        sizes_out = []
        for batch in loader:
            sizes_out.append(len(batch["input_ids"]))
            seen.update(_ids(batch))
        assert len(sizes_out) == expected
        assert all(n == 8 for n in sizes_out[:-1]), sizes_out
        kept = wdsllm.loader(
            tmp_path, rank=rank, world_size=world, num_workers=2, _in_process=True, batch_size=8, drop_last=True
        )
        assert all(len(b["input_ids"]) == 8 for b in kept)
    assert max(seen.values()) == 1
    if world == 1:
        assert set(seen) == set(info["expect"])


def test_real_workers_end_a_rank_with_one_short_batch(tmp_path):
    info = write_dataset(tmp_path, [9, 4, 12], seed=1, max_len=30)
    loader = wdsllm.loader(tmp_path, num_workers=2, batch_size=8)
    expected = len(loader)
    batches = [_ids(b) for b in loader]
    loader.close()
    assert len(batches) == expected == 4
    assert [len(b) for b in batches] == [8, 8, 8, 1]
    assert sorted(i for b in batches for i in b) == sorted(info["expect"])


def test_a_resume_inside_the_last_worker_share_gives_the_same_batches(tmp_path):
    write_dataset(tmp_path, [17, 23, 8, 3], seed=2, max_len=30)
    options = dict(num_workers=2, _in_process=True, batch_size=8, shuffle_buffer=5, rank=1, world_size=2)
    whole = [_ids(b) for b in wdsllm.loader(tmp_path, **options)]
    for cut in range(1, len(whole)):
        loader = wdsllm.loader(tmp_path, **options)
        it = iter(loader)
        head = [_ids(next(it)) for _ in range(cut)]
        resumed = wdsllm.loader(tmp_path, **options)
        resumed.load_state_dict(loader.state_dict())
        assert head + [_ids(b) for b in resumed] == whole


def test_an_elastic_resume_ends_each_rank_with_at_most_one_short_batch(tmp_path):
    info = write_dataset(tmp_path, [17, 23, 8, 3, 30], seed=4, max_len=30)
    old = dict(num_workers=2, _in_process=True, batch_size=8, shuffle_buffer=5, world_size=2)
    first = wdsllm.loader(tmp_path, rank=0, **old)
    it = iter(first)
    seen = Counter(i for _ in range(3) for i in _ids(next(it)))
    state = first.state_dict()
    other = wdsllm.loader(tmp_path, rank=1, **old)
    it = iter(other)
    seen.update(i for _ in range(3) for i in _ids(next(it)))
    for rank in range(3):
        new = wdsllm.loader(
            tmp_path, rank=rank, world_size=3, num_workers=2, _in_process=True, batch_size=8, shuffle_buffer=5
        )
        new.load_state_dict(state)
        sizes = []
        for batch in new:
            sizes.append(len(batch["input_ids"]))
            seen.update(_ids(batch))
        assert all(n == 8 for n in sizes[:-1]), sizes
    assert max(seen.values()) == 1 and set(seen) <= set(info["expect"])
