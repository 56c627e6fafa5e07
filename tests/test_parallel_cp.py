"""Context-parallel slices and pipeline stages, in one process: every CP rank's loader is built
with the same settings and its own ``cp_rank``; their slices put back together are the batch that
the same settings give without CP (labels shifted, true positions), for every batching mode and a
mixture; at every chunk boundary of a packed row each token keeps its label, position and
document; and a pipeline stage yields the fields it needs, as many steps as the others."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synth import write_dataset

import wdsllm
from wdsllm.load.cpsplit import full_view, reassemble
from wdsllm.load.layout import CpSlice

CP = 2

MODES = {
    "fixed": {"batching": "fixed", "batch_size": 3, "pad_to_multiple_of": 2 * CP},
    "bucket": {"batching": "bucket", "batch_size": 3, "window": 8, "pad_to_multiple_of": 2 * CP},
    "pack": {"batching": "pack", "batch_size": 2, "seq_len": 16, "window": 8, "boundaries": True},
    "concat": {"batching": "concat", "batch_size": 2, "seq_len": 16},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    write_dataset(root / "docs", [11, 7, 9], max_len=30, seed=1)
    write_dataset(root / "other", [8, 6], max_len=20, seed=2)
    write_dataset(root / "rows", [5, 6, 4], mode="packed", seq_len=16, max_len=9, seed=3)
    return root


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def _each_step(source, kw: dict, split: str = "zigzag"):
    """(the non-CP batch, the CP ranks' slices) at every step of one epoch."""
    whole = list(wdsllm.loader(source, seed=5, **kw))
    parts = [list(wdsllm.loader(source, seed=5, cp_rank=r, cp_size=CP, cp_split=split, **kw)) for r in range(CP)]
    assert all(len(p) == len(whole) for p in parts), "CP ranks yield the non-CP number of steps"
    assert whole
    return [(batch, [p[i] for p in parts]) for i, batch in enumerate(whole)]


@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mode", list(MODES))
def test_cp_slices_reassemble_to_the_batch_without_cp(data, mode, split):
    for batch, slices in _each_step(data / "docs", MODES[mode], split):
        _same(reassemble(slices), full_view(batch))
        width = batch["input_ids"].shape[1]
        assert all(s["input_ids"].shape[1] == width // CP for s in slices)


def test_cp_slices_of_packed_rows_and_of_a_mixture(data):
    for batch, slices in _each_step(data / "rows", {"batch_size": 2, "boundaries": True}):
        _same(reassemble(slices), full_view(batch))
    mix = wdsllm.Mixture({"a": str(data / "docs"), "b": str(data / "other")}, unit="items", epoch_items=30)
    for kw in (MODES["fixed"], MODES["pack"]):
        for batch, slices in _each_step(mix, kw):
            assert "sources" in slices[0]
            _same(reassemble(slices), full_view(batch))


def test_every_chunk_boundary_keeps_label_position_and_document(data):
    """Token by token at every chunk edge of packed rows: the CP rank holding it has the row's
    token, the label of the next token (or -100 where that one starts a document), its position in
    its document, and the document cu_seqlens place it in."""
    seq_len, chunks = 16, 2 * CP
    for batch, slices in _each_step(data / "docs", MODES["pack"]):
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        cu = batch["cu_seqlens"].long()
        for row in range(ids.shape[0]):
            for edge in range(0, seq_len, seq_len // chunks):
                for t in {max(edge - 1, 0), edge}:
                    rank, at = _holder(slices, t)
                    part = slices[rank]
                    assert part["input_ids"][row, at] == ids[row, t]
                    want = labels[row, t + 1] if t + 1 < seq_len else -100
                    assert part["shift_labels"][row, at] == want
                    assert part["position_ids"][row, at] == pos[row, t]
                    flat = row * seq_len + t
                    doc = int(np.searchsorted(cu.numpy(), flat, side="right")) - 1
                    assert flat - int(cu[doc]) == int(part["position_ids"][row, at]), "position within its document"
                    assert torch.equal(part["cu_seqlens"], batch["cu_seqlens"])


def _holder(slices: list[dict], token: int) -> tuple[int, int]:
    """Which CP rank holds ``token`` of a row, and where in its slice."""
    for rank, part in enumerate(slices):
        at = 0
        for a, b in part["cp_token_ranges"].tolist():
            if a <= token < b:
                return rank, at + token - a
            at += b - a
    raise AssertionError(f"no rank holds token {token}")


def test_zigzag_takes_chunks_r_and_its_mirror():
    from wdsllm.load.cpsplit import chunk_ranges

    assert chunk_ranges(CpSlice(0, 2, "zigzag"), 16) == [(0, 4), (12, 16)]
    assert chunk_ranges(CpSlice(1, 2, "zigzag"), 16) == [(4, 8), (8, 12)]
    assert chunk_ranges(CpSlice(1, 4, "contiguous"), 16) == [(4, 8)]


def test_a_row_length_the_split_cannot_cut_is_a_construction_error(data):
    with pytest.raises(wdsllm.ConfigError, match="seq_len=18 is not a multiple of 4"):
        wdsllm.loader(data / "docs", batching="pack", batch_size=2, seq_len=18, cp_rank=0, cp_size=2)
    with pytest.raises(wdsllm.ConfigError, match="pad_to_multiple_of"):
        wdsllm.loader(data / "docs", batch_size=2, cp_rank=0, cp_size=2)
    with pytest.raises(wdsllm.ConfigError, match="cp_rank= and cp_size="):
        wdsllm.loader(data / "docs", batch_size=2, cp_rank=0)


def test_pipeline_stages_take_inputs_first_and_labels_last(data):
    kw = {"batch_size": 2, "boundaries": True, "seed": 5}
    stages = [list(wdsllm.loader(data / "rows", pp_stage=s, pp_stages=3, **kw)) for s in range(3)]
    whole = list(wdsllm.loader(data / "rows", **kw))
    assert [len(s) for s in stages] == [len(whole)] * 3, "every stage steps as often"
    for first, middle, last, batch in zip(*stages, whole):
        assert "labels" not in first and torch.equal(first["input_ids"], batch["input_ids"])
        assert torch.equal(first["position_ids"], batch["position_ids"])
        assert set(middle) == {"epoch"}
        assert "input_ids" not in last and torch.equal(last["labels"], batch["labels"])
        assert torch.equal(last["loss_mask"], batch["labels"] != -100)
