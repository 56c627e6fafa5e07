"""One short batch per rank in every batching mode, with real DataLoader workers.

Every worker but a rank's last yields only full batches and hands the items it leaves out (its
tail) to the rank's last worker, which reads them after its own share (``load/handoff.py``): with
2 workers an epoch ends 8, 8, 8, 2, not 8, 8, 1, 1. Modes whose batches hold a number of items
(fixed, buckets of a batch size, the pieces of documents split at ``max_len``) plan the shares in
whole batches instead; token budgets, pack and concat cannot, and hand their tails over.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from synth import write_dataset

import wdsllm
from wdsllm.errors import StateError
from wdsllm.load.batching import BucketBatcher, ConcatBatcher, FixedBatcher, PackBatcher
from wdsllm.load.state import seal, unseal

MODES = {
    "pieces": dict(batch_size=4, max_len=8),
    "budget": dict(batching="bucket", max_tokens=160, window=400),
    "pack": dict(batching="pack", seq_len=32, batch_size=8, window=40),
    "concat": dict(batching="concat", seq_len=32, batch_size=3),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, Counter]:
    """Three shards of documents up to 60 tokens, and every token of them (a multiset)."""
    out = tmp_path_factory.mktemp("worker_batches")
    info = write_dataset(out, [23, 7, 31], max_len=60, seed=3)
    return str(out), Counter(np.concatenate(list(info["expect"].values())).tolist())


def _rows(batch: dict) -> list[np.ndarray]:
    """The real tokens of each row of a batch."""
    ids = batch["input_ids"].numpy()
    return [ids[i, : int(n)] for i, n in enumerate(batch["lengths"].tolist())]


def _epoch(path: str, **options) -> list[dict]:
    options = {"num_workers": 2, **options}
    loader = wdsllm.loader(path, shuffle_buffer=7, **options)
    expected = len(loader)
    batches = list(loader)
    loader.close()
    assert len(batches) == expected
    return batches


def _short(name: str, batch: dict, options: dict) -> bool:
    """A batch below the mode's full size (a token budget: one that leaves room for another item
    as long as its longest)."""
    rows = _rows(batch)
    if name == "budget":
        longest = max(len(r) for r in rows)
        return (len(rows) + 1) * longest <= options["max_tokens"]
    if name == "concat" and any(len(r) < options["seq_len"] for r in rows):
        return True
    return len(rows) < options["batch_size"]


@pytest.mark.parametrize("name", sorted(MODES))
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_end_the_epoch_with_one_short_batch_in_every_mode(corpus, name, workers):
    """2 real DataLoader workers; 3 run in this process (the same stages, the same split)."""
    path, tokens = corpus
    options = dict(MODES[name], num_workers=workers, _in_process=workers == 3)
    batches = _epoch(path, **options)
    got = Counter(t for b in batches for row in _rows(b) for t in row.tolist())
    assert got == tokens  # every token once: the tails were read, by the last worker only
    kept = _epoch(path, drop_last=True, **options)
    assert len(batches) - len(kept) <= 1  # drop_last drops one batch of the rank, not one per worker
    if name == "budget":  # a budget's batches of a window come shuffled: its final one anywhere in it
        dropped = got - Counter(t for b in kept for row in _rows(b) for t in row.tolist())
        assert sum(dropped.values()) <= MODES[name]["max_tokens"]
        return
    short = [i for i, b in enumerate(batches) if _short(name, b, MODES[name])]
    assert short in ([], [len(batches) - 1]), short
    assert not any(_short(name, b, MODES[name]) for b in kept)


@pytest.mark.parametrize("name", sorted(MODES))
def test_a_resume_inside_the_handed_tails_equals_the_uninterrupted_epoch(corpus, name):
    path, _ = corpus
    options = dict(MODES[name], rank=1, world_size=2, equal_batches=False)
    whole = [_rows(b) for b in _epoch(path, **options)]
    cut = len(whole) - 2  # the last worker's final batches hold the other worker's tail
    loader = wdsllm.loader(path, num_workers=2, shuffle_buffer=7, **options)
    it = iter(loader)
    head = [_rows(next(it)) for _ in range(cut)]
    state = loader.state_dict()
    loader.close()
    resumed = wdsllm.loader(path, num_workers=2, shuffle_buffer=7, **options)
    resumed.load_state_dict(state)
    rest = [_rows(b) for b in resumed]
    resumed.close()
    assert len(head) + len(rest) == len(whole)
    for a, b in zip(head + rest, whole):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["budget", "pieces"])
def test_a_state_saved_under_the_older_worker_split_is_refused(corpus, name):
    """Loader state version 3 split by documents and let every worker end short: its positions
    name other items under today's split, so it is refused by name, never resumed onto it."""
    path, _ = corpus
    for workers in (2, 1):
        options = dict(MODES[name], num_workers=workers, _in_process=True, shuffle_buffer=7)
        loader = wdsllm.loader(path, **options)
        it = iter(loader)
        next(it)
        body = unseal(loader.state_dict())
        want = [_rows(b) for b in it]
        loader.close()
        body["version"] = 3
        old = wdsllm.loader(path, **options)
        if workers == 2:
            with pytest.raises(StateError, match=r"earlier wdsllm \(state version 3\)"):
                old.load_state_dict(seal(body))
            continue
        old.load_state_dict(seal(body))  # one worker: the split is today's, and the state resumes exactly
        got = [_rows(b) for b in old]
        assert len(got) == len(want)
        assert all(np.array_equal(x, y) for a, b in zip(got, want) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "batcher",
    [
        FixedBatcher(5),
        BucketBatcher(40, batch_size=5),
        BucketBatcher(40, max_tokens=200),
        PackBatcher(30, seq_len=64, batch_size=3),
        ConcatBatcher(seq_len=64, batch_size=3),
    ],
    ids=["fixed", "bucket", "budget", "pack", "concat"],
)
def test_a_handing_workers_batches_and_its_tail_hold_every_item_once(batcher):
    """``handing()``'s batches and ``tail`` part the stream: what the one leaves out, the other
    names (concat: the tail's first item minus the tokens its last row already holds)."""
    rng = np.random.default_rng(7)
    spec = wdsllm.load.stream.StreamSpec(seed=1, epoch=0, rank=0, world=1, worker=0, workers=2)
    for _ in range(40):
        lengths = rng.integers(1, 64, int(rng.integers(0, 200)))
        handing = batcher.handing()
        batches = list(handing.dry_batches(lengths, spec))
        assert len(batches) == handing.count(len(lengths), lengths)
        tail, lead = batcher.tail(lengths, spec)
        if isinstance(batcher, ConcatBatcher):  # rows hold tokens: the tail is what follows the last full batch
            kept = len(batches) * batcher.batch_size * batcher.seq_len
            assert int(lengths[tail].sum()) - lead == int(lengths.sum()) - kept
            continue
        used = np.concatenate(batches) if batches else np.zeros(0, np.int64)
        assert lead == 0 and sorted(used.tolist() + tail.tolist()) == list(range(len(lengths)))


def test_the_last_worker_finds_the_tails_only_when_its_stream_reaches_them(corpus, monkeypatch):
    """Finding the other workers' tails is a pass over their lengths: the last worker's plan is
    made without it (``handoff.StreamSlices``), and its stream asks for them after its own share."""
    from wdsllm.load import handoff

    path, _ = corpus
    calls = []
    real = handoff.worker_tail
    monkeypatch.setattr(handoff, "worker_tail", lambda *a: calls.append(1) or real(*a))
    pipe = wdsllm.dataset(path, shuffle_buffer=7, **MODES["pack"])
    reading = handoff.stream_slices(pipe.catalog, pipe.cfg, pipe.cfg.spec(0, 0, 1, 1, 2))
    own = list(reading.own)
    assert calls == [] and own
    assert list(reading)[: len(own)] == own and calls == [1]
    assert len(reading.whole()) > len(own) and calls == [1]  # found once
