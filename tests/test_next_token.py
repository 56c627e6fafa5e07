"""Next-token labels (``shift_labels=True``, issue #46): a batch carries ``shift_labels``, the
token each position predicts, in place of the aligned ``labels``; rows of pack and concat are read
with one token more than they hand out, so no row's last position loses its label (as nanoGPT and
torchtitan read seq_len + 1 tokens a row); -100 where the next token starts another document
(with boundaries), after a document's end, and on padding."""

from __future__ import annotations

import pytest
import torch
from synth import write_dataset

import wdsllm
from wdsllm.errors import StateError
from wdsllm.load.collate import IGNORE_INDEX
from wdsllm.load.cpsplit import full_view, reassemble

SEQ = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("next")
    info = write_dataset(root / "docs", [11, 7, 9], max_len=30, seed=1)
    write_dataset(root / "rows", [5, 6, 4], mode="packed", seq_len=SEQ + 1, max_len=9, seed=3)
    return root, info


def _batches(source, **kw) -> list[dict]:
    return list(wdsllm.loader(source, seed=5, shuffle_buffer=4, **kw))


def test_concat_rows_of_seq_len_plus_one_lose_no_label(data):
    """Every position of a row has its label (the next token of the stream), and the rows' inputs
    with each row's last label are the whole stream the plain loader yields, token for token."""
    root, _ = data
    kw = dict(batching="concat", seq_len=SEQ, batch_size=2, shuffle=False)
    plain = [t for b in _batches(root / "docs", **kw) for row, n in zip(b["input_ids"], b["lengths"]) for t in row[:n]]
    stream, lost = [], 0
    for b in _batches(root / "docs", shift_labels=True, **kw):
        assert "labels" not in b and b["input_ids"].shape == b["shift_labels"].shape == (len(b["lengths"]), SEQ)
        for row, labels, n in zip(b["input_ids"], b["shift_labels"], b["lengths"].tolist()):
            assert torch.equal(labels[: n - 1], row[1:n]), "a position's label is the next token"
            stream += row[:n].tolist()
            if labels[n - 1] != IGNORE_INDEX:
                stream.append(int(labels[n - 1]))
            lost += int(labels[n - 1] == IGNORE_INDEX)
    assert [int(t) for t in plain] == stream
    assert lost == 1, "only the stream's last token predicts nothing"


def test_packed_rows_with_boundaries_mask_the_labels_where_a_document_ends(data):
    """A synthetic document's tokens count up by 7: a position's label is its token + 7 where the
    document goes on (also at a row's last position: the token read with the row), and -100 exactly
    where the next position starts another document or the document ended."""
    root, _ = data
    for mode in ("pack", "concat"):
        for b in _batches(root / "docs", batching=mode, seq_len=SEQ, batch_size=2, boundaries=True, shift_labels=True):
            ids, labels, pos = b["input_ids"], b["shift_labels"], b["position_ids"]
            assert ids.shape[1] == SEQ and int(b["cu_seqlens"].max()) == ids.numel()
            for i in range(ids.shape[0]):
                n = int(b["lengths"][i])
                for t in range(n):
                    if labels[i, t] != IGNORE_INDEX:
                        assert labels[i, t] == (ids[i, t] + 7) % 60000, "the next token of the same document"
                    elif t + 1 < n:
                        assert pos[i, t + 1] == 0, "-100 only where the next position starts a document"
                assert (labels[i, n:] == IGNORE_INDEX).all()
            ends = (labels == IGNORE_INDEX).sum()
            assert ends < ids.numel() // 2


def test_a_packed_datasets_rows_give_one_position_less(data):
    root, _ = data
    plain = _batches(root / "rows", batch_size=3)
    shifted = _batches(root / "rows", batch_size=3, shift_labels=True)
    assert len(plain) == len(shifted)
    for a, b in zip(plain, shifted):
        assert b["input_ids"].shape[1] == SEQ and a["input_ids"].shape[1] == SEQ + 1
        assert torch.equal(b["input_ids"], a["input_ids"][:, :SEQ])
        assert torch.equal(b["shift_labels"], a["labels"][:, 1:])


def test_padded_documents_keep_their_width_and_the_last_token_predicts_nothing(data):
    root, _ = data
    for b in _batches(root / "docs", batch_size=3, shift_labels=True):
        assert b["input_ids"].shape == b["shift_labels"].shape == b["attention_mask"].shape
        for row, labels, n in zip(b["input_ids"], b["shift_labels"], b["lengths"]):
            n = int(n)
            assert torch.equal(labels[: n - 1], row[1:n]) and (labels[n - 1 :] == IGNORE_INDEX).all()


def test_context_parallel_slices_keep_the_next_token_labels(data):
    root, _ = data
    kw = dict(batching="pack", seq_len=SEQ, batch_size=2, shift_labels=True, seed=5)
    whole = list(wdsllm.loader(root / "docs", **kw))
    parts = [list(wdsllm.loader(root / "docs", cp_rank=r, cp_size=2, **kw)) for r in range(2)]
    for i, batch in enumerate(whole):
        slices = [p[i] for p in parts]
        assert slices[0]["input_ids"].shape[1] == SEQ // 2
        back = reassemble(slices)
        assert torch.equal(back["shift_labels"], batch["shift_labels"]), "not shifted a second time"
        assert torch.equal(back["input_ids"], full_view(batch)["input_ids"])


def test_a_state_keeps_its_labels(data):
    root, _ = data
    kw = dict(batching="concat", seq_len=SEQ, batch_size=2)
    ld = wdsllm.loader(root / "docs", shift_labels=True, **kw)
    next(iter(ld))
    with pytest.raises(StateError, match="other loader settings"):
        wdsllm.loader(root / "docs", **kw).load_state_dict(ld.state_dict())


@pytest.mark.parametrize("mode", ["concat", "pack"])
def test_counts_and_resumes_follow_the_rows_as_read(data, mode):
    """The batch counts (equal batches, len) and a resume's positions are of rows of seq_len + 1."""
    root, _ = data
    kw = dict(batching=mode, seq_len=SEQ, batch_size=2, shift_labels=True, rank=1, world_size=2, num_workers=2)
    kw.update(seed=5, shuffle_buffer=4, _in_process=True)
    ld = wdsllm.loader(root / "docs", **kw)
    whole = [b["input_ids"] for b in ld]
    assert len(whole) == len(ld) > 3
    ld = wdsllm.loader(root / "docs", **kw)
    it = iter(ld)
    for _ in range(3):
        next(it)
    again = wdsllm.loader(root / "docs", **kw)
    again.load_state_dict(ld.state_dict())
    rest = [b["input_ids"] for b in again]
    assert len(rest) == len(whole) - 3 and all(torch.equal(a, b) for a, b in zip(rest, whole[3:]))
