"""Every kind of input: txt (line, paragraph, file; CRLF), jsonl with a dotted field, compressed
files, directories, globs, brace patterns and stdin."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma

import pytest
import zstandard
from pack_helpers import GPT2, cli, documents, load_index, pack_api, provenance, wiki_lines
from tokenizers import Tokenizer

from wdsllm.inputs.sources import SourceError, expand_inputs

EOS = 50256
_tok = Tokenizer.from_file(str(GPT2))


def encoded(*texts: str) -> list[list[int]]:
    return [[*e.ids, EOS] for e in _tok.encode_batch(list(texts), add_special_tokens=False)]


def docs_of(out) -> list[list[int]]:
    return [d.tolist() for d in documents(out)]


def test_txt_lines_with_crlf(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfFirst line\r\nSecond line\r\n\r\n  \r\nLast, no newline")
    pack_api([tmp_path / "a.txt"], tmp_path / "out")
    assert docs_of(tmp_path / "out") == encoded("First line", "Second line", "Last, no newline")
    assert [line for _, line, _ in provenance(tmp_path / "out")] == [1, 2, 5]
    assert load_index(tmp_path / "out").skipped["counts"] == {"empty": 2}


def test_txt_paragraphs_with_crlf(tmp_path):
    text = "\r\n\r\nOne a\r\nOne b\r\n\r\n\r\nTwo\r\n \t\r\nThree a\r\nThree b\r\n"
    (tmp_path / "p.txt").write_bytes(text.encode())
    pack_api([tmp_path / "p.txt"], tmp_path / "out", split="paragraph", chunk_bytes=16)
    assert docs_of(tmp_path / "out") == encoded("One a\nOne b", "Two", "Three a\nThree b")
    assert [line for _, line, _ in provenance(tmp_path / "out")] == [3, 7, 9]


def test_txt_whole_files(tmp_path):
    (tmp_path / "one.txt").write_bytes(b"Title\r\n\r\nBody line 1\r\nBody line 2\r\n")
    (tmp_path / "two.txt").write_bytes(b"Just one line")
    pack_api([tmp_path / "one.txt", tmp_path / "two.txt"], tmp_path / "out", split="file", chunk_bytes=16)
    assert docs_of(tmp_path / "out") == encoded("Title\n\nBody line 1\nBody line 2\n", "Just one line")
    assert provenance(tmp_path / "out") == [(0, 1, 0), (1, 1, 0)]


def test_jsonl_dotted_field_in_every_compression(tmp_path):
    records = [{"id": i, "meta": {"body": json.loads(line)["text"] or "stub"}} for i, line in enumerate(wiki_lines(40))]
    raw = ("\n".join(json.dumps(r) for r in records) + "\n").encode()
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + raw)  # a BOM is not part of the first record
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "d.jsonl.bz2").write_bytes(bz2.compress(raw))
    (tmp_path / "d.jsonl.xz").write_bytes(lzma.compress(raw))
    names = ["d.jsonl", "d.jsonl.gz", "d.jsonl.zst", "d.jsonl.bz2", "d.jsonl.xz"]
    pack_api([tmp_path / n for n in names], tmp_path / "out", text_field="meta.body", chunk_bytes=4096)
    expected = encoded(*[r["meta"]["body"] for r in records])
    assert docs_of(tmp_path / "out") == expected * len(names)
    index = load_index(tmp_path / "out")
    assert [i["documents"] for i in index.inputs] == [len(records)] * len(names)
    assert [i["path"] for i in index.inputs] == [str(tmp_path / n) for n in names]


def test_directories_globs_and_braces_expand_in_sorted_order(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for name in ["b.jsonl", "a.jsonl", "sub/c.txt.gz", ".hidden.txt", "notes.md", "sub/d.jsonl.zst"]:
        (root / name).write_bytes(b"")
    paths = lambda pattern: [i.path for i in expand_inputs([pattern])]  # noqa: E731
    assert paths(str(root)) == [str(root / n) for n in ["a.jsonl", "b.jsonl", "sub/c.txt.gz", "sub/d.jsonl.zst"]]
    assert paths(str(root / "*.jsonl")) == [str(root / "a.jsonl"), str(root / "b.jsonl")]
    assert paths(str(root / "**" / "*.gz")) == [str(root / "sub" / "c.txt.gz")]
    assert paths(str(root / "{b,a}.jsonl")) == [str(root / "b.jsonl"), str(root / "a.jsonl")]
    kinds = {i.path.rsplit("/", 1)[1]: (i.kind, i.compression) for i in expand_inputs([str(root)])}
    assert kinds["c.txt.gz"] == ("txt", "gz") and kinds["d.jsonl.zst"] == ("jsonl", "zst")
    # Named twice: read once, where first named.
    assert [i.path for i in expand_inputs([str(root / "b.jsonl"), str(root / "*.jsonl")])] == [
        str(root / "b.jsonl"),
        str(root / "a.jsonl"),
    ]


def test_input_errors_name_the_pattern(tmp_path):
    with pytest.raises(SourceError, match="input not found: .*missing.txt"):
        expand_inputs([str(tmp_path / "missing.txt")])
    with pytest.raises(SourceError, match="no input files match"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    (tmp_path / "data.csv").write_text("x")
    with pytest.raises(SourceError, match="data.csv: unknown input type"):
        expand_inputs([str(tmp_path / "data.csv")])
    with pytest.raises(SourceError, match="--input-format"):
        expand_inputs(["-"])
    assert expand_inputs([str(tmp_path / "data.csv")], input_format="txt")[0].kind == "txt"


def test_directory_input_packs_every_file(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\nbeta\n")
    (root / "sub" / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "gamma"}\n'))
    pack_api([root], tmp_path / "out")
    assert docs_of(tmp_path / "out") == encoded("alpha", "beta", "gamma")
    assert [i["path"] for i in load_index(tmp_path / "out").inputs] == [
        str(root / "a.txt"),
        str(root / "sub" / "b.jsonl.gz"),
    ]


def test_stdin_needs_and_uses_input_format(tmp_path):
    data = b'{"text": "from a pipe"}\n{"text": "second"}\n'
    result = cli("pack", "-", "--input-format", "jsonl", "-o", tmp_path / "out", "-t", GPT2, "-j", "1", stdin=data)
    assert "packed 2 documents" in result.stdout
    assert docs_of(tmp_path / "out") == encoded("from a pipe", "second")
    assert load_index(tmp_path / "out").inputs[0]["path"] == "<stdin>"
    failed = cli("pack", "-", "-o", tmp_path / "out2", "-t", GPT2, stdin=data, check=False)
    assert failed.returncode != 0 and "--input-format" in failed.stderr
