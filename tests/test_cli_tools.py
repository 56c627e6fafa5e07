"""`wdsllm info`, `verify` and `head` on real packs, and `verify` against real corruption."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
from pack_helpers import GPT2, REPO, cached, cli, documents, load_index, pack_api, provenance, wiki_lines, wiki_subset
from tokenizers import Tokenizer

from wdsllm import format as fmt

LINES = 1500


def docs_pack() -> Path:
    """A docs-mode pack of several shards, its tokenizer named by a path relative to the repo."""

    def build(d: Path) -> Path:
        relative = Path("..") / "shared" / "data" / "tokenizers" / "gpt2.json"
        assert (REPO / relative).exists()
        cli(
            "pack",
            wiki_subset(LINES),
            "-o",
            d / "out",
            "-t",
            relative,
            "-j",
            "1",
            "-q",
            "--sample-tokens",
            "4096",
            "--shard-size",
            "64KiB",
        )
        return d / "out"

    return cached("tools-docs", build)


def packed_pack() -> Path:
    return cached(
        "tools-packed",
        lambda d: (
            pack_api(
                [wiki_subset(LINES)], d / "out", mode="packed", seq_len=64, sample_tokens=2000, shard_size=64 * 1024
            ),
            d / "out",
        )[1],
    )


def broken_copy(tmp_path: Path) -> Path:
    shutil.copytree(docs_pack(), tmp_path / "ds")
    return tmp_path / "ds"


def verify_fails(path: Path, *expected: str) -> str:
    result = cli("verify", path, "--jobs", "2", check=False)
    assert result.returncode == 1, result.stdout
    for text in expected:
        assert text in result.stdout, f"{text!r} not in:\n{result.stdout}"
    assert "OK:" not in result.stdout
    return result.stdout


# -- info ------------------------------------------------------------------------------------


def test_info_summarises_the_index():
    index = load_index(docs_pack())
    out = cli("info", docs_pack()).stdout
    assert "mode       docs, dtype uint16" in out
    assert "../shared/data/tokenizers/gpt2.json" in out and f"sha256 {index.tokenizer.sha256[:16]}" in out
    assert "vocab 50,257, bos 50256, eos 50256" in out and "added: bos no, eos yes" in out
    assert f"{index.documents:,} documents, {index.tokens:,} tokens" in out
    assert f"shards     {len(index.shards)}, " in out and "bytes/token" in out
    assert "inputs     1 file" in out and f"skipped    {index.skipped['total']}" in out
    assert "█" in out and "[8, 16)" in out and "p50" in out
    raw = json.loads(cli("info", docs_pack(), "--json").stdout)
    assert raw == json.loads((docs_pack() / "index.json").read_text())
    assert "packed     " in cli("info", packed_pack() / "index.json").stdout


def test_info_on_something_that_is_not_a_dataset(tmp_path):
    result = cli("info", tmp_path, check=False)
    assert result.returncode == 1 and "index.json" in result.stderr


# -- verify ----------------------------------------------------------------------------------


def test_verify_accepts_a_sound_dataset_in_both_modes():
    for path in (docs_pack(), packed_pack()):
        index = load_index(path)
        result = cli("verify", path, "-j", "2")
        assert result.stdout.strip().endswith(
            f"OK: {len(index.shards)} shards, {index.documents:,} documents, {index.tokens:,} tokens verified"
        )
        assert "verify [" in result.stderr  # the progress line


def test_verify_finds_a_flipped_byte_in_a_tokens_member(tmp_path):
    ds = broken_copy(tmp_path)
    shard = ds / load_index(ds).shards[1].name
    with tarfile.open(shard) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith(".tokens.npy"))
    with open(shard, "r+b") as f:
        f.seek(member.offset_data)
        npy = f.read(member.size)
        header = len(npy) - len(fmt.npy_array(npy)) * 2
        token_at = member.offset_data + header + 2 * 10  # token 10 of the sample, little-endian
        f.seek(token_at + 1)
        f.write(b"\xff")  # high byte: an id above the vocabulary
    verify_fails(ds, f"FAIL {shard.name}: token id", f"at byte {token_at}", f"{shard.name}: sha256 is")


def test_verify_finds_a_truncated_shard(tmp_path):
    ds = broken_copy(tmp_path)
    entry = load_index(ds).shards[2]
    data = (ds / entry.name).read_bytes()
    (ds / entry.name).write_bytes(data[: len(data) // 2])
    verify_fails(
        ds, f"FAIL {entry.name}: truncated at byte", f"is {len(data) // 2} bytes, the index says {entry.bytes}"
    )


def test_verify_finds_a_missing_shard(tmp_path):
    ds = broken_copy(tmp_path)
    entry = load_index(ds).shards[-1]
    (ds / entry.name).unlink()
    verify_fails(ds, f"FAIL {entry.name}: missing")


def test_verify_finds_a_bad_header_checksum(tmp_path):
    ds = broken_copy(tmp_path)
    shard = ds / load_index(ds).shards[0].name
    with tarfile.open(shard) as tf:
        second = tf.getmembers()[1]
    with open(shard, "r+b") as f:
        f.seek(second.offset + 5)  # inside the member's name in its header
        f.write(b"9")
    verify_fails(ds, f"bad tar header checksum at byte {second.offset}", shard.name)


def test_verify_finds_edited_counts_in_the_index(tmp_path):
    ds = broken_copy(tmp_path)
    body = json.loads((ds / "index.json").read_text())
    body["shards"][1]["documents"] += 1
    body["totals"]["tokens"] += 5
    (ds / "index.json").write_text(json.dumps(body))
    name = body["shards"][1]["name"]
    n = body["shards"][1]["documents"]
    verify_fails(ds, f"FAIL {name}: holds {n - 1} documents, the index says {n}", "totals.tokens is")


def test_verify_finds_a_lengths_file_that_disagrees(tmp_path):
    ds = broken_copy(tmp_path)
    lengths = fmt.npy_array((ds / "lengths.npy").read_bytes()).copy()
    lengths[7] += 1
    data = fmt.npy_bytes(lengths)
    (ds / "lengths.npy").write_bytes(data)
    verify_fails(ds, "FAIL lengths.npy: size or sha256 differs")
    body = json.loads((ds / "index.json").read_text())  # a consistent-looking index does not help
    import hashlib

    body["lengths_file"]["sha256"] = hashlib.sha256(data).hexdigest()
    (ds / "index.json").write_text(json.dumps(body))
    verify_fails(ds, "FAIL lengths.npy: document 7 is")


# -- head ------------------------------------------------------------------------------------


def test_head_decodes_documents_with_identity_and_provenance():
    out = cli("head", docs_pack(), "-n", "3").stdout
    texts = [json.loads(line)["text"] for line in wiki_lines(3)]
    assert f"==> 0000-000000000 #0  {wiki_subset(LINES)}:1  (shard-000000.tar" in out
    for text in texts:
        assert text + "<|endoftext|>" in out
    lines = cli("head", docs_pack(), "-n", "4", "--json", "--ids", "--skip-special-tokens").stdout.splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["key"], r["index"], r["line"]) for r in records] == [("0000-000000000", i, i + 1) for i in range(4)]
    assert [r["text"] for r in records[:3]] == texts
    assert [r["ids"] for r in records] == [d.tolist() for d in documents(docs_pack())[:4]]
    assert all(r["input"] == str(wiki_subset(LINES)) for r in records)


def test_head_needs_a_tokenizer_it_can_find(tmp_path):
    """head decodes with the dataset's own tokenizer.json; without it, only with --tokenizer: the
    tokenizer source the index names (a path or a Hub name from a stranger's dataset) is never
    opened unless asked (#19), even where it exists; --tokenizer overrides."""
    shutil.copytree(docs_pack(), tmp_path / "ds")
    import subprocess
    import sys

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "wdsllm.cli", "head", "ds", "-n", "1", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )

    carried = run()
    assert carried.returncode == 0 and "0000-000000000 #0" in carried.stdout and not carried.stderr
    (tmp_path / "ds" / "tokenizer.json").unlink()
    missing = run()
    assert missing.returncode == 1 and "tokenizer.json" in missing.stderr and "pass --tokenizer" in missing.stderr
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    named = tmp_path / "named-by-the-index.json"
    named.write_bytes(GPT2.read_bytes())
    del index["tokenizer_file"]  # packed before datasets carried their tokenizer
    index["tokenizer"]["source"] = str(named)  # exists and is the right tokenizer: a decode would succeed
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    failed = run()
    assert failed.returncode == 1 and "carries no tokenizer.json" in failed.stderr
    assert "pass --tokenizer" in failed.stderr and "Traceback" not in failed.stderr
    ok = run("--tokenizer", str(GPT2))
    assert ok.returncode == 0 and "0000-000000000 #0" in ok.stdout
    other = run("--tokenizer", str(REPO.parent / "shared" / "data" / "tokenizers" / "gpt-neox-20b.json"))
    assert "not the tokenizer this dataset was packed with" in other.stderr


def test_head_shows_packed_rows_with_their_documents():
    records = [
        json.loads(line) for line in cli("head", packed_pack(), "-n", "40", "--json", "--ids").stdout.splitlines()
    ]
    tok = Tokenizer.from_file(str(GPT2))
    assert all(len(r["ids"]) == 64 for r in records)
    stream = [t for r in records for t in r["ids"]]
    assert stream == [t for d in documents_of_docs_pack() for t in d][: len(stream)]
    assert records[0]["segments"][0] == {
        "input": str(wiki_subset(LINES)),
        "line": 1,
        "piece": 0,
        "offset": 0,
        "continues": False,
    }
    continued = next(r for r in records if r["segments"][0]["continues"])
    assert continued["segments"][0]["offset"] == 0
    assert records[0]["text"] == tok.decode(records[0]["ids"], skip_special_tokens=False)
    starts = {(s["line"]) for r in records for s in r["segments"] if not s["continues"]}
    assert starts == {line for _, line, _ in provenance(packed_pack())[: len(starts)]}
    text = cli("head", packed_pack(), "-n", "2").stdout
    assert "==> 0000-000000000 row 0" in text and "documents: " in text


def documents_of_docs_pack():
    return documents(docs_pack())


@pytest.mark.parametrize("command", ["info", "verify", "head"])
def test_tools_refuse_a_missing_dataset(tmp_path, command):
    result = cli(command, tmp_path / "nothing", check=False)
    assert result.returncode == 1 and "Error:" in result.stderr and "Traceback" not in result.stderr


# -- stats -----------------------------------------------------------------------------------


def test_stats_prints_the_histogram_and_every_mode(tmp_path):
    out = cli(
        "stats",
        docs_pack(),
        "--batch-size",
        "8",
        "--max-tokens",
        "2048",
        "--seq-len",
        "256",
        "--window",
        "500",
        "--plot",
        tmp_path / "hist.png",
    ).stdout
    assert "lengths" in out and "tokens per document" in out
    for mode in ("random", "random, truncated", "bucket", "pack", "concat"):
        assert f"\n{mode} " in out
    assert (tmp_path / "hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_simulation_matches_what_the_loader_yields():
    """The simulated padding and batch count of each mode equal what the loader really yields
    for one worker of one rank in epoch 0: the simulation runs the loader's own batchers."""
    import wdsllm

    data = docs_pack()
    report = json.loads(
        cli(
            "stats", data, "--batch-size", "8", "--max-tokens", "2048", "--seq-len", "256", "--window", "500", "--json"
        ).stdout
    )
    modes = {(m["mode"], m["settings"].split(",")[0]): m for m in report["modes"]}
    loaders = {
        ("random", "batch 8"): dict(batch_size=8, max_len=256),
        ("bucket", "batch 8"): dict(batching="bucket", batch_size=8, window=500, max_len=256),
        ("bucket", "budget 2048"): dict(batching="bucket", max_tokens=2048, batch_size=None, window=500, max_len=256),
        ("pack", "seq_len 256"): dict(batching="pack", seq_len=256, batch_size=8, window=500),
    }
    for key, options in loaders.items():
        batches = list(wdsllm.dataset(str(data), **options))
        padded = sum(b["input_ids"].numel() for b in batches)
        real = sum(int(b["lengths"].sum()) for b in batches)
        assert len(batches) == modes[key]["batches"], key
        assert padded == modes[key]["padded"], key
        assert real == modes[key]["tokens"], key


def test_stats_on_packed_data_says_what_its_rows_hold():
    out = cli("stats", packed_pack()).stdout
    assert "packed rows are fixed" in out and "short rows" in out
