"""Parquet and Arrow inputs: the text column (or a struct field) read in row groups and record
batches, --where on the columns, nulls and non-text columns, and bad files; the same documents
arrive as from JSON lines of the same records."""

from __future__ import annotations

import json
import shutil

import pytest
from pack_helpers import (
    GPT2,
    cached,
    cli,
    documents,
    encode_texts,
    load_index,
    pack_api,
    provenance,
    wiki_records,
    write_arrow,
    write_parquet,
)

from wdsllm.errors import SourceError

ROWS = 1500
WHERE = "meta.score >= 0.5 and meta.lang in ('en', 'de')"


def records() -> list[dict]:
    return cached("columnar-records", lambda d: wiki_records(ROWS))


def parquet():
    return cached("columnar-parquet", lambda d: write_parquet(d / "wiki.parquet", records(), 250))


def same_records_everywhere():
    """The records as Parquet (6 row groups), an Arrow file, an Arrow stream and JSON lines."""

    def build(d):
        with open(d / "wiki.jsonl", "w") as f:
            f.write("\n".join(json.dumps(r) for r in records()) + "\n")
        return [
            parquet(),
            write_arrow(d / "wiki.arrow", records(), 320),
            write_arrow(d / "wiki.arrows", records(), 400, stream=True),
            d / "wiki.jsonl",
        ]

    return cached("columnar-all", build)


def test_parquet_round_trip_equals_direct_tokenization(tmp_path):
    result = pack_api([parquet()], tmp_path / "out", on_error="skip", chunk_bytes=64 << 10)
    rows = [(n, r["text"]) for n, r in enumerate(records(), 1) if r["text"] is not None and r["text"].strip()]
    assert [d.tolist() for d in documents(tmp_path / "out")] == encode_texts([t for _, t in rows])
    assert [line for _, line, _ in provenance(tmp_path / "out")] == [n for n, _ in rows]  # the row, 1-based
    nulls = [n for n, r in enumerate(records(), 1) if r["text"] is None]
    empties = sum(r["text"] == "" for r in records())
    skipped = result.index.skipped
    assert skipped["counts"] == {"empty": empties, "missing_field": len(nulls)}
    assert [(r["line"], r["reason"]) for r in skipped["records"]] == [(n, "missing_field") for n in nulls]
    assert result.index.inputs[0]["documents"] == len(rows)


def test_a_null_text_stops_the_pack_naming_file_and_row(tmp_path):
    with pytest.raises(SourceError, match=r"wiki.parquet: row 6: text column 'text' is null"):
        pack_api([parquet()], tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tar"))


def test_struct_field_and_where_give_the_same_documents_from_every_kind_of_input(tmp_path):
    """Parquet, an Arrow file, an Arrow stream and JSON lines of the same records, filtered by the
    same --where (on the columns for the first three, on the JSON objects for the last)."""
    kept = [
        (n, r["meta"]["body"])
        for n, r in enumerate(records(), 1)
        if r["meta"]["score"] >= 0.5 and r["meta"]["lang"] in ("en", "de")
    ]
    expected = encode_texts([t for _, t in kept if t and t.strip()])
    filtered = ROWS - len(kept)
    for path in same_records_everywhere():
        out = tmp_path / path.name
        result = pack_api([path], out, text_field="meta.body", where=WHERE, on_error="skip", chunk_bytes=32 << 10)
        assert [d.tolist() for d in documents(out)] == expected, path.name
        assert [line for _, line, _ in provenance(out)] == [n for n, t in kept if t and t.strip()]
        counts = result.index.skipped["counts"]
        assert counts["filtered"] == filtered, path.name
        assert counts["missing_field"] == sum(t is None for _, t in kept)
        assert result.index.options["where"] == WHERE


def test_where_that_keeps_no_row_of_a_row_group_counts_all_its_rows(tmp_path):
    result = pack_api([parquet()], tmp_path / "out", where="id >= 1250", on_error="skip")  # the last row group
    assert result.index.documents == sum(1 for r in records()[1250:] if r["text"] and r["text"].strip())
    assert result.index.skipped["counts"]["filtered"] == 1250


def test_missing_and_non_text_columns(tmp_path):
    with pytest.raises(SourceError, match=r"wiki.parquet: no column 'body' \(it has: id, title, text, meta, n\)"):
        pack_api([parquet()], tmp_path / "a", text_field="body")
    with pytest.raises(SourceError, match="wiki.parquet: column 'n' is int64, not text"):
        pack_api([parquet()], tmp_path / "b", text_field="n")
    with pytest.raises(SourceError, match="column 'meta' is struct"):
        pack_api([parquet()], tmp_path / "c", text_field="meta")
    # With --on-error skip the whole file is one listed skip, counting its rows.
    arrow = same_records_everywhere()[1]
    result = pack_api([parquet(), arrow], tmp_path / "d", text_field="n", on_error="skip")
    assert result.index.documents == 0
    assert result.index.skipped["counts"] == {"missing_field": 2 * ROWS}
    recs = result.index.skipped["records"]
    assert [(r["line"], r["count"]) for r in recs] == [(0, ROWS), (0, ROWS)]
    assert result.index.inputs[0]["skipped"] == ROWS
    with pytest.raises(SourceError, match="--where .* does not fit the columns"):
        pack_api([parquet()], tmp_path / "e", where="title > 3")


def test_a_missing_where_column_reads_as_null(tmp_path):
    result = pack_api([parquet()], tmp_path / "out", where="nothing is null and id < 10", on_error="skip")
    assert result.index.skipped["counts"]["filtered"] == ROWS - 10


def test_corrupt_parquet_files(tmp_path):
    data = parquet().read_bytes()
    (tmp_path / "footer.parquet").write_bytes(data[:-100])  # the footer is at the end
    broken = bytearray(data)
    broken[300:4000] = b"\x00" * 3700  # pages of the first row group
    (tmp_path / "pages.parquet").write_bytes(bytes(broken))
    with pytest.raises(SourceError, match=r"footer.parquet: not a readable Parquet file"):
        pack_api([tmp_path / "footer.parquet"], tmp_path / "a")
    with pytest.raises(SourceError, match=r"pages.parquet: row 1: cannot read row group 0"):
        pack_api([tmp_path / "pages.parquet"], tmp_path / "b")
    result = pack_api(
        [tmp_path / "footer.parquet", tmp_path / "pages.parquet", parquet()], tmp_path / "c", on_error="skip"
    )
    recs = {(r["file"].rsplit("/", 1)[1], r["line"], r["reason"]) for r in result.index.skipped["records"]}
    assert ("footer.parquet", 0, "unreadable") in recs and ("pages.parquet", 1, "unreadable") in recs
    assert result.index.skipped["counts"]["unreadable"] == 1 + 250  # the file, then the row group's rows
    assert result.index.inputs[2]["documents"] > 0


def test_head_and_the_summary_show_rows(tmp_path):
    out = tmp_path / "out"
    run = cli("pack", parquet(), "-o", out, "-t", GPT2, "-j", "1", "--on-error", "skip")
    assert "wiki.parquet:6: missing_field 'text' null" in run.stdout
    head = cli("head", out, "-n", "1", "--json")
    first = json.loads(head.stdout.splitlines()[0])
    assert first["input"] == str(parquet()) and first["line"] == 1


def test_compressed_or_stdin_columnar_inputs_are_refused(tmp_path):
    shutil.copy(parquet(), tmp_path / "x.parquet.gz")
    with pytest.raises(SourceError, match="compressed parquet file cannot be read"):
        pack_api([tmp_path / "x.parquet.gz"], tmp_path / "out")
    failed = cli("pack", "-", "--input-format", "parquet", "-o", tmp_path / "o", "-t", GPT2, check=False)
    assert failed.returncode == 2 or "stdin" in failed.stderr


def test_command_line_where_and_max_doc_bytes(tmp_path):
    args = ["--text-field", "meta.body", "--where", WHERE, "--max-doc-bytes", "8KiB", "--on-error", "skip"]
    run = cli("pack", parquet(), "-o", tmp_path / "out", "-t", GPT2, "-j", "1", *args)
    assert "filtered" in run.stdout and "too_long" in run.stdout
    index = load_index(tmp_path / "out")
    assert index.options["max_doc_bytes"] == 8192 and index.options["where"] == WHERE
    bad = cli("pack", parquet(), "-o", tmp_path / "bad", "-t", GPT2, "--where", "score >=", check=False)
    assert bad.returncode == 1 and "Error: --where 'score >='" in bad.stderr and "Traceback" not in bad.stderr
    txt = tmp_path / "a.txt"
    txt.write_text("x\n")
    refused = cli("pack", txt, "-o", tmp_path / "t", "-t", GPT2, "--where", "a > 1", check=False)
    assert refused.returncode == 1 and "plain text" in refused.stderr
