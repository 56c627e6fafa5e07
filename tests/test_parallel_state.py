"""One state per data-parallel coordinate: a resume that changes the parallel layout continues
the epoch with every document exactly once. In one process: a layout's state depends on its
data-parallel coordinates alone (replica peers yield the same batches), so each rank of the
layout is a loader given its coordinates by hand (``rank=``, ``cp_rank=``, ``pp_stage=``); the
torchrun test of dp2 x tp2 -> dp4 is in test_parallel_layouts.py."""

from __future__ import annotations

from collections import Counter

import pytest
from synth import write_dataset

import wdsllm

KW = {"batch_size": 3, "pad_to_multiple_of": 4, "seed": 7, "shuffle_buffer": 16}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("state") / "ds"
    info = write_dataset(root, [12, 12, 12, 12], max_len=30, seed=3)
    return root, sorted(info["expect"])


def _run(loader, steps: int | None = None) -> tuple[list[int], dict | None]:
    """The documents of ``steps`` batches (all if None), and the state after them."""
    docs, it = [], iter(loader)
    for step, batch in enumerate(it):
        docs.extend(batch["docs"][:, 0].tolist())
        if steps is not None and step + 1 == steps:
            return docs, loader.state_dict()
    return docs, None


def _exactly_once(parts: list[list[int]], expect: list[int]) -> None:
    seen = Counter(d for part in parts for d in part)
    assert max(seen.values()) == 1, "a document came twice"
    assert sorted(seen) == expect, "a document was lost"


def test_dp4_resumes_as_dp2_cp2(data):
    root, expect = data
    first = [_run(wdsllm.loader(root, rank=r, world_size=4, **KW), steps=2) for r in range(4)]
    state = first[0][1]
    rest = {}
    for dp in range(2):
        peers = []
        for cp in range(2):
            ld = wdsllm.loader(root, rank=dp, world_size=2, cp_rank=cp, cp_size=2, **KW)
            ld.load_state_dict(state)
            peers.append(_run(ld)[0])
        assert peers[0] == peers[1], "context-parallel peers resume on the same batches"
        rest[dp] = peers[0]
    assert len(rest[0]) == len(rest[1])
    _exactly_once([d for d, _ in first] + list(rest.values()), expect)


def test_dp2_pp2_resumes_as_dp2(data):
    root, expect = data
    first, states = [], {}
    for dp in range(2):
        for stage in range(2):
            ld = wdsllm.loader(root, rank=dp, world_size=2, pp_stage=stage, pp_stages=2, **KW)
            docs, state = _run(ld, steps=3)
            states.setdefault(dp, state)
            assert state == states[dp], "pipeline stages of one data-parallel rank hold one state"
            first.append(docs)
    assert first[0] == first[1] and first[2] == first[3], "both stages carry the batch's docs"
    rest = []
    for dp in range(2):
        ld = wdsllm.loader(root, rank=dp, world_size=2, **KW)
        ld.load_state_dict(states[dp])
        rest.append(_run(ld)[0])
    _exactly_once([first[0], first[2], *rest], expect)
