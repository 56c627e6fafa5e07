"""What a careful trainer expects of the order (issue #32): the loader keeps out of torch's global
RNG, and the shuffle reshuffles at any shard count (epoch prefixes, rank shares)."""

from __future__ import annotations

import torch
from synth import all_ids, write_dataset

import wdsllm


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
