"""--max-doc-bytes: a longer document is a named error or a counted skip, decided on the document's
bytes whatever the chunking, and never held whole by the reader."""

from __future__ import annotations

import json

import pytest
from pack_helpers import dataset_files, documents, encode_texts, jsonl, load_index, pack_api, provenance, write_parquet

from wdsllm.errors import SourceError
from wdsllm.inputs.sources import Part, expand_inputs
from wdsllm.inputs.text import read_chunks

LIMIT = 64 << 10


def records_with_long_lines() -> list:
    """JSON lines around the limit: far over it, just over, exactly at it, under."""
    out = []
    for i in range(40):
        out.append({"text": f"document {i} " * 5})
        if i == 3:
            out.append({"text": "x" * (5 * LIMIT)})  # far over
        if i == 10:
            out.append({"text": "y" * (LIMIT - 12)})  # the line is exactly LIMIT bytes: kept
        if i == 20:
            out.append({"text": "z" * (LIMIT - 11)})  # one byte over
    return out


def test_jsonl_long_lines_are_named_or_skipped_the_same_for_any_chunking(tmp_path):
    path = jsonl(tmp_path / "in.jsonl", records_with_long_lines())
    with pytest.raises(SourceError, match=rf"in.jsonl:5: document of {5 * LIMIT + 12} bytes is longer than"):
        pack_api([path], tmp_path / "raise", max_doc_bytes=LIMIT)
    outputs = []
    for n, chunk_bytes in enumerate([1 << 10, 16 << 10, 200 << 10, 1 << 20]):
        out = tmp_path / f"skip{n}"
        result = pack_api([path], out, max_doc_bytes=LIMIT, on_error="skip", chunk_bytes=chunk_bytes)
        outputs.append(dataset_files(out))
        assert [(r["line"], r["reason"]) for r in result.index.skipped["records"]] == [
            (5, "too_long"),
            (24, "too_long"),
        ]
    assert all(o == outputs[0] for o in outputs)
    kept = [r["text"] for r in records_with_long_lines() if len(json.dumps(r)) <= LIMIT]
    assert [d.tolist() for d in documents(tmp_path / "skip0")] == encode_texts(kept)
    assert load_index(tmp_path / "skip0").options["max_doc_bytes"] == LIMIT


def part_of(path) -> Part:
    inp = expand_inputs([str(path)])[0]
    return Part(inp, size=inp.size)


@pytest.mark.parametrize("split", ["line", "paragraph", "file"])
def test_the_reader_streams_past_a_long_record(tmp_path, split):
    """A 2 MiB record under a 64 KiB limit: no chunk ever holds it, and the skip names its line."""
    sep = b"\n\n" if split == "paragraph" else b"\n"
    body = [
        b"first one",
        b"second line\nstill second" if split == "paragraph" else b"second",
        b"w" * (2 << 20),
        b"last",
    ]
    if split == "file":
        body = [b"w" * (2 << 20)]
    path = tmp_path / "in.txt"
    path.write_bytes(sep.join(body) + b"\n")
    seen = []
    for chunk_bytes in (4 << 10, 32 << 10, 256 << 10):
        chunks = list(read_chunks(part_of(path), split, chunk_bytes, max_doc_bytes=LIMIT))
        assert max(len(c.data) for c in chunks) <= LIMIT + 2 * chunk_bytes
        skips = [(s.line, s.reason, s.detail) for c in chunks for s in c.skips]
        seen.append(skips)
    long_line = {"line": 3, "paragraph": 6, "file": 1}[split]
    size = (2 << 20) + (2 if split == "paragraph" else 1 if split == "file" else 0)  # its separator, for paragraphs
    assert seen[0] == [(long_line, "too_long", f"{size} bytes")]
    assert seen[0] == seen[1] == seen[2]


def test_paragraph_and_file_splits_pack_the_same_whatever_the_chunking(tmp_path):
    text = "para one\nline two\n\n" + "p" * 3000 + "\n" + "q" * 3000 + "\n\nafter\n"
    (tmp_path / "in.txt").write_text(text)
    results = [
        dataset_files(
            (
                pack_api(
                    [tmp_path / "in.txt"],
                    tmp_path / f"o{c}",
                    split="paragraph",
                    max_doc_bytes=5000,
                    on_error="skip",
                    chunk_bytes=c,
                ),
                tmp_path / f"o{c}",
            )[1]
        )
        for c in (16, 700, 1 << 20)
    ]
    assert results[0] == results[1] == results[2]
    assert [line for _, line, _ in provenance(tmp_path / "o16")] == [1, 7]
    assert load_index(tmp_path / "o16").skipped["records"][0]["line"] == 4
    with pytest.raises(SourceError, match=r"in.txt:1: document of \d+ bytes"):
        pack_api([tmp_path / "in.txt"], tmp_path / "whole", split="file", max_doc_bytes=5000)


def test_columnar_rows_over_the_limit(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"text": "a"}, {"text": "b" * 5000}, {"text": "c"}], 2)
    with pytest.raises(SourceError, match=r"p.parquet: row 2: document of 5000 bytes is longer than --max-doc-bytes"):
        pack_api([path], tmp_path / "a", max_doc_bytes=4096)
    result = pack_api([path], tmp_path / "b", max_doc_bytes=4096, on_error="skip")
    assert [d.tolist() for d in documents(tmp_path / "b")] == encode_texts(["a", "c"])
    assert result.index.skipped["counts"] == {"too_long": 1}


def test_max_doc_bytes_must_be_positive(tmp_path):
    from wdsllm.pack.job import PackError

    with pytest.raises(PackError, match="--max-doc-bytes must be positive"):
        pack_api([tmp_path / "none.jsonl"], tmp_path / "x", max_doc_bytes=0)
