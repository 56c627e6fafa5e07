"""Batches from DataLoader workers through the shared-memory token ring (transport.py): the same
batches as in one process, under fork and spawn, with bundles too large for a slot, and after
epochs abandoned halfway, with persistent workers or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synth import write_dataset

import wdsllm
from wdsllm.load import transport


def _flat(batches) -> list:
    return [(k, v.tolist() if isinstance(v, torch.Tensor) else v) for b in batches for k, v in sorted(b.items())]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    path = tmp_path_factory.mktemp("packed")
    write_dataset(path, [9, 7, 6], mode="packed", seq_len=16, max_len=40, rows_per_group=2)
    return str(path)


def _epoch(loader, epoch: int, limit: int | None = None) -> list:
    loader.set_epoch(epoch)
    out = []
    for b in loader:
        out.append(b)
        if limit is not None and len(out) >= limit:
            break
    return out


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_send_the_batches_one_process_makes(packed, context):
    kw = dict(batch_size=3, seed=4, boundaries=True, max_segments=16)
    want = [_flat(_epoch(wdsllm.loader(packed, num_workers=2, _in_process=True, **kw), e)) for e in (0, 1)]
    loader = wdsllm.loader(packed, num_workers=2, persistent_workers=True, multiprocessing_context=context, **kw)
    assert [_flat(_epoch(loader, e)) for e in (0, 1)] == want


def test_bundles_larger_than_a_slot_are_pickled(packed, monkeypatch):
    kw = dict(batch_size=3, seed=5)
    want = _flat(_epoch(wdsllm.loader(packed, num_workers=2, _in_process=True, **kw), 0))
    loader = wdsllm.loader(packed, num_workers=2, **kw)
    ring_sizes = []
    orig = transport.TokenRing.__init__

    def small_slots(self, workers, slots, slot_bytes=transport.SLOT_BYTES):
        orig(self, workers, slots, 64)  # 64 bytes: smaller than any bundle
        ring_sizes.append(self.slot_bytes)

    monkeypatch.setattr(transport.TokenRing, "__init__", small_slots)
    assert _flat(_epoch(loader, 0)) == want and ring_sizes == [64]


@pytest.mark.parametrize("persistent", [True, False])
def test_abandoned_epochs_do_not_stall_the_next(packed, persistent):
    kw = dict(batch_size=2, seed=6, prefetch_factor=1)
    want = [_flat(_epoch(wdsllm.loader(packed, num_workers=2, _in_process=True, **kw), e)) for e in range(4)]
    loader = wdsllm.loader(packed, num_workers=2, persistent_workers=persistent, **kw)
    for e in range(4):
        for _ in range(2):  # two passes abandoned after their first batch
            part = _flat(_epoch(loader, e, limit=1))
            assert part == want[e][: len(part)]
        assert _flat(_epoch(loader, e)) == want[e], f"epoch {e} after abandoned passes"


def test_ring_slots_are_reused_only_after_they_were_taken():
    ring = transport.TokenRing(workers=1, slots=2, slot_bytes=1 << 12)
    from wdsllm.load.batching import Batch
    from wdsllm.load.block import Block

    def bundle(value: int) -> list:
        tokens = np.full(8, value, np.uint16)
        z = np.array([0], np.int64)
        return [Batch(items=Block(tokens, z, np.array([8], np.int64), z), index=value, epoch=0, worker=0)]

    import pickle

    msgs = [pickle.dumps(ring.pack(0, bundle(v))) for v in (1, 2)]
    assert list(ring.taken) == [0]
    first = pickle.loads(msgs[0])  # taking message 0 frees its slot for message 2
    assert list(ring.taken) == [1]
    msgs.append(pickle.dumps(ring.pack(0, bundle(3))))
    second, third = pickle.loads(msgs[1]), pickle.loads(msgs[2])
    assert [b.items.tokens.tolist() for m in (first, second, third) for b in m.unpack()] == [[1] * 8, [2] * 8, [3] * 8]
