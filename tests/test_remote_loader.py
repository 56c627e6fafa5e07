"""The loader against real servers on 127.0.0.1: every kind of source, faults, fast permanent
errors, skipping dead shards, the shard cache, and a pack to S3 streamed by ranks x workers."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from synth import write_dataset

import wdsllm
from wdsllm import storage
from wdsllm.load.sources.open import open_source
from wdsllm.storage import NotFoundError, RetryPolicy, StorageError

SHARED_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"  # as in conftest.py
TOKENIZERS = SHARED_DATA / "tokenizers"
WIKI = sorted((SHARED_DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))

# Short timeouts and delays: a stalled read gives up after 0.4 s, a retry waits at most 50 ms.
FAST = RetryPolicy(attempts=5, base_delay=0.01, max_delay=0.05, timeout=0.4)
DOCS_PER_SHARD = [40, 25, 55, 30, 50]
NAMES = [f"shard-{i:06d}.tar" for i in range(len(DOCS_PER_SHARD))]
LOAD = dict(batch_size=8, seed=7, shuffle_buffer=64)


def documents(batches) -> list[tuple[int, int, bytes]]:
    """(document id, piece, token bytes) of every item, in the order the batches hold them."""
    out = []
    for batch in batches:
        docs, lengths, ids = batch["docs"].numpy(), batch["lengths"].numpy(), batch["input_ids"].numpy()
        for i in range(len(lengths)):
            out.append((int(docs[i, 0]), int(docs[i, 1]), ids[i, : lengths[i]].astype(np.uint16).tobytes()))
    return out


def expected_documents(info: dict) -> dict[int, bytes]:
    return {i: t.astype(np.uint16).tobytes() for i, t in info["expect"].items()}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A small real dataset on disk: (directory, {item id: tokens})."""
    root = tmp_path_factory.mktemp("synth")
    info = write_dataset(root / "ds", DOCS_PER_SHARD, seed=3)
    return root / "ds", expected_documents(info)


@pytest.fixture
def served(synth, http_server):
    """The synthetic dataset served over HTTP: (root URL without a trailing slash, expected docs)."""
    shutil.copytree(synth[0], http_server.root / "ds")
    return http_server.url_for("ds").rstrip("/"), synth[1]


@pytest.fixture(scope="module")
def s3_synth(synth, s3_server):
    """The synthetic dataset uploaded to a bucket of its own: s3://bucket/ds."""
    url = f"s3://{s3_server.new_bucket()}/ds"
    s3_server.upload_dir(synth[0], url + "/")
    return url


@pytest.fixture(scope="module")
def local_run(synth):
    """What the loader yields from the local directory (the reference for every remote run)."""
    return documents(wdsllm.loader(str(synth[0]), **LOAD))


@pytest.fixture(scope="module")
def local_run_2_workers(synth):
    """The reference for remote runs with 2 workers (the plan depends on the worker count)."""
    return documents(wdsllm.loader(str(synth[0]), num_workers=2, **LOAD))


@pytest.fixture(scope="module")
def wiki_input(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wiki") / "wiki-head.jsonl"
    with gzip.open(WIKI[0], "rt", encoding="utf-8") as src, open(path, "w", encoding="utf-8") as out:
        out.writelines(itertools.islice(src, 3000))
    return path


PACK_OPTIONS = [
    "-t",
    str(TOKENIZERS / "gpt2.json"),
    "--shard-size",
    "200K",
    "--sample-tokens",
    "8192",
    "--workers",
    "1",
    "-q",
]


@pytest.fixture(scope="module")
def wiki_local(wiki_input, tmp_path_factory) -> Path:
    """The 3000 documents packed to local disk in shards of 200 KiB (5 shards)."""
    out = tmp_path_factory.mktemp("wiki-local") / "wiki"
    result = _cli("pack", str(wiki_input), "-o", str(out), *PACK_OPTIONS)
    assert result.returncode == 0, result.stderr
    return out


# ----------------------------------------------------------------------------------------------
# Every kind of source


SOURCES = {
    "path": lambda d, h, s: str(d),
    "path/": lambda d, h, s: f"{d}/",
    "file://": lambda d, h, s: f"file://{d}",
    "file:///": lambda d, h, s: f"file://{d}/",
    "file://index.json": lambda d, h, s: f"file://{d}/index.json",
    "path-braces": lambda d, h, s: f"{d}/shard-{{000000..000004}}.tar",
    "file://braces": lambda d, h, s: f"file://{d}/shard-{{000000..000004}}.tar",
    "path-glob": lambda d, h, s: f"{d}/shard-*.tar",
    "https-root": lambda d, h, s: h,
    "https-root/": lambda d, h, s: f"{h}/",
    "https-index.json": lambda d, h, s: f"{h}/index.json",
    "https-braces": lambda d, h, s: f"{h}/shard-{{000000..000004}}.tar",
    "s3-root": lambda d, h, s: s,
    "s3-root/": lambda d, h, s: f"{s}/",
    "s3-index.json": lambda d, h, s: f"{s}/index.json",
    "s3-braces": lambda d, h, s: f"{s}/shard-{{000000..000004}}.tar",
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_every_kind_of_source_gives_the_local_documents_in_the_local_order(kind, synth, served, s3_synth, local_run):
    source = SOURCES[kind](synth[0], served[0], s3_synth)
    catalog = open_source(source)
    assert catalog.index is not None, f"{source}: the index beside the shards should be found"
    assert documents(wdsllm.loader(source, **LOAD)) == local_run
    assert documents(wdsllm.dataset(source, **LOAD)) == local_run


def test_pipe_source_typed_by_the_user_reads_every_document(synth):
    source = f"pipe:cat {synth[0]}/shard-{{000000..000004}}.tar"
    got = documents(wdsllm.dataset(source, **LOAD))
    assert sorted((i, t) for i, _, t in got) == sorted(synth[1].items())


def test_list_of_urls_across_schemes(synth, served, s3_synth):
    urls = [
        f"{served[0]}/{NAMES[0]}",
        f"{s3_synth}/{NAMES[1]}",
        f"file://{synth[0]}/{NAMES[2]}",
        str(synth[0] / NAMES[3]),
    ]
    got = documents(wdsllm.dataset(urls, **LOAD))
    # Without one root there is no index; ids use the shards' positions in the list, as here.
    assert sorted((i, t) for i, _, t in got) == sorted((i, t) for i, t in synth[1].items() if i >> 32 < 4)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wdsllm.cli", *args], capture_output=True, text=True, timeout=120)


def _cli_has(command: str) -> bool:
    from wdsllm.cli import cli

    return command in cli.commands


@pytest.mark.parametrize("command", ["info", "verify", "head", "stats"])
def test_cli_reads_http_and_s3_datasets(command, wiki_local, http_server, s3_server, s3_bucket):
    assert _cli_has(command)
    shutil.copytree(wiki_local, http_server.root / "wiki")
    s3_server.upload_dir(wiki_local, f"{s3_bucket}/wiki/")
    local = _cli(command, str(wiki_local))
    assert local.returncode == 0, local.stderr
    for url in (http_server.url_for("wiki"), f"{s3_bucket}/wiki/", f"{s3_bucket}/wiki/index.json"):
        result = _cli(command, url)
        assert result.returncode == 0, f"wdsllm {command} {url}:\n{result.stdout}\n{result.stderr}"
        # The same report as for the local copy, but for the line that names the dataset.
        assert result.stdout.splitlines()[1:] == local.stdout.splitlines()[1:], result.stdout


# ----------------------------------------------------------------------------------------------
# Faults: the same documents in the same order, each shard resumed where it broke


FAULTS = {
    "drop-fin": ("drop_after", dict(bytes=7000, reset=False), 2),
    "drop-rst": ("drop_after", dict(bytes=7000, reset=True), 2),
    "503": ("status", dict(status=503), 2),
    "stall": ("stall", dict(bytes=7000, seconds=1.5), 1),
}


# every fault in-process; one of each resumed kind with real DataLoader workers as well
FAULT_RUNS = [(fault, 0) for fault in FAULTS] + [("drop-fin", 2), ("stall", 2)]


@pytest.mark.parametrize("fault,workers", FAULT_RUNS, ids=[f"{f}-{w}workers" for f, w in FAULT_RUNS])
def test_faults_on_every_shard_change_nothing(fault, workers, served, http_server, request, caplog):
    kind, params, times = FAULTS[fault]
    caplog.set_level("WARNING", logger="wdsllm")
    for name in NAMES:
        http_server.faults.add(f"*/{name}", kind, times=times, **params)
    reference = request.getfixturevalue("local_run_2_workers" if workers else "local_run")
    loader = wdsllm.loader(served[0], num_workers=workers, retry=FAST, **LOAD)
    assert documents(loader) == reference
    opens = shard_opens(served[0], max(1, workers))
    catalog = open_source(served[0])
    for shard, name in enumerate(NAMES):
        ranges = http_server.ranges(f"*/{name}")
        group_starts = set(catalog.group_table(shard)[:, 0].tolist())
        starts = [0 if r is None else int(r[len("bytes=") :].split("-")[0]) for r in ranges]
        # a consumer starts at a group (its share's first); a retry resumes where a body broke
        fresh = [a for a in starts if a in group_starts]
        resumed = [a for a in starts if a not in group_starts]
        if kind == "status":
            assert len(fresh) == opens[shard] + times and not resumed  # nothing was delivered: nothing to resume
            continue
        # a GET that timed out before its first byte (a loaded machine) is retried from the start
        from_start = sum(f"{name}: timed out" in m and "at byte 0 " in m for m in caplog.messages)
        assert len(fresh) == opens[shard] + from_start, f"{name} was read again from its start: {ranges}"
        assert resumed, (name, ranges)
        for at in resumed:
            moved = [at - a for a in fresh if a < at]
            if not params.get("reset"):
                # A retry asks for the rest of the share from the byte where the stream broke.
                assert any(m % 7000 == 0 and m <= 7000 * times for m in moved), (name, ranges)
            else:
                # An RST may discard bytes the client had not read yet; resumes still start past the start.
                assert any(0 < m <= 7000 * times for m in moved), (name, ranges)


def shard_opens(source: str, workers: int) -> dict[int, int]:
    """How many consumers open each shard in epoch 0 (a shard split between two workers is
    opened by both)."""
    from collections import Counter

    from wdsllm.load.config import Config
    from wdsllm.load.plan import slices_for

    catalog, cfg = open_source(source), Config(**LOAD)
    return Counter(sl.shard for w in range(workers) for sl in slices_for(catalog, cfg, cfg.spec(0, 0, 1, w, workers)))


def test_a_shard_that_ignores_range_is_still_read_exactly(served, http_server, local_run):
    http_server.faults.add("*/shard-000002.tar", "drop_after", bytes=9000)
    http_server.faults.add("*/shard-000002.tar", "ignore_range")
    assert documents(wdsllm.loader(served[0], retry=FAST, **LOAD)) == local_run


# ----------------------------------------------------------------------------------------------
# Permanent errors fail fast


@pytest.mark.parametrize("status", [404, 403])
@pytest.mark.parametrize("target", ["index.json", "shard-000002.tar"])
def test_missing_or_forbidden_fails_fast_naming_the_url(status, target, served, http_server):
    http_server.faults.add(f"*/{target}", "status_permanent", status=status)
    url = f"{served[0]}/{target}"
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        # The default policy (8 attempts, backoff up to 5 s) would take many seconds if it retried.
        for _ in wdsllm.loader(served[0], **LOAD):
            pass
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert url in message and str(status) in message, message
    assert http_server.count(f"*/{target}") == 1, "a permanent error must not be retried"
    assert elapsed < 3, elapsed
    if target == "index.json" and status == 404:
        assert isinstance(info.value, NotFoundError) and "not a dataset root" in message


def test_missing_shard_in_a_dataloader_worker_fails_naming_the_url(served, http_server):
    http_server.faults.add("*/shard-000001.tar", "status_permanent", status=404)
    with pytest.raises(Exception, match=r"shard-000001\.tar: HTTP 404"):
        for _ in wdsllm.loader(served[0], num_workers=2, **LOAD):
            pass


def test_s3_missing_root_bucket_or_shard_fails_fast(s3_server, s3_bucket, synth):
    with pytest.raises(NotFoundError, match=rf"{s3_bucket}/nothing/index\.json: S3 NoSuchKey"):
        wdsllm.loader(f"{s3_bucket}/nothing/")
    with pytest.raises(NotFoundError, match=r"s3://no-such-bucket-here/ds/index\.json: S3 NoSuchBucket"):
        wdsllm.loader("s3://no-such-bucket-here/ds")
    s3_server.upload_dir(synth[0], f"{s3_bucket}/ds/")
    bucket = s3_bucket[len("s3://") :]
    s3_server.client().delete_object(Bucket=bucket, Key=f"ds/{NAMES[3]}")
    t0 = time.monotonic()
    with pytest.raises(NotFoundError, match=rf"{s3_bucket}/ds/{NAMES[3]}: S3 NoSuchKey"):
        for _ in wdsllm.dataset(f"{s3_bucket}/ds", **LOAD):
            pass
    assert time.monotonic() - t0 < 3


# ----------------------------------------------------------------------------------------------
# on_error="skip"


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_a_shard_that_keeps_failing_and_go_on(workers, served, http_server, caplog):
    dead = f"{served[0]}/{NAMES[2]}"
    http_server.faults.add(f"*/{NAMES[2]}", "status_permanent", status=503)
    loader = wdsllm.loader(served[0], num_workers=workers, retry=FAST, on_error="skip", **LOAD)
    with caplog.at_level(logging.WARNING, logger="wdsllm"):
        got = documents(loader)
    assert set(loader.skipped_shards) == {dead}
    assert http_server.count(f"*/{NAMES[2]}") >= FAST.attempts  # the retry budget was spent first
    ids = [i for i, _, _ in got]
    assert len(ids) == len(set(ids))
    expected = {i: t for i, t in served[1].items() if i >> 32 != 2}
    assert {i: t for i, _, t in got} == expected
    if workers == 0:  # worker processes log on their own stderr
        assert any("skipping unreadable shard" in r.message and dead in r.message for r in caplog.records)


def test_skip_loses_only_the_rest_of_a_shard_that_dies_midway(served, http_server):
    # The first request delivers 9000 bytes, then the shard answers 503 for good.
    http_server.faults.add(f"*/{NAMES[2]}", "drop_after", bytes=9000)
    http_server.faults.add(f"*/{NAMES[2]}", "status_permanent", status=503)
    loader = wdsllm.loader(served[0], retry=FAST, on_error="skip", shuffle=False, batch_size=8)
    got = {i: t for i, _, t in documents(loader)}
    assert loader.skipped_shards == [f"{served[0]}/{NAMES[2]}"]
    kept = sorted(i & 0xFFFFFFFF for i in got if i >> 32 == 2)
    assert 0 < len(kept) < DOCS_PER_SHARD[2]
    assert kept == list(range(len(kept))), "what is kept of the broken shard is the part before the break"
    assert all(got[i] == served[1][i] for i in got)
    assert {i for i in served[1] if i >> 32 != 2} <= set(got)


# ----------------------------------------------------------------------------------------------
# Cache


def test_cache_workers_download_each_shard_once_and_the_next_epoch_reads_none(served, http_server, tmp_path, synth):
    cache = tmp_path / "cache"
    # world 1 x 2 workers, 5 shards: the split between the workers falls inside a shard, which both
    # workers then open at once.
    loader = wdsllm.loader(served[0], num_workers=2, cache_dir=str(cache), cache_size=10 << 20, retry=FAST, **LOAD)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append(documents(loader))
        assert http_server.ranges("*.tar") == [None] * len(NAMES), "each shard is downloaded once, whole"
    reference = wdsllm.loader(str(synth[0]), num_workers=2, **LOAD)
    for epoch, got in enumerate(epochs):
        reference.set_epoch(epoch)
        assert got == documents(reference)
    assert epochs[0] != epochs[1]
    cached = [
        path.rsplit("/", 1)[1].split("-", 1)[1] for path, _, _ in storage.ShardCache(str(cache), 10 << 20).entries()
    ]
    assert sorted(n for n in cached if n.endswith(".tar")) == NAMES  # and the side files (#16)


# ----------------------------------------------------------------------------------------------
# Pack a real corpus to S3, then stream it with ranks x workers


def s3_upload_times(bucket: str) -> dict[str, object]:
    """When the moto server (in this process) stored each key; finer than S3's LastModified."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    keys = s3_backends[DEFAULT_ACCOUNT_ID]["global"].buckets[bucket].keys
    return {k: v.last_modified for k, v in keys.items()}


def test_pack_to_s3_then_stream_exactly_once_over_ranks_and_workers(wiki_input, wiki_local, s3_server, s3_bucket):
    local, remote = wiki_local, f"{s3_bucket}/wiki/"
    result = _cli("pack", str(wiki_input), "-o", remote, *PACK_OPTIONS)
    assert result.returncode == 0, result.stderr
    bucket = s3_bucket[len("s3://") :]
    index = json.loads((local / "index.json").read_bytes())
    assert len(index["shards"]) >= 4
    # The objects are complete and the same bytes as the local pack; nothing else is left behind.
    client = s3_server.client()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == sorted(f"wiki/{p.name}" for p in local.iterdir())
    for entry in index["shards"]:
        data = s3_server.get(f"{remote}{entry['name']}")
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["bytes"], entry["sha256"])
    for name in ("index.json", "lengths.npy"):
        assert s3_server.get(remote + name) == (local / name).read_bytes()
    # index.json was stored last: its presence means every shard was there before it.
    times = s3_upload_times(bucket)
    assert max(times, key=times.get) == "wiki/index.json"

    expected = {i: t for i, _, t in documents(wdsllm.dataset(str(local), batch_size=16, shuffle=False))}
    assert len(expected) == index["totals"]["documents"] == 3000
    got = []
    for rank in range(2):
        loader = wdsllm.loader(
            remote, rank=rank, world_size=2, num_workers=2, batch_size=16, seed=5, equal_batches=False, retry=FAST
        )
        got += documents(loader)
    ids = [i for i, _, _ in got]
    assert len(ids) == len(set(ids)) == len(expected), "every document exactly once over 2 ranks x 2 workers"
    assert {i: t for i, _, t in got} == expected


# ----------------------------------------------------------------------------------------------
# The cache verifies checksums; the retry policy governs the index too.


def test_cache_keeps_only_downloads_that_match_the_index_checksum(served, http_server, tmp_path):
    # One byte of shard 1 is flipped on the way (same size): the cache must not keep that copy.
    http_server.faults.add(f"*/{NAMES[1]}", "corrupt", at=3000)
    loader = wdsllm.loader(served[0], cache_dir=str(tmp_path / "cache"), retry=FAST, on_error="skip", **LOAD)
    got = {i: t for i, _, t in documents(loader)}
    assert loader.skipped_shards == [f"{served[0]}/{NAMES[1]}"]
    assert all(got[i] == served[1][i] for i in got)


def test_the_retry_policy_also_governs_reading_the_index(served, http_server):
    # index.json stalls for 3 s; with FAST's 0.4 s timeout the first try gives up at once.
    http_server.faults.add("*/index.json", "stall", bytes=0, seconds=3)
    t0 = time.monotonic()
    wdsllm.loader(served[0], retry=FAST, **LOAD)
    assert time.monotonic() - t0 < 2
