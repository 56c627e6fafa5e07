"""Ranks split by what they yield: with documents split at max_len, by pieces, so ranks differ by
at most one piece (a share may start or stop inside a document), under a real torchrun of 2 and
3 gloo ranks with 2 DataLoader workers each."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from synth import write_dataset
from test_distributed import torchrun

MAX_LEN, BATCH = 8, 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_differ_by_at_most_one_piece_and_each_ends_with_one_short_batch(tmp_path, world):
    data = tmp_path / "ds"
    info = write_dataset(data, [23, 7, 31, 2, 18, 11, 9], max_len=60, seed=3)
    pieces = {(doc, p) for doc, toks in info["expect"].items() for p in range(-(-len(toks) // MAX_LEN))}
    out = tmp_path / "out"
    out.mkdir()
    torchrun("rank_pieces.py", world, "--data", str(data), "--out", str(out), "--workers", "2")
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]

    free = [rep["free"] for rep in reports]
    seen = Counter(tuple(p) for run in free for p in run["pieces"])
    assert set(seen) == pieces and max(seen.values()) == 1  # every piece once across the ranks
    per_rank = [len(run["pieces"]) for run in free]
    assert max(per_rank) - min(per_rank) <= 1, per_rank
    for run in free:
        assert run["len"] == len(run["sizes"])
        assert all(n == BATCH for n in run["sizes"][:-1]), run["sizes"]  # 2 workers, one short batch

    equal = [rep["equal"] for rep in reports]
    assert len({len(run["sizes"]) for run in equal}) == 1  # and the collective per step never hung
    seen = Counter(tuple(p) for run in equal for p in run["pieces"])
    assert max(seen.values()) == 1
    dropped = sum(run["dropped"] for run in equal)
    assert dropped <= world - 1  # ranks a piece apart: at most a batch over on each longer rank
    assert len(pieces) - len(seen) <= dropped * BATCH
