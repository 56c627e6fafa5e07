"""Local shards stay mapped between reads (MapCache), and a rewritten shard is never read through
an old mapping."""

from __future__ import annotations

import os

import numpy as np
from synth import write_dataset

import wdsllm
from wdsllm.format import tar as tario


def _rows(path) -> dict[int, list[int]]:
    out = {}
    for b in wdsllm.loader(str(path), batch_size=4, seed=0):
        for r, row in enumerate(b["rows"].tolist()):
            out[row] = b["input_ids"][r, : int(b["lengths"][r])].tolist()
    return out


def test_a_shard_read_again_reuses_its_mapping(tmp_path):
    write_dataset(tmp_path, [6], mode="packed", seq_len=16)
    shard = next(tmp_path.glob("*.tar"))
    with open(shard, "rb") as a, open(shard, "rb") as b:
        assert tario.mapped(a).mm is tario.mapped(b).mm


def test_a_rewritten_dataset_is_read_fresh(tmp_path):
    info = write_dataset(tmp_path, [6, 4], mode="packed", seq_len=16, seed=0)
    assert _rows(tmp_path) == {k: v.astype(np.int64).tolist() for k, v in info["expect"].items()}
    # rewrite every shard in place (same inode, other tokens), then as new files (new inodes)
    info = write_dataset(tmp_path, [6, 4], mode="packed", seq_len=16, seed=5)
    assert _rows(tmp_path) == {k: v.astype(np.int64).tolist() for k, v in info["expect"].items()}
    staging = tmp_path / "staging"
    info = write_dataset(staging, [6, 4], mode="packed", seq_len=16, seed=9)
    for f in staging.iterdir():
        os.replace(f, tmp_path / f.name)
    assert _rows(tmp_path) == {k: v.astype(np.int64).tolist() for k, v in info["expect"].items()}


def test_the_cache_is_bounded():
    cache = tario.MapCache(shards=2, max_bytes=1 << 30)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        files = []
        for i in range(4):
            p = os.path.join(d, f"{i}.bin")
            with open(p, "wb") as f:
                f.write(bytes([i]) * 4096)
            files.append(p)
        for p in files:
            with open(p, "rb") as f:
                cache.get(f.fileno(), os.fstat(f.fileno()))
        assert len(cache.maps) == 2
        big = tario.MapCache(shards=8, max_bytes=4096 * 2)
        for p in files:
            with open(p, "rb") as f:
                assert bytes(big.get(f.fileno(), os.fstat(f.fileno()))[:1]) == bytes([files.index(p)])
        assert sum(len(m) for m in big.maps.values()) <= 4096 * 2
