"""A pack killed midway (SIGKILL, a real process) finishes with --resume and equals an
uninterrupted pack, byte for byte; while it runs, every visible shard is complete."""

from __future__ import annotations

import contextlib
import gzip
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pack_helpers import (
    GPT2,
    REPO,
    cached,
    cli,
    dataset_files,
    load_index,
    pack_api,
    wiki_lines,
    wiki_records,
    wiki_subset,
    write_parquet,
)

from wdsllm.pack.job import PackError

LINES = 6000
SMALL = ["--sample-tokens", "2048", "--shard-size", "32KiB", "--workers", "1"]
SMALL_API = {"sample_tokens": 2048, "shard_size": 32 * 1024}


def mixed_corpus() -> Path:
    """Wiki lines with bad lines of every kind mixed in (cached)."""

    def build(d):
        path = d / "mixed.jsonl.gz"
        bad = [b"{broken", b'{"title": "no text"}', b'{"text": null}', b'{"text": "\xff\xfe"}', b"", b'{"text": ""}']
        with gzip.open(path, "wb") as f:
            for i, line in enumerate(wiki_lines(LINES)):
                f.write(line.encode() + b"\n")
                if i % 61 == 7:
                    f.write(bad[i % len(bad)] + b"\n")
        return path

    return cached("resume-mixed", build)


def reference(name: str, inputs, **options) -> dict[str, bytes]:
    return cached(name, lambda d: (pack_api(inputs, d / "out", **SMALL_API, **options), dataset_files(d / "out"))[1])


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def kill_midway(
    args: list, out: Path, expected: dict[str, bytes], min_shards: int = 4, whole_group: bool = True
) -> None:
    """Start `wdsllm pack`, SIGKILL it once some shards are out; check the shards seen meanwhile."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "wdsllm.cli", "pack", *map(str, args), "-o", str(out), "-q"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the pack finished before it could be killed: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "no shards appeared"
            shards = sorted(out.glob("*.tar")) if out.exists() else []
            for shard in shards:  # a visible .tar is always complete: it was renamed into place
                with contextlib.suppress(FileNotFoundError):
                    assert shard.read_bytes() == expected[shard.name], f"{shard.name} is visible but incomplete"
            if len(shards) >= min_shards:
                break
            time.sleep(0.01)
        workers = _children(proc.pid)
        if whole_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stderr.close()
    if not whole_group:  # orphaned tokenizer workers notice and exit by themselves
        deadline = time.monotonic() + 15
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "tokenizer workers outlived the killed pack"
    assert not (out / "index.json").exists()
    for shard in out.glob("*.tar"):
        assert shard.read_bytes() == expected[shard.name], f"{shard.name} left incomplete by the kill"


def test_docs_mode_resume_after_kill_equals_uninterrupted(tmp_path):
    source = wiki_subset(LINES)
    expected = reference("resume-docs", [source])
    out = tmp_path / "out"
    kill_midway([source, "-t", GPT2, *SMALL], out, expected)
    partial = len(list(out.glob("*.tar")))
    assert 0 < partial < len(expected) - 2
    result = cli("pack", source, "-t", GPT2, *SMALL, "-o", out, "--resume")
    assert "resumed after" in result.stdout
    assert dataset_files(out) == expected
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # journal and temporaries gone


def test_packed_mode_resume_after_kill_equals_uninterrupted(tmp_path):
    source = wiki_subset(LINES)
    expected = reference("resume-packed", [source], mode="packed", seq_len=200)
    out = tmp_path / "out"
    args = [source, "-t", GPT2, *SMALL, "--mode", "packed", "--seq-len", "200"]
    kill_midway(args, out, expected, whole_group=False)
    cli("pack", *args, "-o", out, "--resume", "-q")
    assert dataset_files(out) == expected


def test_skip_mode_resume_counts_each_skip_once(tmp_path):
    source = mixed_corpus()
    expected = reference("resume-skip", [source], on_error="skip")
    out = tmp_path / "out"
    args = [source, "-t", GPT2, *SMALL, "--on-error", "skip"]
    kill_midway(args, out, expected, min_shards=6)
    # A finished shard that went missing is written again, with everything after it.
    victim = sorted(out.glob("*.tar"))[2]
    victim.unlink()
    cli("pack", *args, "-o", out, "--resume", "-q")
    assert dataset_files(out) == expected
    index = load_index(out)
    assert set(index.skipped["counts"]) == {"decode_error", "empty", "invalid_json", "missing_field"}
    assert index.skipped["total"] == index.inputs[0]["skipped"] == sum(index.skipped["counts"].values())


@pytest.mark.parametrize("seed", [14])
def test_parquet_resume_after_a_kill_at_a_random_point_equals_uninterrupted(tmp_path, seed):
    """Row groups are where a resumed Parquet input restarts; skips and --where tallies count once."""
    rng = random.Random(seed)
    source = cached("resume-parquet", lambda d: write_parquet(d / "wiki.parquet", wiki_records(LINES), 500))
    options = {"on_error": "skip", "where": "meta.lang != 'fr'"}
    expected = reference("resume-parquet-docs", [source], **options)
    out = tmp_path / "out"
    args = [source, "-t", GPT2, *SMALL, "--on-error", "skip", "--where", options["where"]]
    kill_midway(args, out, expected, min_shards=rng.randint(2, 12), whole_group=rng.random() < 0.5)
    cli("pack", *args, "-o", out, "--resume", "-q")
    assert dataset_files(out) == expected
    counts = load_index(out).skipped["counts"]
    assert counts["filtered"] == LINES // 3 and counts["missing_field"] > 0


def test_resume_refuses_other_options_and_finished_output(tmp_path):
    source = wiki_subset(200)
    out = tmp_path / "out"
    pack_api([source], out, sample_tokens=1000)
    with pytest.raises(PackError, match="already complete"):
        pack_api([source], out, sample_tokens=1000, resume=True)
    # An interrupted pack (journal present, no index) resumes only with the same options.
    (out / "index.json").unlink()
    (out / ".pack-start.json").write_text('{"fingerprint": "0000"}')
    with pytest.raises(PackError, match="differ from the interrupted pack"):
        pack_api([source], out, sample_tokens=1000, resume=True)
    with pytest.raises(PackError, match="pick one"):
        pack_api([source], out, resume=True, overwrite=True)


def test_resume_of_nothing_is_a_fresh_pack(tmp_path):
    source = wiki_subset(200)
    pack_api([source], tmp_path / "a")
    pack_api([source], tmp_path / "b", resume=True)
    assert dataset_files(tmp_path / "a") == dataset_files(tmp_path / "b")


def test_shards_then_lengths_then_index_last_then_journal_gone(tmp_path, monkeypatch):
    """The order of what becomes visible: a shard only whole, its record after it, lengths and
    group starts, index.json last."""
    from wdsllm import storage

    events = []
    local = type(storage.Output(str(tmp_path)))
    for method in ("put_file", "put_bytes", "delete"):
        real = getattr(local, method)

        def recorder(self, *args, _real=real, _method=method):
            name = args[-1] if _method == "put_file" else args[0]
            events.append((_method, name))
            return _real(self, *args)

        monkeypatch.setattr(local, method, recorder)
    pack_api([wiki_subset(LINES)], tmp_path / "out", **SMALL_API)
    puts = [name for method, name in events if method != "delete"]
    shards = [n for n in puts if n.endswith(".tar")]
    assert len(shards) > 3
    for number, shard in enumerate(shards):
        assert puts[puts.index(shard) + 1] == f".pack-shard-{number:06d}.rec"
    assert puts[-4:] == ["lengths.npy", "groups.npy", "tokenizer.json", "index.json"]
    deletes = [i for i, (method, _) in enumerate(events) if method == "delete"]
    assert deletes and min(deletes) > events.index(("put_bytes", "index.json"))
    assert events[-1] == ("delete", ".pack-start.json")
