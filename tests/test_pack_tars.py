"""Raw-text WebDataset tars as input: `.txt` members, or a field of `.json` members, are documents;
provenance is (tar, sample number) plus the sample's key."""

from __future__ import annotations

import gzip
import json

import pytest
import webdataset as wds
from pack_helpers import (
    GPT2,
    cached,
    cli,
    dataset_files,
    documents,
    encode_texts,
    groups,
    load_index,
    pack_api,
    provenance,
    wiki_lines,
)

from wdsllm.errors import SourceError
from wdsllm.format.verify import verify

SAMPLES = 400


def samples() -> list[dict]:
    """webdataset samples of every shape: .txt; .json only; .txt with a .json beside it; neither;
    bad UTF-8; empty text."""
    out = []
    for i, line in enumerate(wiki_lines(SAMPLES)):
        text = json.loads(line)["text"] or "stub"
        sample = {"__key__": f"doc/{i:05d}"}
        shape = i % 7
        if shape in (0, 1, 2):
            sample["txt"] = text
        elif shape == 3:
            sample["json"] = {"body": {"text": text}, "score": i % 10}
        elif shape == 4:
            sample["txt"] = text
            sample["json"] = {"score": i % 10}
        elif shape == 5 and i % 2:
            sample["cls"] = b"1"  # neither .txt nor .json
        elif shape == 5:
            sample["txt"] = text.encode() + b"\xff"
        else:
            sample["txt"] = " " if i % 3 == 0 else text
        out.append(sample)
    return out


def write_tar(path, items) -> None:
    with wds.TarWriter(str(path)) as sink:
        for sample in items:
            sink.write(dict(sample))


def tars():
    """The samples in two tars, the second gzip-compressed."""

    def build(d):
        write_tar(d / "a.tar", samples()[:250])
        write_tar(d / "b.tar", samples()[250:])
        (d / "b.tar.gz").write_bytes(gzip.compress((d / "b.tar").read_bytes()))
        return [d / "a.tar", d / "b.tar.gz"]

    return cached("tar-inputs", build)


def expected(where=None, text_field="body.text"):
    """(tar index, sample number, key, text) of every document pack should keep, in order."""
    out = []
    for i, s in enumerate(samples()):
        tar, number = (0, i + 1) if i < 250 else (1, i - 249)
        meta = s.get("json", {})
        if where is not None and not where(meta):
            continue
        if "txt" in s:
            text = s["txt"]
            if isinstance(text, bytes) or not text.strip():
                continue
        elif "json" in s:
            text = meta["body"]["text"]
        else:
            continue
        out.append((tar, number, s["__key__"], text))
    return out


def test_tars_round_trip_with_keys(tmp_path):
    out = tmp_path / "out"
    result = pack_api(tars(), out, text_field="body.text", on_error="skip", chunk_bytes=8 << 10)
    want = expected()
    assert [d.tolist() for d in documents(out)] == encode_texts([t for *_, t in want])
    assert provenance(out) == [(tar, n, 0) for tar, n, _, _ in want]
    keys = [k for g in groups(out) for k in g.meta["source_keys"]]
    assert keys == [k for _, _, k, _ in want]
    assert verify(str(out)).ok
    counts = result.index.skipped["counts"]
    assert counts["missing_field"] == sum(1 for s in samples() if not ({"txt", "json"} & set(s)))
    assert counts["decode_error"] == sum(isinstance(s.get("txt"), bytes) for s in samples())
    bad = next(r for r in result.index.skipped["records"] if r["reason"] == "decode_error")
    assert bad["key"].startswith("doc/") and bad["file"].endswith("a.tar")
    # head shows where a document came from: the tar, the sample's number and its key
    head = cli("head", out, "-n", "2", "--json")
    first = json.loads(head.stdout.splitlines()[0])
    assert (first["line"], first["source_key"]) == (1, "doc/00000")
    assert "(doc/00001)" in cli("head", out, "-n", "2").stdout


def test_where_reads_the_json_member(tmp_path):
    out = tmp_path / "out"
    result = pack_api(tars(), out, text_field="body.text", where="score >= 5", on_error="skip")
    want = expected(where=lambda meta: meta.get("score", -1) >= 5)
    assert [d.tolist() for d in documents(out)] == encode_texts([t for *_, t in want])
    # samples without a .json read --where's fields as null: filtered
    assert result.index.skipped["counts"]["filtered"] == sum(
        1 for s in samples() if s.get("json", {}).get("score", -1) < 5
    )


def test_packed_mode_keeps_keys_of_the_documents_that_start_in_a_group(tmp_path):
    out = tmp_path / "out"
    pack_api(tars(), out, text_field="body.text", on_error="skip", mode="packed", seq_len=256, sample_tokens=2048)
    keys = [k for g in groups(out) for k in g.meta["source_keys"]]
    assert keys == [k for _, _, k, _ in expected()]
    assert verify(str(out)).ok


def test_bad_samples_stop_the_pack_naming_the_sample(tmp_path):
    with pytest.raises(SourceError, match=r"a.tar: sample 6 \(doc/00005\): the sample has no .txt and no .json"):
        pack_api(tars()[:1], tmp_path / "a", text_field="body.text")
    write_tar(tmp_path / "u.tar", [s for s in samples()[:20] if "cls" not in s])
    with pytest.raises(SourceError, match=r"u.tar: sample 12 \(doc/00012\): invalid UTF-8 at byte"):
        pack_api([tmp_path / "u.tar"], tmp_path / "u", text_field="body.text")
    with pytest.raises(SourceError, match=r"a.tar: sample 4 \(doc/00003\): text field 'text' of the .json member is"):
        pack_api(tars()[:1], tmp_path / "b")


def test_a_truncated_tar_keeps_what_came_before(tmp_path):
    clean = [s for s in samples() if isinstance(s.get("txt"), str) and s["txt"].strip()][:100]
    write_tar(tmp_path / "whole.tar", clean)
    data = (tmp_path / "whole.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2 + 100])
    with pytest.raises(SourceError, match=r"cut.tar: sample \d+: not a readable tar from sample \d+ on"):
        pack_api([tmp_path / "cut.tar"], tmp_path / "a")
    result = pack_api([tmp_path / "cut.tar"], tmp_path / "b", on_error="skip")
    assert result.index.skipped["counts"] == {"unreadable": 1}
    lost = result.index.skipped["records"][0]["line"]
    assert result.index.documents == lost - 1  # every sample before the one that broke
    assert [d.tolist() for d in documents(tmp_path / "b")] == encode_texts([s["txt"] for s in clean[: lost - 1]])


def test_too_long_members_are_never_read(tmp_path):
    items = [{"__key__": "a", "txt": "short"}, {"__key__": "b", "txt": "x" * 5000}, {"__key__": "c", "txt": "end"}]
    write_tar(tmp_path / "t.tar", items)
    with pytest.raises(SourceError, match=r"t.tar: sample 2 \(b\): document of 5000 bytes is longer than"):
        pack_api([tmp_path / "t.tar"], tmp_path / "a", max_doc_bytes=4096)
    result = pack_api([tmp_path / "t.tar"], tmp_path / "b", max_doc_bytes=4096, on_error="skip")
    assert [d.tolist() for d in documents(tmp_path / "b")] == encode_texts(["short", "end"])
    assert result.index.skipped["records"] == [
        {"file": str(tmp_path / "t.tar"), "line": 2, "reason": "too_long", "detail": "5000 bytes", "key": "b"}
    ]


def test_a_tar_from_stdin(tmp_path):
    data = tars()[0].read_bytes()
    args = ["pack", "-", "--input-format", "wds", "--text-field", "body.text", "--on-error", "skip", "-t", GPT2]
    cli(*args, "-o", tmp_path / "piped", "-j", "1", "-q", stdin=data)
    pack_api(tars()[:1], tmp_path / "file", text_field="body.text", on_error="skip")
    assert [d.tolist() for d in documents(tmp_path / "piped")] == [d.tolist() for d in documents(tmp_path / "file")]
    assert load_index(tmp_path / "piped").inputs[0]["path"] == "<stdin>"
    assert dataset_files(tmp_path / "file")  # (the file pack is complete too)
