"""Hugging Face ``datasets`` reads the shards with the ``data_files`` pattern docs/format.md gives
(issue #17): ``data_dir=`` would also open index.json and the side files as tars."""

from __future__ import annotations

import numpy as np
import pytest
from datasets import load_dataset
from pack_helpers import SHAKESPEARE, cached, groups, load_index, pack_api


def _packed():
    def build(d):
        text = d / "head.txt"
        text.write_bytes(SHAKESPEARE.read_bytes()[:30_000])
        pack_api([text], d / "ds", shard_size=16 << 10, sample_tokens=1024)
        return d / "ds"

    return cached("hf-datasets", build)


@pytest.mark.parametrize("streaming", [False, True])
def test_load_dataset_webdataset_with_the_documented_data_files(tmp_path, monkeypatch, streaming):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ds = _packed()
    index = load_index(ds)
    assert len(index.shards) > 1
    hf = load_dataset(
        "webdataset",
        data_files={"train": str(ds / "*.tar")},
        split="train",
        streaming=streaming,
        cache_dir=str(tmp_path / "cache"),
    )
    rows = list(hf)
    want = groups(ds)
    assert len(rows) == len(want) == index.totals()["samples"]  # one row per tar sample: a group of documents
    got = {row["__key__"]: row for row in rows}
    for group in want:
        row = got[group.key]
        assert np.array_equal(np.asarray(row["tokens.npy"]), group.tokens)
        assert np.array_equal(np.asarray(row["lengths.npy"]), group.lengths)
        assert row["json"]["documents"] == group.documents
