"""Behaviour is pinned: the digest of every batch of a broad matrix of loader configurations is
compared with digests recorded before a change (tests/data/batch_digests.json).

A refactor must leave every batch bit-identical: same tokens, same order, same metadata. The
matrix covers every batching mode on docs and packed datasets (synthetic and packed from a real
corpus with a real tokenizer), ranks and simulated or real DataLoader workers, two epochs, exact
and elastic resumption, endless and resampled streams, and ``wdsllm.dataset`` one item at a time.

To record new digests after an intended change of output, run
``WDSLLM_UPDATE_DIGESTS=1 python -m pytest tests/test_batch_digests.py`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from pack_helpers import SHAKESPEARE, cached, pack_api
from synth import write_dataset

import wdsllm

DIGESTS = Path(__file__).parent / "data" / "batch_digests.json"
UPDATE = os.environ.get("WDSLLM_UPDATE_DIGESTS") == "1"


def batch_digest(batch: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(batch):
        value = batch[key]
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.contiguous().numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:16]


def _datasets() -> dict[str, Path]:
    def synth_docs(d: Path) -> Path:
        write_dataset(d, [13, 7, 25, 1, 18], seed=3, max_len=30)
        return d

    def synth_packed(d: Path) -> Path:
        write_dataset(d, [9, 4, 12], seed=4, mode="packed", seq_len=16, max_len=40)
        return d

    def excerpt(d: Path) -> Path:
        path = d / "shakespeare-head.txt"
        path.write_bytes(SHAKESPEARE.read_bytes()[:60_000])
        return path

    def real_docs(d: Path) -> Path:
        pack_api([excerpt(d)], d / "ds", split="paragraph", shard_size=12 << 10, sample_tokens=1024)
        return d / "ds"

    def real_packed(d: Path) -> Path:
        pack_api([excerpt(d)], d / "ds", mode="packed", seq_len=64, shard_size=12 << 10, sample_tokens=1024)
        return d / "ds"

    return {
        "synth_docs": cached("digest-synth-docs", synth_docs),
        "synth_packed": cached("digest-synth-packed", synth_packed),
        "real_docs": cached("digest-real-docs", real_docs),
        "real_packed": cached("digest-real-packed", real_packed),
    }


DOC_MODES = {
    "fixed": dict(batch_size=4),
    "fixed_droplast": dict(batch_size=4, drop_last=True),
    "split": dict(batch_size=4, max_len=9),
    "truncate": dict(batch_size=4, max_len=9, max_len_mode="truncate"),
    "bucket": dict(batching="bucket", batch_size=4, window=11),
    "budget": dict(batching="bucket", max_tokens=96, window=13, batch_size=None, pad_to_multiple_of=8),
    "pack": dict(batching="pack", seq_len=32, window=9, batch_size=3),
    "concat": dict(batching="concat", seq_len=32, batch_size=3, boundaries=True),
}
PACKED_MODES = {
    "rows": dict(batch_size=3),
    "rows_boundaries": dict(batch_size=3, boundaries=True),
}


def _make(ds: Path, rank: int = 0, world: int = 1, workers: int = 0, **kw):
    kw.setdefault("seed", 5)
    kw.setdefault("shuffle_buffer", 6)
    return wdsllm.loader(ds, rank=rank, world_size=world, num_workers=workers, _in_process=True, **kw)


def _epochs(loader, epochs=(0, 1)) -> list[str]:
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out.extend(batch_digest(b) for b in loader)
    return out


def _resume(ds: Path, rank: int, world: int, workers: int, kw: dict) -> list[str]:
    full = _make(ds, rank, world, workers, **kw)
    n = len(full)
    it = iter(full)
    head = [batch_digest(next(it)) for _ in range(n // 2)]
    state = json.loads(json.dumps(full.state_dict()))
    second = _make(ds, rank, world, workers, **kw)
    second.load_state_dict(state)
    return head + ["|"] + [batch_digest(b) for b in second]


def _elastic(ds: Path, kw: dict) -> list[str]:
    old = _make(ds, 0, 2, 2, **kw)
    it = iter(old)
    for _ in range(len(old) // 3):
        next(it)
    state = json.loads(json.dumps(old.state_dict()))
    out = []
    for rank in range(3):
        new = _make(ds, rank, 3, 1, **kw)
        new.load_state_dict(state)
        out += [f"r{rank}"] + [batch_digest(b) for b in new]
    return out


def _scenarios() -> dict[str, callable]:
    ds = _datasets()
    out: dict[str, callable] = {}
    for dname in ("synth_docs", "real_docs"):
        for mode, kw in DOC_MODES.items():
            out[f"{dname}/{mode}/w1"] = lambda d=ds[dname], kw=kw: _epochs(_make(d, **kw))
            out[f"{dname}/{mode}/r1of2x3"] = lambda d=ds[dname], kw=kw: _epochs(_make(d, 1, 2, 3, **kw))
            out[f"{dname}/{mode}/resume"] = lambda d=ds[dname], kw=kw: _resume(d, 0, 2, 2, kw)
        out[f"{dname}/fixed/elastic"] = lambda d=ds[dname]: _elastic(d, DOC_MODES["fixed"])
        out[f"{dname}/budget/elastic"] = lambda d=ds[dname]: _elastic(d, DOC_MODES["budget"])
    for dname in ("synth_packed", "real_packed"):
        for mode, kw in PACKED_MODES.items():
            out[f"{dname}/{mode}/w1"] = lambda d=ds[dname], kw=kw: _epochs(_make(d, **kw))
            out[f"{dname}/{mode}/r0of3x2"] = lambda d=ds[dname], kw=kw: _epochs(_make(d, 0, 3, 2, **kw))
            out[f"{dname}/{mode}/resume"] = lambda d=ds[dname], kw=kw: _resume(d, 1, 2, 2, kw)
        out[f"{dname}/rows/elastic"] = lambda d=ds[dname]: _elastic(d, PACKED_MODES["rows"])
        out[f"{dname}/nodocs"] = lambda d=ds[dname]: _epochs(_make(d, batch_size=3, docs=False))

    def endless(d=ds["synth_docs"]) -> list[str]:
        loader = _make(d, batch_size=4, epochs=None)
        return [batch_digest(b) for _, b in zip(range(40), loader)]

    def resampled(d=ds["real_docs"]) -> list[str]:
        loader = _make(d, 1, 2, 2, batch_size=4, resample=True, steps_per_epoch=7)
        return [batch_digest(b) for _ in range(2) for b in loader]

    def real_workers(d=ds["real_docs"]) -> list[str]:
        loader = wdsllm.loader(d, batch_size=4, num_workers=2, seed=5, shuffle_buffer=6, batching="bucket", window=11)
        return [batch_digest(b) for b in loader]

    def real_workers_packed(d=ds["real_packed"]) -> list[str]:
        loader = wdsllm.loader(d, batch_size=3, num_workers=2, seed=5, boundaries=True)
        return [batch_digest(b) for b in loader]

    def one_by_one(d=ds["synth_docs"]) -> list[str]:
        pipe = wdsllm.dataset(d, batch_size=None, seed=5, shuffle_buffer=6, max_len=9)
        return [batch_digest(b) for b in pipe]

    def dataset_workers(d=ds["real_docs"]) -> list[str]:
        pipe = wdsllm.dataset(d, batch_size=4, seed=5, batching="pack", seq_len=32, window=9, rank=1, world_size=2)
        return [batch_digest(b) for w in range(2) for b in pipe.worker_iter(w, 2)]

    out.update(
        endless=endless,
        resampled=resampled,
        real_workers=real_workers,
        real_workers_packed=real_workers_packed,
        one_by_one=one_by_one,
        dataset_workers=dataset_workers,
    )
    return out


def _combined(digests: list[str]) -> str:
    """Batches and one digest of them all (the file stays small; a mismatch names the scenario)."""
    return f"{len(digests)}:" + hashlib.sha256(" ".join(digests).encode()).hexdigest()[:24]


@pytest.mark.slow
def test_every_batch_is_bit_identical_to_the_recorded_digests():
    got = {name: run() for name, run in sorted(_scenarios().items())}
    assert all(len(v) > 0 for v in got.values()), [k for k, v in got.items() if not v]
    got = {name: _combined(digests) for name, digests in got.items()}
    if UPDATE or not DIGESTS.exists():
        DIGESTS.parent.mkdir(exist_ok=True)
        DIGESTS.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
        if not UPDATE:
            pytest.fail(f"{DIGESTS} did not exist; recorded it now (commit it)")
        return
    want = json.loads(DIGESTS.read_text())
    assert sorted(got) == sorted(want)
    differ = sorted(k for k in got if got[k] != want[k])
    assert not differ, f"batches differ in {differ}"
