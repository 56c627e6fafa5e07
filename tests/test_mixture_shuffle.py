"""A mixture reshuffles at any shard count (#32): each source's passes visit its shards cut into
blocks, in an order reseeded per pass, so a mixture of one-shard sources starts each epoch
elsewhere and its rank shares move, with exactly-once, subsets and resume kept (#31: a state of
the whole-shard order is refused by name where the orders differ).

Real tars and indexes (tests/synth.py); blocks of a few documents, as a shard of the default size
is cut (its blocks hold 2^18 tokens; these documents hold tens).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
from synth import write_dataset

import wdsllm
from wdsllm.errors import StateError
from wdsllm.load import plan
from wdsllm.load import state as statemod


@pytest.fixture
def fine_blocks(monkeypatch):
    monkeypatch.setattr(plan, "MIN_BLOCK_TOKENS", 64)


@pytest.fixture(scope="module")
def one_shard_sources(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("mix-shuffle")
    write_dataset(d / "a", [1200], seed=1, max_len=20)
    write_dataset(d / "b", [600], seed=2, max_len=60)
    return {"a": str(d / "a"), "b": str(d / "b")}


def _whole_passes(sources) -> wdsllm.Mixture:
    """Each epoch takes each source once: quotas equal to the sources' sizes."""
    return wdsllm.Mixture(sources, weights={"a": 2, "b": 1}, unit="items", epoch_items=1800)


#: a shuffle buffer far below the epoch, as a real corpus's is
SHUFFLE = 100


def _orders(mix, epoch: int, world: int = 1, workers: int = 1) -> dict[tuple[int, int], list[tuple[int, int]]]:
    out = {}
    for rank in range(world):
        pipe = wdsllm.dataset(
            mix, batch_size=8, rank=rank, world_size=world, seed=3, equal_batches=False, shuffle_buffer=SHUFFLE
        )
        pipe.set_epoch(epoch)
        for w in range(workers):
            out[rank, w] = [tuple(d) for b in pipe.worker_iter(w, workers) for d in b["docs"].tolist()]
    return out


def prefix_overlap(first: list, second: list, share: float = 0.3) -> float:
    n = int(len(first) * share)
    return len(set(first[:n]) & set(second[:n])) / max(1, n)


def test_a_mixture_of_one_shard_sources_reshuffles_each_epoch(one_shard_sources, fine_blocks):
    mix = _whole_passes(one_shard_sources)
    orders = [_orders(mix, e)[0, 0] for e in range(3)]
    for order in orders:
        assert len(order) == 1800 and len(set(order)) == 1800, "every document exactly once per epoch"
    for a, b in itertools.pairwise(orders):
        assert 0.22 < prefix_overlap(a, b) < 0.38  # independent shuffles: 0.30 (whole shards: about 1)


def test_a_mixtures_rank_shares_move_between_epochs(one_shard_sources, fine_blocks):
    mix = _whole_passes(one_shard_sources)
    shares = []
    for epoch in range(2):
        layout = _orders(mix, epoch, world=2, workers=2)
        every = [d for docs in layout.values() for d in docs]
        assert len(every) == 1800 and len(set(every)) == 1800, "every document once across the ranks"
        shares.append(set(layout[0, 0]) | set(layout[0, 1]))
    kept = len(shares[0] & shares[1]) / len(shares[0])
    assert 0.35 < kept < 0.65  # a fresh split keeps about half of rank 0's documents (fixed: all)


def test_subsets_cut_into_blocks_show_no_document_twice_per_epoch(one_shard_sources, fine_blocks):
    """About 0.6 of each source per epoch: epochs run across the end of a pass into the next."""
    mix = wdsllm.Mixture(one_shard_sources, weights={"a": 2, "b": 1}, unit="items", epoch_items=1080)
    seen: Counter = Counter()
    for epoch in range(4):
        docs = Counter(d for docs in _orders(mix, epoch, world=2, workers=2).values() for d in docs)
        assert max(docs.values()) == 1 and sum(docs.values()) == 1080
        seen.update(docs)
    assert len(seen) == 1800  # four epochs of 0.6 walk both sources whole


def test_a_resumed_mixture_with_blocks_equals_the_uninterrupted_one(one_shard_sources, fine_blocks):
    mix = wdsllm.Mixture(one_shard_sources, weights={"a": 1, "b": 1}, epoch_tokens=40_000)
    kw = dict(batch_size=8, seed=3, rank=1, world_size=2, num_workers=2, _in_process=True, shuffle_buffer=64)
    full = [b["docs"].tolist() for b in wdsllm.loader(mix, **kw)]
    first = wdsllm.loader(mix, **kw)
    it = iter(first)
    got = [next(it)["docs"].tolist() for _ in range(len(full) // 2)]
    state = first.state_dict()
    first.close()
    second = wdsllm.loader(mix, **kw)
    second.load_state_dict(state)
    assert got + [b["docs"].tolist() for b in second] == full


def _mixture_state(mix, **kw) -> dict:
    loader = wdsllm.loader(mix, batch_size=8, num_workers=0, seed=3, **kw)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    return state


def _as_version(state: dict, version: int) -> dict:
    body = json.loads(state["state"])
    body["version"] = version
    return statemod.seal(body)


def test_a_mixture_state_of_the_whole_shard_order_is_refused_by_name(one_shard_sources, fine_blocks):
    mix = _whole_passes(one_shard_sources)
    old = _as_version(_mixture_state(mix), statemod.MIX_BLOCK_ORDER_VERSIONS[statemod.LOADER_KIND] - 1)
    with pytest.raises(StateError, match="mixture.*whole shards"):
        wdsllm.loader(mix, batch_size=8, num_workers=0, seed=3).load_state_dict(old)


def test_a_mixture_state_of_the_whole_shard_order_resumes_where_the_orders_agree(one_shard_sources):
    """Sources of one block per shard (the default block size over these small shards): the same
    order either way, so the older state resumes."""
    mix = _whole_passes(one_shard_sources)
    old = _as_version(_mixture_state(mix), statemod.MIX_BLOCK_ORDER_VERSIONS[statemod.LOADER_KIND] - 1)
    loader = wdsllm.loader(mix, batch_size=8, num_workers=0, seed=3)
    loader.load_state_dict(old)
    assert next(iter(loader))["docs"].shape[0] == 8
