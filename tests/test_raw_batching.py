"""Every batching mode over raw text with a count sidecar, as over a packed dataset (#31): the
sidecar gives ``len()`` before anything is read, on one rank and on two, and the batches come."""

from __future__ import annotations

from collections import Counter

import pytest
from pack_helpers import GPT2, cli, wiki_lines

import wdsllm
from wdsllm import RawTextSource
from wdsllm.load.block import split_id

MODES = {
    "fixed": dict(batch_size=4),
    "bucket": dict(batching="bucket", batch_size=4, window=32),
    "budget": dict(batching="bucket", max_tokens=2048, window=32, batch_size=None),
    "pack": dict(batching="pack", seq_len=256, window=16, batch_size=2),
    "concat": dict(batching="concat", seq_len=256, batch_size=2),
}


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    """A plain jsonl of 80 wiki articles in byte-range units, and its count sidecar."""
    d = tmp_path_factory.mktemp("raw-batching")
    (d / "wiki.jsonl").write_text("\n".join(wiki_lines(80)) + "\n", encoding="utf-8")
    inputs = [str(d / "wiki.jsonl")]
    counts = str(d / "counts.npz")
    cli("count", *inputs, "-t", str(GPT2), "--unit-bytes", "15000", "-o", counts)
    return {"inputs": inputs, "counts": counts}


def _documents(batches: list[dict], rows: bool) -> list[int]:
    """Line numbers of the documents batches hold (rows: each document once however many rows
    it spans, by the ``docs`` [B, D] of each row)."""
    if not rows:
        return [split_id(d)[1] for b in batches for d in b["docs"][:, 0].tolist()]
    ids = {d for b in batches for d in b["docs"].flatten().tolist() if d >= 0}
    return [split_id(d)[1] for d in ids]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_batching_mode_over_raw_text_with_a_sidecar(counted, mode, world):
    documents: Counter = Counter()
    for rank in range(world):
        for equal in (True, False) if world > 1 else (False,):  # one rank: nothing to equalise
            source = RawTextSource(counted["inputs"], tokenizer=str(GPT2), unit_bytes=15_000, counts=counted["counts"])
            loader = wdsllm.loader(
                source,
                seed=1,
                rank=rank,
                world_size=world,
                num_workers=2,
                equal_batches=equal,
                _in_process=True,
                **MODES[mode],
            )
            expected = len(loader)
            batches = list(loader)
            assert len(batches) == expected > 0
            if not equal:
                documents.update(_documents(batches, rows=mode in ("pack", "concat")))
    if mode in ("fixed", "bucket", "budget"):  # whole documents: each exactly once across the ranks
        assert sorted(documents.values()) == [1] * len(documents) and len(documents) >= 76
    else:  # rows cut documents: every document shows up, none beyond the input
        assert len(documents) >= 76
