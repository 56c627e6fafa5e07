"""Batch contents: padding, labels, document boundaries, fixed shapes, and pooled memory that is
never reused while a batch is alive."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from synth import write_dataset

import wdsllm
from wdsllm.load.block import split_id
from wdsllm.load.collate import IGNORE_INDEX, BufferPool


def test_docs_batches_pad_and_mask(tmp_path):
    info = write_dataset(tmp_path, [17, 9], max_len=20)
    for b in wdsllm.dataset(str(tmp_path), batch_size=5, pad_to_multiple_of=8, pad_id=7):
        n, width = b["input_ids"].shape
        assert width % 8 == 0 and width >= int(b["lengths"].max())
        for i in range(n):
            k = int(b["lengths"][i])
            want = torch.from_numpy(info["expect"][int(b["docs"][i, 0])].astype(np.int64))
            assert torch.equal(b["input_ids"][i, :k], want)
            assert torch.equal(b["labels"][i, :k], want)
            assert bool((b["input_ids"][i, k:] == 7).all()) and bool((b["labels"][i, k:] == IGNORE_INDEX).all())
            assert int(b["attention_mask"][i].sum()) == k and bool((b["attention_mask"][i, :k] == 1).all())
            shard, ordinal = split_id(int(b["docs"][i, 0]))
            assert shard in (0, 1) and 0 <= ordinal < (17 if shard == 0 else 9)


def test_packed_rows_with_boundaries(tmp_path):
    info = write_dataset(tmp_path, [9, 5], mode="packed", seq_len=16, max_len=7)
    batches = list(wdsllm.dataset(str(tmp_path), batch_size=4, boundaries=True, max_segments=16))
    shapes = {tuple(b["cu_seqlens"].shape) for b in batches if b["input_ids"].shape[0] == 4}
    assert shapes == {(4 * 17 + 1,)}, "cu_seqlens has one fixed length for full batches"
    for b in batches:
        n = b["input_ids"].shape[0]
        cu = b["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu == sorted(cu) and cu[-1] == n * 16
        # the names Hugging Face models read: the same tensor and number
        assert b["cu_seq_lens_q"] is b["cu_seqlens"] and b["cu_seq_lens_k"] is b["cu_seqlens"]
        assert b["cu_seqlens"].dtype == torch.int32
        assert b["max_length_q"] == b["max_length_k"] == b["max_seqlen"] == max(z - a for a, z in pairwise(cu))
        pos = b["position_ids"].reshape(-1).tolist()
        starts = [c for c in cu if c < n * 16]
        # position ids restart at every boundary that cu_seqlens lists, and count up in between
        for a, z in zip(starts, [*starts[1:], n * 16]):
            assert pos[a:z] == list(range(z - a))
        for r in range(n):
            k = int(b["lengths"][r])
            row_id = int(b["rows"][r])
            assert torch.equal(b["input_ids"][r, :k], torch.from_numpy(info["expect"][row_id].astype(np.int64)))
            # the first token of a document inside a row is never a target
            firsts = [c - r * 16 for c in starts if r * 16 < c < r * 16 + k]
            assert all(int(b["labels"][r, f]) == IGNORE_INDEX for f in firsts)
            assert bool((b["labels"][r, k:] == IGNORE_INDEX).all())
    # without boundaries there is nothing to mask in full rows
    plain = next(iter(wdsllm.dataset(str(tmp_path), batch_size=4)))
    assert "position_ids" not in plain and torch.equal(plain["labels"], plain["input_ids"])


def test_pool_never_reuses_memory_a_batch_still_holds():
    pool = BufferPool(keep=4)
    a = pool.take(1000, np.int64)
    a[:] = 1
    t = torch.from_numpy(a)
    b = pool.take(1000, np.int64)
    assert not np.shares_memory(a, b), "a buffer behind a live tensor must not be handed out again"
    view = t[10:20]
    del t, a
    c = pool.take(1000, np.int64)
    assert not np.shares_memory(view.numpy(), c), "a view keeps its buffer alive"
    del view, b, c
    d = pool.take(1000, np.int64)
    assert any(np.shares_memory(d, buf) for buf in pool.buffers), "freed buffers are reused"
    assert len(pool.buffers) <= 4 + 1


def test_batches_kept_by_the_caller_do_not_change(tmp_path):
    write_dataset(tmp_path, [40, 30, 25], max_len=30)
    for kw in (dict(batch_size=4), dict(batching="pack", seq_len=32, batch_size=3)):
        loader = wdsllm.loader(str(tmp_path), **kw)
        kept = [(b, {k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)}) for b in loader]
        for batch, copy in kept:
            for k, v in copy.items():
                assert torch.equal(batch[k], v), f"{k} of a kept batch changed"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 70), min_size=0, max_size=12),
    st.sampled_from([None, 1, 8]),
    st.integers(0, 2**32 - 1),
)
def test_docs_collate_pads_each_document_after_its_tokens(lengths, multiple, seed):
    """input_ids, labels and attention_mask against a row-by-row reference: each document
    left-aligned, pad_id / -100 / 0 after it, the width its longest rounded up."""
    from wdsllm.load.block import Block
    from wdsllm.load.collate import CollateOptions, collate_docs

    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    tokens = rng.integers(0, 50_000, int(lengths.sum()) + 50, dtype=np.uint16)
    starts = rng.permutation(len(lengths))  # items in any order over the buffer
    offsets = np.concatenate([[0], np.cumsum(lengths[starts])[:-1]]).astype(np.int64)
    item_starts = np.empty(len(lengths), np.int64)
    item_starts[starts] = offsets
    block = Block(tokens, item_starts, lengths, np.arange(len(lengths), dtype=np.int64))
    out = collate_docs(block, CollateOptions(pad_id=7, pad_to_multiple_of=multiple))
    width = int(lengths.max()) if len(lengths) else 0
    if multiple:
        width = -(-width // multiple) * multiple
    assert tuple(out["input_ids"].shape) == (len(lengths), width)
    for i, (a, n) in enumerate(zip(item_starts.tolist(), lengths.tolist())):
        row = tokens[a : a + n].astype(np.int64)
        assert out["input_ids"][i].tolist() == row.tolist() + [7] * (width - n)
        assert out["labels"][i].tolist() == row.tolist() + [IGNORE_INDEX] * (width - n)
        assert out["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
    assert out["lengths"].tolist() == lengths.tolist()
