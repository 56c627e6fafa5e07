"""Bad input stops the pack with file:line, or is skipped, counted and listed; refusals and
messages of the command line."""

from __future__ import annotations

import gzip
import time

import pytest
from pack_helpers import GPT2, cli, dataset_files, documents, jsonl, load_index, pack_api, wiki_lines, wiki_subset
from tokenizers import Tokenizer

from wdsllm.errors import TokenizerError
from wdsllm.inputs.sources import SourceError
from wdsllm.pack.job import PackError

BAD_LINES = [
    (b"{not json", "invalid_json", "invalid JSON"),
    (b'{"title": "no text"}', "missing_field", "text field 'text' is missing"),
    (b'{"text": ["a", "list"]}', "missing_field", "text field 'text' is not a string (list)"),
    (b'{"text": null}', "missing_field", "text field 'text' is not a string (null)"),
    (b'{"text": "caf\xe9"}', "decode_error", "invalid UTF-8"),
    (b'{"text": "a \\ud800 b"}', "decode_error", "text field 'text' holds a lone surrogate (U+D800) at character 2"),
]


def corpus_with(tmp_path, bad: bytes):
    """Two good lines, the bad one on line 3, one more good line."""
    return jsonl(tmp_path / "in.jsonl", ['{"text": "one"}', '{"text": "two"}', bad, '{"text": "four"}'])


@pytest.mark.parametrize("bad,reason,message", BAD_LINES, ids=[r for _, r, _ in BAD_LINES])
def test_bad_line_stops_with_file_and_line(tmp_path, bad, reason, message):
    path = corpus_with(tmp_path, bad)
    with pytest.raises(SourceError) as err:
        pack_api([path], tmp_path / "out")
    assert f"{path}:3: {message}" in str(err.value)
    assert not (tmp_path / "out" / "index.json").exists()
    assert not list((tmp_path / "out").glob("*.tar"))


@pytest.mark.parametrize(
    ("bad", "message"),
    [(b"{not json", "invalid JSON"), (b'{"text": "\\udc80"}', "text field 'text' holds a lone surrogate (U+DC80)")],
    ids=["invalid-json", "lone-surrogate"],
)
def test_bad_input_stops_the_command_line_with_file_and_line(tmp_path, bad, message):
    path = corpus_with(tmp_path, bad)
    result = cli("pack", path, "-o", tmp_path / "out", "-t", GPT2, "-j", "1", check=False)
    assert result.returncode == 1
    assert f"Error: {path}:3: {message}" in result.stderr
    assert "Traceback" not in result.stderr and "a bug in wdsllm" not in result.stderr


def test_on_error_skip_counts_and_lists_every_bad_line(tmp_path):
    lines = ['{"text": "good"}'] + [bad for bad, _, _ in BAD_LINES] + [b"", b'{"text": "  "}', '{"text": "last"}']
    path = jsonl(tmp_path / "in.jsonl", lines)
    result = cli("pack", path, "-o", tmp_path / "out", "-t", GPT2, "-j", "1", "--on-error", "skip")
    assert "packed 2 documents" in result.stdout
    assert "skipped 8: decode_error 2, empty 2, invalid_json 1, missing_field 3" in result.stdout
    assert f"{path}:2: invalid_json" in result.stdout and f"{path}:6: decode_error" in result.stdout
    index = load_index(tmp_path / "out")
    assert index.skipped["counts"] == {"decode_error": 2, "empty": 2, "invalid_json": 1, "missing_field": 3}
    assert index.skipped["total"] == 8 and index.skipped["records_truncated"] is False
    records = index.skipped["records"]
    assert [(r["file"], r["line"], r["reason"]) for r in records] == [
        (str(path), n, reason) for n, (_, reason, _) in enumerate(BAD_LINES, 2)
    ]
    assert all(r["detail"] for r in records)
    assert index.inputs[0]["documents"] == 2 and index.inputs[0]["skipped"] == 8
    assert len(documents(tmp_path / "out")) == 2


def test_undecodable_line_in_text_input(tmp_path):
    (tmp_path / "in.txt").write_bytes(b"fine\nbad \xff byte\nfine again\n")
    with pytest.raises(SourceError, match=r"in.txt:2: invalid UTF-8"):
        pack_api([tmp_path / "in.txt"], tmp_path / "out")
    pack_api([tmp_path / "in.txt"], tmp_path / "out2", on_error="skip")
    assert load_index(tmp_path / "out2").skipped["counts"] == {"decode_error": 1}
    assert len(documents(tmp_path / "out2")) == 2


def test_empty_documents_are_skipped_and_counted(tmp_path):
    path = jsonl(tmp_path / "in.jsonl", [{"text": ""}, {"text": "x"}, {"text": " \n\t"}, "", {"text": "y"}])
    result = pack_api([path], tmp_path / "out")  # empty is not an error, even with --on-error stop
    assert result.index.documents == 2
    assert result.index.skipped["counts"] == {"empty": 3} and result.index.skipped["records"] == []


def test_a_document_without_tokens_is_empty(tmp_path):
    """Without BOS and EOS, text the tokenizer maps to nothing must not become a 0-token document."""
    from tokenizers import models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Replace("x", "")
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "in.txt").write_text("a b\nxxx\nb\n")
    for mode in ({"mode": "docs"}, {"mode": "packed", "seq_len": 2}):
        out = tmp_path / mode["mode"]
        result = pack_api([tmp_path / "in.txt"], out, tmp_path / "tok.json", bos=False, eos=False, **mode)
        assert result.index.documents == 2 and result.index.skipped["counts"] == {"empty": 1}
        assert result.index.tokens == 3


def test_non_empty_output_needs_overwrite(tmp_path):
    path = wiki_subset(100)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("old")
    result = cli("pack", path, "-o", tmp_path / "out", "-t", GPT2, "-j", "1", check=False)
    assert result.returncode == 1 and "is not empty; pass --overwrite" in result.stderr
    assert (tmp_path / "out" / "stale.txt").exists()
    cli("pack", path, "-o", tmp_path / "out", "-t", GPT2, "-j", "1", "--overwrite", "-q")
    assert "stale.txt" not in dataset_files(tmp_path / "out") and (tmp_path / "out" / "index.json").exists()


def test_offline_tokenizer_name_fails_fast_and_clearly(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": ""}
    start = time.monotonic()
    result = cli("pack", wiki_subset(100), "-o", tmp_path / "out", "-t", "gpt2", env=env, check=False)
    assert time.monotonic() - start < 20
    assert result.returncode == 1
    assert "cannot load tokenizer 'gpt2'" in result.stderr and "Pass the path of a tokenizer.json" in result.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        pack_api([wiki_subset(100)], tmp_path / "out", tokenizer=tmp_path / "nope.json")


@pytest.mark.parametrize(
    "options,message",
    [
        ({"mode": "packed"}, "needs --seq-len"),
        ({"seq_len": 128}, "applies to --mode packed only"),
        ({"mode": "packed", "seq_len": 8, "max_doc_tokens": 4}, "applies to --mode docs only"),
        ({"prefix": "../evil"}, "--prefix"),
        ({"num_tasks": 2, "task_index": 2}, "outside 0..1"),
        ({"shard_size": 100}, "at least 4096"),
    ],
)
def test_contradictory_options_are_refused_before_any_work(tmp_path, options, message):
    with pytest.raises(PackError, match=message):
        pack_api([wiki_subset(100)], tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_progress_on_stderr_summary_on_stdout_and_quiet(tmp_path):
    path = wiki_subset(300)
    loud = cli("pack", path, "-o", tmp_path / "a", "-t", GPT2, "-j", "1")
    assert loud.stdout.startswith("packed 300 documents")
    assert "tokens/s" in loud.stdout and "bytes/token" in loud.stdout
    assert "100.0%" in loud.stderr and "docs/s" in loud.stderr and "tok/s" in loud.stderr and "1 shard" in loud.stderr
    quiet = cli("pack", path, "-o", tmp_path / "b", "-t", GPT2, "-j", "1", "--quiet")
    assert quiet.stdout == "" and quiet.stderr == ""
    assert dataset_files(tmp_path / "a") == dataset_files(tmp_path / "b")


def test_a_damaged_compressed_file_keeps_what_came_before_whatever_the_chunking(tmp_path):
    """A truncated .jsonl.gz: an error naming the line with --on-error raise; with skip, the
    documents before the damage are kept (the same ones for any chunking) and the rest is one
    `unreadable` record."""
    data = gzip.compress(("\n".join(wiki_lines(3000)) + "\n").encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(SourceError, match=r"cut.jsonl.gz:\d+: cannot decompress after line \d+"):
        pack_api([tmp_path / "cut.jsonl.gz"], tmp_path / "raise")
    outputs = []
    for chunk_bytes in (4 << 10, 100 << 10, 1 << 20):
        out = tmp_path / f"skip{chunk_bytes}"
        result = pack_api([tmp_path / "cut.jsonl.gz"], out, on_error="skip", chunk_bytes=chunk_bytes)
        outputs.append(dataset_files(out))
    (record,) = result.index.skipped["records"]
    assert record["reason"] == "unreadable" and result.index.documents == record["line"] - 1 > 1000
    assert outputs[0] == outputs[1] == outputs[2]
