"""A mixture resumed on another world size keeps its mix on every rank (#31).

Two real sources (real tars, real indexes) of short and long documents, mixed 50/50, are read
on 2 ranks, saved, and resumed on 3: the remainder is re-planned per source, so each new rank
holds each source's share, and no more is dropped than a fresh 3-rank run drops.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from synth import write_dataset

import wdsllm


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("mix-elastic")
    write_dataset(d / "short", [40] * 10, seed=1, max_len=20)
    write_dataset(d / "long", [40] * 10, seed=2, max_len=120)
    return {"short": str(d / "short"), "long": str(d / "long")}


def _docs(batch: dict) -> list[tuple]:
    return [tuple(x) for x in batch["docs"].tolist()]


def _save_on_two_ranks(mix, kw: dict, batches: int) -> tuple[Counter, dict]:
    consumed: Counter = Counter()
    state = None
    for r in range(2):
        ld = wdsllm.loader(mix, rank=r, world_size=2, num_workers=2, **kw)
        it = iter(ld)
        for _ in range(batches):
            consumed.update(_docs(next(it)))
        state = state or ld.state_dict()
    return consumed, state


def _whole_epoch(mix, kw: dict) -> Counter:
    return Counter(d for b in wdsllm.loader(mix, rank=0, world_size=1, **kw) for d in _docs(b))


def test_stratified_mix_resumed_on_three_ranks_keeps_every_batch_half_and_half(two_sources):
    mix = wdsllm.Mixture(
        two_sources, weights={"short": 0.5, "long": 0.5}, unit="items", epoch_items=800, stratified=True
    )
    kw = dict(batch_size=8, seed=5, _in_process=True, shuffle_buffer=256)
    consumed, state = _save_on_two_ranks(mix, kw, 5)
    rest: Counter = Counter()
    for r in range(3):
        ld = wdsllm.loader(mix, rank=r, world_size=3, num_workers=2, **kw)
        ld.load_state_dict(state)
        for b in ld:
            rest.update(_docs(b))
            assert np.bincount(b["sources"].numpy(), minlength=2).tolist() == [4, 4]
    assert consumed + rest == _whole_epoch(mix, kw)


def test_token_budget_mix_resumed_on_three_ranks_drops_no_more_than_a_fresh_run(two_sources):
    mix = wdsllm.Mixture(two_sources, weights={"short": 0.5, "long": 0.5}, unit="items", epoch_items=800)
    kw = dict(batching="bucket", max_tokens=512, window=32, batch_size=None, seed=5, _in_process=True)
    kw["shuffle_buffer"] = 256
    whole = _whole_epoch(mix, kw)
    consumed, state = _save_on_two_ranks(mix, kw, 5)
    fresh: Counter = Counter()
    for r in range(3):
        fresh.update(d for b in wdsllm.loader(mix, rank=r, world_size=3, num_workers=2, **kw) for d in _docs(b))
    rest: Counter = Counter()
    per_rank = []
    for r in range(3):
        for equal in (True, False):
            ld = wdsllm.loader(mix, rank=r, world_size=3, num_workers=2, equal_batches=equal, **kw)
            ld.load_state_dict(state)
            batches = list(ld)
            if equal:
                rest.update(d for b in batches for d in _docs(b))
            else:  # every remaining item: each source's remainder is split evenly among the ranks
                per_rank.append(np.bincount(np.concatenate([b["sources"].numpy() for b in batches]), minlength=2))
    assert not (consumed + rest) - whole  # nothing twice, nothing foreign
    assert sum((whole - consumed - rest).values()) <= sum((whole - fresh).values())
    per_rank = np.array(per_rank)
    assert (per_rank.max(axis=0) - per_rank.min(axis=0)).max() <= 1, per_rank


@pytest.mark.parametrize("unit", ["items", "tokens"])
def test_a_subset_shows_no_document_twice_in_an_epoch_that_crosses_a_pass(two_sources, unit):
    """Each source holds 400 documents and gets about 240 an epoch: epochs 1, 3 and 4 take the
    end of one pass and the start of the next, whose order is fresh."""
    if unit == "items":
        mix = wdsllm.Mixture(two_sources, weights={"short": 0.5, "long": 0.5}, unit="items", epoch_items=480)
    else:
        mix = wdsllm.Mixture(two_sources, weights={"short": 0.2, "long": 0.8}, unit="tokens", epoch_tokens=19_000)
    pipe = wdsllm.dataset(mix, batch_size=8, seed=3, rank=0, world_size=1)
    seen: Counter = Counter()
    for epoch in range(5):
        pipe.set_epoch(epoch)
        docs = Counter(d for b in pipe.worker_iter(0, 1) for d in _docs(b))
        assert max(docs.values()) == 1, f"epoch {epoch}: {[d for d, c in docs.items() if c > 1][:5]}"
        seen.update(docs)
    # the walk goes on: over five epochs every document is seen, none more than once per pass
    assert len(seen) == 800
