"""``wdsllm pack -o s3://bucket/prefix/`` against a moto server: shards upload as they complete
(multipart when large), the index goes last, a pack killed at any point never leaves an index
that names a missing shard, and ``--resume`` finishes it byte for byte as an uninterrupted pack."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wdsllm import storage
from wdsllm.pack.job import PackConfig, pack
from wdsllm.pack.writer import JOURNAL_PREFIX, journal_record_name

SHARED_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"  # as in conftest.py
TOKENIZERS = SHARED_DATA / "tokenizers"
WIKI = sorted((SHARED_DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))

# 3000 Wikipedia documents in shards of 64 KiB: about 20 shards, packed in about two seconds.
PACK_ARGS = [
    "-t",
    str(TOKENIZERS / "gpt2.json"),
    "--shard-size",
    "64K",
    "--sample-tokens",
    "4096",
    "--workers",
    "1",
    "-q",
]
# A low threshold (multipart needs two parts of at least 5 MiB: test_storage shows it; shards
# here are smaller and go up in one PUT)
MULTIPART_ENV = {"WDSLLM_S3_MULTIPART_THRESHOLD": str(32 * 1024)}

# Runs `wdsllm pack` with storage patched to SIGKILL the process at one point of the upload.
KILLING_PACK = r"""
import os, signal, sys
from wdsllm import storage
from wdsllm.cli import main

point, args = sys.argv[1], sys.argv[2:]
Out = storage.s3.S3Output
put_file, put_bytes, delete = Out.put_file, Out.put_bytes, Out.delete
shards = [0]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def patched_put_file(self, path, name):
    if point == "before-" + name:  # lengths.npy and groups.npy go up from a staged file too
        die()
    if not name.endswith(".tar"):
        return put_file(self, path, name)
    if point == "before-shard-3" and shards[0] == 3:
        die()
    put_file(self, path, name)
    shards[0] += 1
    if point == "after-shard-3" and shards[0] == 4:
        die()

def patched_put_bytes(self, name, data):
    if point == "before-" + name:
        die()
    put_bytes(self, name, data)

def patched_delete(self, name):
    if point == "journal-cleanup":
        die()
    delete(self, name)

Out.put_file, Out.put_bytes, Out.delete = patched_put_file, patched_put_bytes, patched_delete
main(args)
"""


@pytest.fixture(scope="module")
def wiki_input(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wiki") / "wiki-head.jsonl"
    with gzip.open(WIKI[0], "rt", encoding="utf-8") as src, open(path, "w", encoding="utf-8") as out:
        out.writelines(itertools.islice(src, 3000))
    return path


def run_pack(*args: str, env: dict | None = None, driver: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", KILLING_PACK, driver] if driver else [sys.executable, "-m", "wdsllm.cli"]
    return subprocess.run(
        [*cmd, "pack", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **MULTIPART_ENV, **(env or {})},
    )


def objects(s3_server, url: str) -> dict[str, bytes]:
    """name -> bytes of every object under s3://bucket/prefix/."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    client = s3_server.client()
    listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listing}


def check_index_never_points_at_missing_shards(found: dict[str, bytes]) -> bool:
    """If an index exists, every shard it names exists with its size and sha256. Returns whether
    an index exists."""
    if "index.json" not in found:
        return False
    index = json.loads(found["index.json"])
    for entry in index["shards"]:
        data = found.get(entry["name"])
        assert data is not None, f"index.json names {entry['name']}, which is missing"
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["bytes"], entry["sha256"]), entry["name"]
    lengths = found.get(index["lengths_file"]["name"])
    assert lengths is not None and hashlib.sha256(lengths).hexdigest() == index["lengths_file"]["sha256"]
    return True


@pytest.fixture(scope="module")
def uninterrupted(wiki_input, s3_server) -> dict[str, bytes]:
    """The objects of an uninterrupted pack of the same input with the same options."""
    url = f"s3://{s3_server.new_bucket()}/full/"
    result = run_pack(str(wiki_input), "-o", url, *PACK_ARGS)
    assert result.returncode == 0, result.stderr
    found = objects(s3_server, url)
    assert check_index_never_points_at_missing_shards(found)
    assert not [n for n in found if n.startswith(JOURNAL_PREFIX)], "the journal is removed once the index is up"
    assert len([n for n in found if n.endswith(".tar")]) >= 10
    return found


def test_pack_uploads_each_shard_as_it_completes_multipart_and_the_index_last(
    wiki_input, s3_server, s3_bucket, monkeypatch
):
    monkeypatch.setattr(storage.s3, "MULTIPART_THRESHOLD", 32 * 1024)
    events: list[tuple[str, str]] = []
    Out = storage.s3.S3Output
    put_file, put_bytes, delete = Out.put_file, Out.put_bytes, Out.delete

    def spy_put_file(self, path, name):
        if not name.endswith(".tar"):  # lengths.npy and groups.npy, staged a piece at a time
            events.append(("side", name))
            return put_file(self, path, name)
        # Only the shard being uploaded waits on local disk: finished shards do not pile up.
        staged = [p for p in os.listdir(self.local_staging_dir()) if not p.startswith(".")]
        assert staged == [os.path.basename(path)] or staged == [], staged
        assert sum(1 for e in events if e[0] == "file") == int(name[len("shard-") : -len(".tar")])
        events.append(("file", name))
        put_file(self, path, name)

    monkeypatch.setattr(Out, "put_file", spy_put_file)
    monkeypatch.setattr(
        Out, "put_bytes", lambda self, name, data: (events.append(("bytes", name)), put_bytes(self, name, data))[1]
    )
    monkeypatch.setattr(Out, "delete", lambda self, name: (events.append(("delete", name)), delete(self, name))[1])

    url = f"{s3_bucket}/ds/"
    cfg = PackConfig(
        inputs=[str(wiki_input)],
        output=url,
        tokenizer=str(TOKENIZERS / "gpt2.json"),
        shard_size=64 * 1024,
        sample_tokens=4096,
        workers=1,
    )
    result = pack(cfg)
    names = [n for _, n in events]
    shards = [n for kind, n in events if kind == "file"]
    assert shards == [e.name for e in result.index.shards] and len(shards) >= 10
    # Every shard is vouched for by its journal record right after its upload; the index is the
    # last object written, after lengths.npy; the journal is deleted only after the index.
    for number, shard in enumerate(shards):
        assert names[names.index(shard) + 1] == journal_record_name(number)
    writes = [n for kind, n in events if kind != "delete"]
    assert writes[-4:] == ["lengths.npy", "groups.npy", "tokenizer.json", "index.json"]
    assert all(kind == "delete" for kind, _ in events[names.index("index.json") + 1 :])
    found = objects(s3_server, url)
    assert check_index_never_points_at_missing_shards(found)
    assert sorted(found) == sorted([*shards, "lengths.npy", "groups.npy", "tokenizer.json", "index.json"])


@pytest.mark.parametrize(
    "point", ["before-shard-3", "after-shard-3", "before-lengths.npy", "before-index.json", "journal-cleanup"]
)
def test_pack_killed_at_any_point_then_resumed_equals_an_uninterrupted_pack(
    point, wiki_input, s3_server, s3_bucket, uninterrupted
):
    url = f"{s3_bucket}/ds/"
    killed = run_pack(str(wiki_input), "-o", url, *PACK_ARGS, driver=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    found = objects(s3_server, url)
    has_index = check_index_never_points_at_missing_shards(found)
    assert has_index == (point == "journal-cleanup")
    if point == "before-shard-3":
        assert "shard-000002.tar" in found and "shard-000003.tar" not in found

    resumed = run_pack(str(wiki_input), "-o", url, *PACK_ARGS, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert objects(s3_server, url) == uninterrupted


def test_pack_killed_from_outside_mid_run_then_resumed(wiki_input, s3_server, s3_bucket, uninterrupted):
    url = f"{s3_bucket}/ds/"
    bucket, prefix = s3_bucket[len("s3://") :], "ds/"
    client = s3_server.client()
    proc = subprocess.Popen(
        [sys.executable, "-m", "wdsllm.cli", "pack", str(wiki_input), "-o", url, *PACK_ARGS],
        env={**os.environ, **MULTIPART_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
            if sum(o["Key"].endswith(".tar") for o in listing) >= 3:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    found = objects(s3_server, url)
    # Usually killed mid-run with no index; if the pack won the race, its index must be whole.
    complete = check_index_never_points_at_missing_shards(found)
    if not complete:
        assert sum(n.endswith(".tar") for n in found) >= 3
        resumed = run_pack(str(wiki_input), "-o", url, *PACK_ARGS, "--resume")
        assert resumed.returncode == 0, resumed.stderr
    assert objects(s3_server, url) == uninterrupted


def test_resume_of_a_complete_s3_pack_is_refused(wiki_input, s3_server, s3_bucket):
    url = f"{s3_bucket}/ds/"
    assert run_pack(str(wiki_input), "-o", url, *PACK_ARGS).returncode == 0
    again = run_pack(str(wiki_input), "-o", url, *PACK_ARGS, "--resume")
    assert again.returncode != 0 and "already complete" in again.stderr
    refused = run_pack(str(wiki_input), "-o", url, *PACK_ARGS)
    assert refused.returncode != 0 and "not empty" in refused.stderr
