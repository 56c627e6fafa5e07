"""The loader's options (issue #30, #32): each declared once in a record, every number checked at
the face with a ConfigError naming it, records passed whole or as keywords alike, the raw-text
keywords folded into a source record, and docs/loader.md listing each option once."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from pack_helpers import GPT2, cached, wiki_lines
from synth import write_dataset

import wdsllm
from wdsllm.errors import ConfigError
from wdsllm.load.options import (
    FACE_RECORDS,
    BatchOptions,
    LayoutOptions,
    OrderOptions,
    RawTextSource,
    ReadingOptions,
    WorkerOptions,
    markdown_table,
    record_fields,
)
from wdsllm.load.sources.packed import PackedSource

DOCS = Path(__file__).parent.parent / "docs" / "loader.md"


def _data() -> Path:
    return cached("options-synth", lambda d: write_dataset(d, [13, 7, 11], seed=4) and d)


def _ids(loader) -> list[list[int]]:
    return [b["docs"][:, 0].tolist() for b in loader]


def _bounded() -> list[tuple[type, str, int]]:
    return [
        (r, f.name, f.metadata["low"])
        for r in (*FACE_RECORDS, RawTextSource)
        for f in fields(r)
        if f.metadata["low"] is not None
    ]


@pytest.mark.parametrize(("record", "name", "low"), _bounded(), ids=lambda x: getattr(x, "__name__", str(x)))
def test_every_number_is_checked_when_its_record_is_built(record, name, low):
    base = {"raw": "a.txt"} if record is RawTextSource else {}
    if record is LayoutOptions:  # rank and world size come together
        base = {"rank": 0, "world_size": 1}
    for bad in (low - 1, -4, "8", 2.5, True):
        if bad is not True and isinstance(bad, int) and bad >= low:
            continue
        with pytest.raises(ConfigError, match=rf"^{name} must be"):
            record(**{**base, name: bad})
    record(**{**base, name: max(low, 1) if name != "rank" else 0})
    record(**{**base, name: np.int64(max(low, 1)) if name != "rank" else 0})


@pytest.mark.parametrize("bad", [0, -4])
def test_max_len_is_refused_at_the_face_before_anything_is_opened(bad):
    with pytest.raises(ConfigError, match=rf"max_len must be positive, not {bad}"):
        wdsllm.loader("/nonexistent/dataset", max_len=bad)
    with pytest.raises(ConfigError, match=rf"max_len must be positive, not {bad}"):
        wdsllm.dataset("/nonexistent/dataset", max_len=bad)


def test_words_are_checked_too():
    with pytest.raises(ConfigError, match="max_len_mode must be one of 'split', 'truncate', not 'cut'"):
        BatchOptions(max_len_mode="cut")
    with pytest.raises(ConfigError, match="batching must be one of"):
        wdsllm.loader("/nonexistent", batching="packed")
    with pytest.raises(ConfigError, match="on_error must be one of"):
        ReadingOptions(on_error="ignore")
    with pytest.raises(ConfigError, match="split must be one of"):
        RawTextSource("a.txt", split="sentence")
    with pytest.raises(ConfigError, match="rank 2 is outside world size 2"):
        LayoutOptions(rank=2, world_size=2)


def test_an_unknown_keyword_names_the_close_one():
    with pytest.raises(ConfigError, match=r"unknown option batch_sze=; did you mean batch_size=\?"):
        wdsllm.loader("/nonexistent", batch_sze=3)
    with pytest.raises(ConfigError, match=r"unknown option frobnicate="):
        wdsllm.dataset("/nonexistent", frobnicate=1)


def test_a_record_and_its_own_keywords_together_are_refused():
    with pytest.raises(ConfigError, match="batch_size given both as keywords and in batch="):
        wdsllm.loader("/nonexistent", batch=BatchOptions(), batch_size=3)
    with pytest.raises(ConfigError, match=r"takes a WorkerOptions, not int"):
        wdsllm.loader("/nonexistent", workers=4)


def test_records_whole_give_the_batches_of_their_keywords():
    data = str(_data())
    flat = wdsllm.loader(data, batch_size=4, seed=3, shuffle_buffer=5, max_len=9, num_workers=0)
    whole = wdsllm.loader(
        data,
        order=OrderOptions(seed=3, shuffle_buffer=5),
        batch=BatchOptions(batch_size=4, max_len=9),
        workers=WorkerOptions(num_workers=0),
    )
    mixed = wdsllm.loader(data, batch=BatchOptions(batch_size=4, max_len=9), seed=3, shuffle_buffer=5)
    expected = _ids(flat)
    assert expected == _ids(whole) == _ids(mixed)
    assert flat.state_dict() == whole.state_dict()
    pipe = wdsllm.dataset(data, order=OrderOptions(seed=3, shuffle_buffer=5), batch_size=4, max_len=9)
    assert [b["docs"][:, 0].tolist() for b in pipe] == expected


def test_dataset_has_no_workers_of_its_own():
    with pytest.raises(ConfigError, match="num_workers: wdsllm.dataset has no workers"):
        wdsllm.dataset(str(_data()), num_workers=2)


def test_raw_keywords_still_work_as_a_deprecated_spelling_of_the_source_record(tmp_path):
    (tmp_path / "a.txt").write_text("\n".join(line[:200] for line in wiki_lines(40)) + "\n", encoding="utf-8")
    pattern = str(tmp_path / "a.txt")
    options = dict(batch_size=4, seed=1, shuffle_buffer=8)
    record = wdsllm.loader(wdsllm.RawTextSource(pattern, tokenizer=str(GPT2), unit_bytes=4096), **options)
    with pytest.warns(DeprecationWarning, match="RawTextSource"):
        old = wdsllm.loader(pattern, tokenizer=str(GPT2), unit_bytes=4096, **options)
    assert _ids(record) == _ids(old)
    assert record.cfg.pad_id == old.cfg.pad_id == 50256  # the raw source's own default: GPT-2's EOS
    with pytest.raises(ConfigError, match="unit_bytes apply to raw text sources: pass tokenizer= as well"):
        wdsllm.loader(pattern, unit_bytes=4096)


def test_a_raw_source_record_is_a_mixture_source_of_the_same_shape():
    record = RawTextSource(["a.txt", "b.txt"], counts="c.npz", eos=False)
    assert dict(record) == {
        "raw": ["a.txt", "b.txt"],
        "counts": "c.npz",
        "text_field": "text",
        "split": "line",
        "eos": False,
        "max_doc_bytes": record.max_doc_bytes,
    }
    mixture = wdsllm.Mixture({"web": record, "web2": dict(record)})
    assert mixture.names == ["web", "web2"]


def test_a_local_root_is_not_asked_shard_by_shard():
    class NoWalk(list):
        def __iter__(self):
            raise AssertionError("walked every shard URL")

    assert not PackedSource(urls=NoWalk(["/d/s0.tar"] * 3), root="/d").reads_remote()
    assert PackedSource(urls=NoWalk(), root="https://host/d").reads_remote()
    assert PackedSource(urls=["/d/a.tar", "s3://b/c.tar"], user_urls=True).reads_remote()


def _documented_options() -> list[str]:
    """Every option named in the first column of docs/loader.md's option tables."""
    names = []
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        cells = line.split("|")
        if len(cells) > 3 and line.startswith("| `"):
            names += re.findall(r"`([a-z_]+)`", cells[1])
    return names


def test_docs_list_every_option_of_every_record_once():
    text = DOCS.read_text(encoding="utf-8")
    records = (*FACE_RECORDS, RawTextSource)
    for record in records:
        assert markdown_table(record) in text, f"docs/loader.md lacks {record.__name__}'s table as declared"
    declared = [name for record in records for name, _, _ in record_fields(record)]
    assert sorted(_documented_options()) == sorted(declared), "docs/loader.md's tables and the option records differ"
