"""The documents of packed rows (``docs``), however they are computed, and ``docs=False``.

Rows of a packed dataset say which documents they hold with two numbers per row (the first
document and the count); batchers and ``boundaries`` use a segment table. Both must name exactly
the documents whose tokens a row holds, including documents that continue from an earlier row,
group or shard.
"""

from __future__ import annotations

import torch
from synth import write_dataset

import wdsllm


def _docs_by_row(loader) -> dict[int, list[int]]:
    seen = {}
    for b in loader:
        for r, row in enumerate(b["rows"].tolist()):
            assert row not in seen
            seen[row] = [d for d in b["docs"][r].tolist() if d >= 0]
            assert b["docs"][r].tolist()[len(seen[row]) :] == [-1] * (b["docs"].shape[1] - len(seen[row])), (
                "-1 only after the last"
            )
    return seen


def test_row_documents_match_the_data(tmp_path):
    # documents up to 40 tokens in rows of 16: they span rows, groups (2 rows each) and shards
    info = write_dataset(tmp_path, [7, 5, 4], mode="packed", seq_len=16, max_len=40, rows_per_group=2)
    truth = info["row_docs"]
    assert any(len(d) > 2 for d in truth.values()) and any(d[0] >> 32 != row >> 32 for row, d in truth.items()), (
        "the data must hold rows of several documents and a document continuing across a shard boundary"
    )
    for kw in (
        dict(),
        dict(boundaries=True, max_segments=16),
        dict(shuffle=False),
        dict(num_workers=2),
        dict(rank=1, world_size=2, num_workers=3),
    ):
        got = _docs_by_row(wdsllm.loader(str(tmp_path), batch_size=3, seed=1, **kw))
        want = truth if "rank" not in kw else {row: truth[row] for row in got}
        assert got == want, kw


def test_docs_false_gives_the_same_batches_without_docs(tmp_path):
    write_dataset(tmp_path, [9, 6], mode="packed", seq_len=16, max_len=40, rows_per_group=2)
    for kw in (dict(), dict(boundaries=True, max_segments=16)):
        full = list(wdsllm.loader(str(tmp_path), batch_size=4, seed=2, **kw))
        lean = list(wdsllm.loader(str(tmp_path), batch_size=4, seed=2, docs=False, **kw))
        assert len(full) == len(lean)
        for a, b in zip(full, lean):
            assert "docs" not in b and set(a) - set(b) == {"docs"}
            for k in b:
                assert torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k]
    docs_mode = tmp_path / "docs"
    write_dataset(docs_mode, [8, 5])
    assert "docs" not in next(iter(wdsllm.loader(str(docs_mode), batch_size=4, docs=False)))


def test_a_resume_may_change_docs(tmp_path):
    write_dataset(tmp_path, [9, 6], mode="packed", seq_len=16, max_len=40, rows_per_group=2)
    whole = [b["rows"].tolist() for b in wdsllm.loader(str(tmp_path), batch_size=2, seed=3)]
    first = wdsllm.loader(str(tmp_path), batch_size=2, seed=3)
    it = iter(first)
    head = [next(it)["rows"].tolist() for _ in range(3)]
    state = first.state_dict()
    second = wdsllm.loader(str(tmp_path), batch_size=2, seed=3, docs=False)
    second.load_state_dict(state)
    assert head + [b["rows"].tolist() for b in second] == whole
