"""What a careful trainer expects of the order (issue #32): the loader keeps out of torch's global
RNG, and the shuffle reshuffles at any shard count (epoch prefixes, rank shares)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from synth import all_ids, write_dataset

import wdsllm
from wdsllm.errors import StateError
from wdsllm.load import plan
from wdsllm.load import state as statemod


def _docs(batch: dict) -> list[int]:
    return batch["docs"][:, 0].tolist()


def test_iterating_a_loader_with_workers_leaves_torch_rng_alone(tmp_path):
    info = write_dataset(tmp_path, [20, 13, 9, 17])
    torch.manual_seed(5)
    before = torch.get_rng_state()
    loader = wdsllm.loader(str(tmp_path), batch_size=4, num_workers=2, shuffle_buffer=6)
    ids = [i for b in loader for i in _docs(b)]
    assert sorted(ids) == sorted(all_ids(info))
    assert torch.equal(torch.get_rng_state(), before)


def test_two_resumed_runs_give_identical_dropout(tmp_path):
    """A trainer restores torch's RNG, then resumes the loader: dropout must not depend on the loader."""
    write_dataset(tmp_path, [20, 13, 9, 17])

    def make() -> wdsllm.Loader:
        return wdsllm.loader(str(tmp_path), batch_size=4, num_workers=2, shuffle_buffer=6)

    first = make()
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    first.close()

    def resumed_run() -> tuple[list[list[int]], list[torch.Tensor]]:
        torch.manual_seed(11)
        loader = make()
        loader.load_state_dict(state)
        ids, masks = [], []
        for batch in loader:
            ids.append(_docs(batch))
            masks.append(torch.nn.functional.dropout(torch.ones(16), 0.5))
        loader.close()
        return ids, masks

    ids_a, masks_a = resumed_run()
    ids_b, masks_b = resumed_run()
    assert ids_a == ids_b and ids_a
    torch.manual_seed(11)
    alone = [torch.nn.functional.dropout(torch.ones(16), 0.5) for _ in masks_a]
    for a, b, c in zip(masks_a, masks_b, alone):
        assert torch.equal(a, b) and torch.equal(a, c)


# ----------------------------------------------------------------------------------------------
# The shuffle at one shard: blocks of the shard in an order reseeded each epoch


@pytest.fixture
def fine_blocks(monkeypatch):
    """Blocks of a few documents, as a shard of the default size is cut (its blocks are 2^18
    tokens; these documents are tens of tokens)."""
    monkeypatch.setattr(plan, "MIN_BLOCK_TOKENS", 64)


def _epoch_order(root, epoch: int, **kw) -> dict[tuple[int, int], list[int]]:
    """(rank, worker) -> documents in reading order, for every consumer of the layout."""
    world, workers = kw.pop("world", 1), kw.pop("workers", 0)
    out = {}
    for rank in range(world):
        pipe = wdsllm.dataset(str(root), batch_size=8, rank=rank, world_size=world, seed=3, **kw)
        pipe.set_epoch(epoch)
        for w in range(max(1, workers)):
            out[rank, w] = [i for b in pipe.worker_iter(w, max(1, workers)) for i in _docs(b)]
    return out


def prefix_overlap(first: list[int], second: list[int], share: float = 0.3) -> float:
    """The share of the first ``share`` of one order found in the first ``share`` of the other."""
    n = int(len(first) * share)
    return len(set(first[:n]) & set(second[:n])) / max(1, n)


def test_epoch_prefixes_overlap_as_independent_shuffles_do_at_one_shard(tmp_path, fine_blocks):
    info = write_dataset(tmp_path, [3000])
    orders = [_epoch_order(tmp_path, e)[0, 0] for e in range(3)]
    for order in orders:
        assert sorted(order) == sorted(all_ids(info)), "every document exactly once"
    for a, b in itertools.pairwise(orders):
        assert 0.22 < prefix_overlap(a, b) < 0.38  # independent shuffles: 0.30 (whole shards: 1.0)
    assert orders[0][:50] != orders[1][:50]


def test_rank_shares_move_between_epochs_with_one_shard(tmp_path, fine_blocks):
    info = write_dataset(tmp_path, [3000])
    shares = []
    for epoch in range(2):
        layout = _epoch_order(tmp_path, epoch, world=2, workers=2)
        ids = [i for docs in layout.values() for i in docs]
        assert sorted(ids) == sorted(all_ids(info)), "every document exactly once per epoch"
        shares.append(set(layout[0, 0]) | set(layout[0, 1]))
    kept = len(shares[0] & shares[1]) / len(shares[0])
    assert 0.35 < kept < 0.65  # a fresh split keeps about half of rank 0's documents (fixed: all)


def test_a_state_of_the_whole_shard_order_is_refused_where_blocks_cut_shards(tmp_path, fine_blocks):
    write_dataset(tmp_path, [400, 300])
    loader = wdsllm.loader(str(tmp_path), batch_size=8, num_workers=0)
    it = iter(loader)
    next(it)
    body = json.loads(loader.state_dict()["state"])
    body["version"] = 2  # what the previous wdsllm wrote
    old = statemod.seal(body)
    fresh = wdsllm.loader(str(tmp_path), batch_size=8, num_workers=0)
    with pytest.raises(StateError, match="earlier wdsllm"):
        fresh.load_state_dict(old)
    unshuffled = wdsllm.loader(str(tmp_path), batch_size=8, num_workers=0, shuffle=False)
    body_plain = json.loads(unshuffled.state_dict()["state"])
    body_plain["version"] = 2
    wdsllm.loader(str(tmp_path), batch_size=8, num_workers=0, shuffle=False).load_state_dict(
        statemod.seal(body_plain)
    )  # without a shuffle both orders agree: still resumed
