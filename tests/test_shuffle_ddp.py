"""The blocks-of-shards shuffle under real DDP (#32): torchrun, 2 gloo ranks x 2 DataLoader
workers over a dataset of one shard cut into blocks. Every document once per epoch across the
ranks, rank shares that move between epochs, and an interrupted epoch resumed exactly."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from synth import all_ids, write_dataset
from test_distributed import torchrun


@pytest.mark.timeout(300)
def test_one_shard_under_ddp_reshuffles_ranks_and_resumes_exactly(tmp_path):
    data = tmp_path / "ds"
    info = write_dataset(data, [3000], max_len=30)  # one shard: about 700 blocks of 64 tokens
    out = tmp_path / "out"
    out.mkdir()
    torchrun("ddp_blocks.py", 2, "--data", str(data), "--out", str(out), "--min-block-tokens", "64")
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    everything = sorted(all_ids(info))
    for epoch in range(2):
        seen = Counter(i for rep in reports for i in rep["epochs"][epoch])
        assert sorted(seen) == everything and max(seen.values()) == 1, "every document once per epoch"
    rank0 = [set(e) for e in reports[0]["epochs"]]
    kept = len(rank0[0] & rank0[1]) / len(rank0[0])
    assert 0.35 < kept < 0.65, kept  # rank 0 reads about half of last epoch's documents again (fixed: all)
    for rep in reports:
        assert rep["resumed"] == rep["epochs"][1], "the resumed epoch equals the uninterrupted one"
