"""Every store behind the backend table, against real servers on 127.0.0.1: moto (s3://), the GCS
emulator (gs://), Azurite (az://), the fault-injecting HTTP server (http://) and a fake Hub (hf://).

Round trips (pack -> verify -> load, every document exactly once), faults on every scheme (through a
fault proxy in front of the emulators), permanent errors that name the URL and the credentials,
anonymous reads, proxies, server-side merges, the cache, and secrets kept out of every message.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from synth import write_dataset

import wdsllm
from wdsllm import storage
from wdsllm.errors import MergeError, NotFoundError, StorageError
from wdsllm.pack.merge import merge
from wdsllm.storage import RetryPolicy, offload

SHARED_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
TOKENIZERS = SHARED_DATA / "tokenizers"
WIKI = sorted((SHARED_DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))

FAST = RetryPolicy(attempts=6, base_delay=0.01, max_delay=0.05, timeout=1.0)
DOCS_PER_SHARD = [40, 25, 55, 30]
NAMES = [f"shard-{i:06d}.tar" for i in range(len(DOCS_PER_SHARD))]
LOAD = dict(batch_size=8, seed=7, shuffle_buffer=64)
PACK_OPTIONS = ["-t", str(TOKENIZERS / "gpt2.json"), "--shard-size", "200K", "--sample-tokens", "8192", "-q"]
WRITABLE = ["s3", "gs", "az"]
READABLE = ["s3", "gs", "az", "http", "hf"]


def documents(batches) -> list[tuple[int, int, bytes]]:
    out = []
    for batch in batches:
        docs, lengths, ids = batch["docs"].numpy(), batch["lengths"].numpy(), batch["input_ids"].numpy()
        for i in range(len(lengths)):
            out.append((int(docs[i, 0]), int(docs[i, 1]), ids[i, : lengths[i]].astype(np.uint16).tobytes()))
    return out


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wdsllm.cli", *args], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    write_dataset(root / "ds", DOCS_PER_SHARD, seed=5)
    return root / "ds"


@pytest.fixture(scope="module")
def reference(synth):
    return {w: documents(wdsllm.loader(str(synth), num_workers=w, **LOAD)) for w in (0, 2)}


class Store:
    """A fresh place in one store: ``url`` of an empty prefix, ``upload(dir)`` puts a dataset there
    with the store's own client (not with wdsllm), ``endpoint`` is where its server listens."""

    def __init__(self, scheme: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.scheme = scheme
        name = f"wdsllm-{uuid.uuid4().hex[:10]}"
        self.endpoint = ""
        if scheme == "s3":
            self.server = request.getfixturevalue("s3_server")
            self.bucket = self.server.new_bucket()
            self.url = f"s3://{self.bucket}/ds"
            self.endpoint = self.server.endpoint
        elif scheme == "gs":
            self.server = request.getfixturevalue("gcs_server")
            self.bucket = self.server.new_bucket()
            self.url = f"gs://{self.bucket}/ds"
            self.endpoint = self.server.endpoint
        elif scheme == "az":
            self.server = request.getfixturevalue("azurite")
            self.bucket = self.server.new_container()
            self.url = f"az://{self.bucket}/ds"
            self.endpoint = f"http://127.0.0.1:{self.server.port}"
        elif scheme == "http":
            self.server = request.getfixturevalue("http_server")
            self.url = self.server.url_for("ds").rstrip("/")
        elif scheme == "hf":
            self.server = request.getfixturevalue("fake_hub")
            self.endpoint = self.server.endpoint
            self.repo = f"org/{name}"
            self.url = f"hf://datasets/{self.repo}@main/ds"

    def upload(self, local: Path) -> str:
        files = {p.relative_to(local).as_posix(): p.read_bytes() for p in sorted(local.rglob("*")) if p.is_file()}
        if self.scheme == "s3":
            self.server.upload_dir(local, self.url + "/")
        elif self.scheme == "gs":
            for name, data in files.items():
                self.server.put(self.bucket, f"ds/{name}", data)
        elif self.scheme == "az":
            container = self.server.service().get_container_client(self.bucket)
            for name, data in files.items():
                container.upload_blob(f"ds/{name}", data, overwrite=True)
        elif self.scheme == "http":
            shutil.copytree(local, self.server.root / "ds")
        elif self.scheme == "hf":
            self.server.add_repo(self.repo, {f"ds/{n}": d for n, d in files.items()})
        return self.url

    def upload_one(self, name: str, data: bytes) -> None:
        """Put one object ``name`` (relative to the bucket) with the store's own client."""
        if self.scheme == "s3":
            self.server.client().put_object(Bucket=self.bucket, Key=name, Body=data)
        elif self.scheme == "gs":
            self.server.put(self.bucket, name, data)
        elif self.scheme == "az":
            self.server.service().get_container_client(self.bucket).upload_blob(name, data, overwrite=True)

    def proxied(self, monkeypatch: pytest.MonkeyPatch, proxy) -> str:
        """Route this store's traffic through ``proxy`` (a FaultProxy in front of the emulator or
        server); returns the dataset's root URL to read (http: the proxy's own address)."""
        if self.scheme == "http":
            return proxy.url + "/ds"
        if self.scheme == "s3":
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        elif self.scheme == "gs":
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        elif self.scheme == "az":
            conn = self.server.connection_string.replace(self.endpoint, proxy.url)
            monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", conn)
        elif self.scheme == "hf":  # the Hub's answers (its CDN's are direct)
            monkeypatch.setenv("HF_ENDPOINT", proxy.url)
        return self.url

    def shard_pattern(self, name: str) -> str:
        """The fault proxy's pattern for the GETs of a shard's bytes (not of its metadata)."""
        return {"gs": f"GET */download/*{name}", "hf": f"GET */resolve/*{name}"}.get(self.scheme, f"GET *{name}")


@pytest.fixture
def store(request, tmp_path) -> Store:
    return Store(request.param, request, tmp_path)


# ----------------------------------------------------------------------------------------------
# Reading every scheme


@pytest.mark.parametrize("store", READABLE, indirect=True)
def test_every_scheme_reads_every_document_once_in_the_local_order(store, synth, reference):
    root = store.upload(synth)
    for source in (root, root + "/", root + "/index.json"):
        assert documents(wdsllm.loader(source, **LOAD)) == reference[0], source
    assert documents(wdsllm.loader(root, num_workers=2, **LOAD)) == reference[2]
    assert storage.exists(f"{root}/index.json") and not storage.exists(f"{root}/missing.tar")


@pytest.mark.parametrize("store", READABLE, indirect=True)
def test_missing_object_fails_at_once_naming_the_url(store, synth):
    root = store.upload(synth)
    url = f"{root}/nothing-here.tar"
    t0 = time.monotonic()
    with pytest.raises(NotFoundError) as info:
        storage.read_bytes(url, retry=RetryPolicy(base_delay=1.0))
    assert time.monotonic() - t0 < 3
    assert str(info.value).startswith(storage.redact(url) + ":"), info.value


@pytest.mark.parametrize("store", READABLE, indirect=True)
def test_cache_serves_the_second_epoch_on_every_scheme(store, synth, reference, tmp_path):
    root = store.upload(synth)
    loader = wdsllm.loader(root, cache_dir=str(tmp_path / "cache"), cache_size=10 << 20, retry=FAST, **LOAD)
    assert documents(loader) == reference[0]
    before = storage.stats()
    loader.set_epoch(1)
    documents(loader)
    assert storage.stats()["cache_misses"] == before["cache_misses"]
    cached = [os.path.basename(path) for path, _, _ in storage.ShardCache(str(tmp_path / "cache"), 10 << 20).entries()]
    assert sorted(name.split("-", 1)[1] for name in cached if name.endswith(".tar")) == NAMES
    assert any(name.endswith("-groups.npy") for name in cached), "remote side files are cached too (#16)"


# ----------------------------------------------------------------------------------------------
# Faults on every scheme: the fault proxy in front of each emulator


FAULTS = {
    "drop": ("drop_after", dict(bytes=3000), 2),
    "drop-rst": ("drop_after", dict(bytes=3000, reset=True), 1),
    "stall": ("stall", dict(bytes=3000, seconds=3.0), 1),
    "503": ("status", dict(status=503), 2),
    "429": ("status", dict(status=429, retry_after=0), 2),  # throttled (S3 SlowDown is 503: see below)
}
# every fault on every emulator; the Hub answers with a redirect to its CDN, so only statuses there
FAULT_RUNS = [(s, f, 0) for s in WRITABLE for f in FAULTS] + [(s, "drop", 2) for s in WRITABLE] + [("hf", "503", 0)]


@pytest.mark.parametrize(
    "store,fault,workers", FAULT_RUNS, indirect=["store"], ids=[f"{s}-{f}-{w}w" for s, f, w in FAULT_RUNS]
)
def test_faults_on_every_shard_change_nothing(store, fault, workers, synth, reference, fault_proxy, monkeypatch):
    root = store.upload(synth)
    proxy = fault_proxy(store.endpoint)
    store.proxied(monkeypatch, proxy)
    kind, params, times = FAULTS[fault]
    faults = []
    for name in NAMES:
        if "bytes" in params:  # a cut at a random byte of each shard (seeded: the same in every run)
            params = {**params, "bytes": random.Random(f"{fault}/{name}").randrange(1, (synth / name).stat().st_size)}
        faults.append(proxy.add(store.shard_pattern(name), kind, times=times, **params))
    assert documents(wdsllm.loader(root, num_workers=workers, retry=FAST, **LOAD)) == reference[workers]
    if workers == 0:
        assert all(f.hits == times for f in faults), [f.hits for f in faults]


@pytest.mark.parametrize("store", WRITABLE, indirect=True)
def test_an_object_replaced_between_a_break_and_its_resume_is_an_error(store, synth, fault_proxy, monkeypatch):
    """The resume of a broken body asks for the version it started on (S3 and Azure: If-Match,
    GCS: the generation): a replaced object is a named error, never a splice of two versions."""
    store.upload(synth)
    proxy = fault_proxy(store.endpoint)
    root = store.proxied(monkeypatch, proxy)
    name, size = NAMES[2], (synth / NAMES[2]).stat().st_size
    proxy.add(store.shard_pattern(name), "drop_after", bytes=size // 2)
    with storage.open_stream(f"{root}/{name}", retry=FAST) as f:
        first = f.raw.read(1000)  # the first GET is under way, and will break at size // 2
        replacement = bytes(reversed((synth / name).read_bytes()))  # the same size, other bytes
        monkeypatch.undo()  # straight to the store
        Store.upload_one(store, f"ds/{name}", replacement)
        with pytest.raises(StorageError, match="changed|412|ConditionNotMet|PreconditionFailed|404") as info:
            while f.raw.read(1 << 16):
                pass
    assert first == (synth / name).read_bytes()[:1000]
    assert str(info.value).startswith(f"{root}/{name}:"), info.value


@pytest.mark.parametrize("store", READABLE, indirect=True)
def test_throttling_honours_retry_after(store, synth, fault_proxy, monkeypatch):
    store.upload(synth)
    proxy = fault_proxy(store.endpoint or store.server.url)
    root = store.proxied(monkeypatch, proxy)
    body = {
        "s3": b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>Reduce your request rate</Message></Error>",
        "az": b"<?xml version='1.0'?><Error><Code>ServerBusy</Code><Message>busy</Message></Error>",
        "gs": b'{"error": {"code": 503, "message": "slow down"}}',
    }.get(store.scheme, b"busy")
    ctype = "application/json" if store.scheme == "gs" else "application/xml"
    proxy.add(store.shard_pattern(NAMES[1]), "status", status=503, retry_after=1, body=body, content_type=ctype)
    t0 = time.monotonic()
    data = storage.read_bytes(f"{root}/{NAMES[1]}", retry=FAST)
    assert time.monotonic() - t0 >= 0.9, "the retry waited out Retry-After, not FAST's 10 ms"
    assert data == (synth / NAMES[1]).read_bytes()


@pytest.mark.parametrize("store", WRITABLE, indirect=True)
def test_permission_failure_names_the_credentials_tried(store, synth, fault_proxy, monkeypatch):
    root = store.upload(synth)
    proxy = fault_proxy(store.endpoint)
    store.proxied(monkeypatch, proxy)
    body = {
        "s3": b"<?xml version='1.0'?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>",
        "az": b"<?xml version='1.0'?><Error><Code>AuthorizationFailure</Code><Message>no</Message></Error>",
        "gs": b'{"error": {"code": 403, "message": "forbidden"}}',
    }[store.scheme]
    proxy.add("GET *", "status", status=403, times=None, body=body, content_type="application/xml")
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        storage.read_bytes(f"{root}/{NAMES[0]}", retry=RetryPolicy(base_delay=1.0))
    assert time.monotonic() - t0 < 3
    message = str(info.value)
    assert message.startswith(f"{root}/{NAMES[0]}:") and "403" in message and "credentials:" in message, message
    expected = {"s3": "'env'", "gs": "anonymous", "az": "AZURE_STORAGE_CONNECTION_STRING"}[store.scheme]
    assert expected in message, message


# ----------------------------------------------------------------------------------------------
# Pack -> verify -> load on every writable scheme


@pytest.fixture(scope="module")
def wiki_input(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wiki") / "wiki-head.jsonl"
    with gzip.open(WIKI[0], "rt", encoding="utf-8") as src, open(path, "w", encoding="utf-8") as out:
        out.writelines(itertools.islice(src, 2000))
    return path


@pytest.fixture(scope="module")
def wiki_local(wiki_input, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wiki-local") / "wiki"
    result = cli("pack", str(wiki_input), "-o", str(out), *PACK_OPTIONS, "--workers", "1")
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("store", WRITABLE, indirect=True)
def test_pack_verify_load_round_trip(store, wiki_input, wiki_local):
    root = store.url + "/"
    result = cli("pack", str(wiki_input), "-o", root, *PACK_OPTIONS, "--workers", "1")
    assert result.returncode == 0, result.stderr
    with storage.Output(root) as out:
        names = out.list_names()
    assert names == sorted(p.name for p in wiki_local.iterdir())
    for name in names:  # the same bytes as a local pack
        assert storage.read_bytes(storage.join_url(root, name)) == (wiki_local / name).read_bytes(), name
    verified = cli("verify", root)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    for command in ("info", "head"):
        remote, local = cli(command, root), cli(command, str(wiki_local))
        assert remote.returncode == 0, remote.stderr
        assert local.returncode == 0, local.stderr
        assert remote.stdout.splitlines()[1:] == local.stdout.splitlines()[1:], command
    expected = {i: t for i, _, t in documents(wdsllm.dataset(str(wiki_local), batch_size=16, shuffle=False))}
    got = []
    for rank in range(2):
        loader = wdsllm.loader(root, rank=rank, world_size=2, num_workers=2, batch_size=16, equal_batches=False)
        got += documents(loader)
    ids = [i for i, _, _ in got]
    assert len(ids) == len(set(ids)) == len(expected), "every document exactly once over 2 ranks x 2 workers"
    assert {i: t for i, _, t in got} == expected


@pytest.mark.parametrize("store", ["http", "hf"], indirect=True)
def test_info_verify_head_on_read_only_schemes(store, wiki_local):
    root = store.upload(wiki_local) + "/"
    verified = cli("verify", root)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    for command in ("info", "head"):  # head detokenizes with the tokenizer.json the dataset carries
        remote, local = cli(command, root), cli(command, str(wiki_local))
        assert remote.returncode == 0, remote.stderr
        assert local.returncode == 0, local.stderr
        assert remote.stdout.splitlines()[1:] == local.stdout.splitlines()[1:], command


@pytest.mark.parametrize("store", WRITABLE, indirect=True)
def test_merge_copies_server_side(store, wiki_input, wiki_local, fault_proxy, monkeypatch):
    parts = store.url + "/parts/"
    for task in range(2):
        result = cli(
            "pack", str(wiki_input), "-o", parts, *PACK_OPTIONS, "--workers", "1", "--num-tasks", "2",
            "--task-index", str(task),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    proxy = fault_proxy(store.endpoint)
    store.proxied(monkeypatch, proxy)
    merged = store.url + "/merged/"
    index, _ = merge([parts], merged)
    # No shard's bytes were uploaded again: each came by a server-side copy.
    writes = [(m, p, h) for m, p, h in proxy.log if m in ("PUT", "POST") and "shard-" in p]
    copy_header = {"s3": "x-amz-copy-source", "az": "x-ms-copy-source"}.get(store.scheme)
    shard_writes = [(m, p, h) for m, p, h in writes if "merged" in p and ".tar" in p]
    if copy_header:
        assert shard_writes and all(copy_header in {k.lower() for k in h} for _, _, h in shard_writes), writes
    else:  # gcs: rewriteTo (a POST naming source and target), never an upload
        assert any("rewriteTo" in p for _, p, _ in writes), writes
        assert not [p for m, p, _ in proxy.log if p.startswith("/upload/") and "shard-" in p]
    monkeypatch.undo()
    assert [e.name for e in index.shards] == sorted(n for n in storage.Output(merged).list_names() if "shard-" in n)
    assert cli("verify", merged).returncode == 0
    got = documents(wdsllm.dataset(merged, batch_size=16, shuffle=False))
    ids = [i for i, _, _ in got]
    assert len(ids) == len(set(ids)) == index.documents


def test_merge_copy_refuses_a_corrupt_shard_on_s3(s3_server, s3_bucket, wiki_input):
    parts = f"{s3_bucket}/parts/"
    for task in range(2):
        result = cli(
            "pack", str(wiki_input), "-o", parts, *PACK_OPTIONS, "--workers", "1", "--num-tasks", "2",
            "--task-index", str(task),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    shard = parts + next(n for n in storage.Output(parts).list_names() if n.endswith(".tar"))
    data = bytearray(s3_server.get(shard))
    data[1000] ^= 0xFF  # same size, one byte changed
    bucket, _, key = shard[len("s3://") :].partition("/")
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(MergeError, match="does not match the sha256"):
        merge([parts], f"{s3_bucket}/merged/", copy=True)


# ----------------------------------------------------------------------------------------------
# Anonymous access and proxies


def test_anonymous_reads_of_a_public_s3_bucket(s3_server, synth, monkeypatch):
    bucket = s3_server.new_bucket(public=True)
    s3_server.upload_dir(synth, f"s3://{bucket}/ds/")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match="no AWS credentials found.*WDSLLM_ANONYMOUS"):
        storage.read_bytes(f"s3://{bucket}/ds/index.json")
    monkeypatch.setenv("WDSLLM_ANONYMOUS", "1")
    assert storage.read_bytes(f"s3://{bucket}/ds/index.json") == (synth / "index.json").read_bytes()
    assert len(documents(wdsllm.loader(f"s3://{bucket}/ds", **LOAD))) == sum(DOCS_PER_SHARD)


def test_anonymous_reads_of_a_public_azure_container(azurite, synth, monkeypatch):
    container = azurite.new_container(public=True)
    client = azurite.service().get_container_client(container)
    for path in synth.iterdir():
        client.upload_blob(f"ds/{path.name}", path.read_bytes())
    monkeypatch.setenv("WDSLLM_ANONYMOUS", "az")
    assert len(documents(wdsllm.loader(f"az://{container}/ds", **LOAD))) == sum(DOCS_PER_SHARD)


def test_anonymous_reads_of_gcs_send_no_credentials(gcs_server, synth, fault_proxy, monkeypatch):
    store = Store("gs", _FakeRequest(gcs_server), Path())
    root = store.upload(synth)
    proxy = fault_proxy(store.endpoint)
    store.proxied(monkeypatch, proxy)
    monkeypatch.setenv("WDSLLM_ANONYMOUS", "gs")
    assert len(documents(wdsllm.loader(root, **LOAD))) == sum(DOCS_PER_SHARD)
    gets = [h for m, p, h in proxy.log if m == "GET"]
    assert gets and not any("authorization" in {k.lower() for k in h} for h in gets)
    proxy.add("GET *", "status", status=403, times=None, body=b'{"error": {"code": 403}}')
    with pytest.raises(StorageError, match="credentials: none: anonymous requests"):
        storage.read_bytes(f"{root}/{NAMES[0]}")


@pytest.mark.parametrize("workers", [0, 2])
def test_gcs_credential_search_runs_once_per_run_not_in_every_worker(
    gcs_server, synth, http_server, monkeypatch, tmp_path, workers
):
    # Off Google Cloud, with no credentials, google-auth asks the metadata server (14-15 s per
    # process on the project's VM): the loader's process searches, and the fetch process and
    # the DataLoader workers forked from it start from what it found. The HTTP server stands in
    # for a metadata server that says "not Google Cloud" (404, no Metadata-Flavor) and counts.
    metadata = http_server.url.removeprefix("http://")
    monkeypatch.delenv("NO_GCE_CHECK", raising=False)
    monkeypatch.setenv("GCE_METADATA_IP", metadata)
    monkeypatch.setenv("GCE_METADATA_HOST", metadata)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no ADC file; a search of its own
    root = Store("gs", _FakeRequest(gcs_server), Path()).upload(synth)
    storage.read_bytes(f"{root}/index.json")
    searched = http_server.count()
    assert searched > 0  # the search reached this server
    offload.shutdown()  # a fetch process forked after the search (an earlier test's predates it)
    for epoch in range(2):
        loader = wdsllm.loader(root, num_workers=workers, **LOAD)
        loader.set_epoch(epoch)
        assert len(documents(loader)) == sum(DOCS_PER_SHARD)
    assert http_server.count() == searched, [r.path for r in http_server.log()[searched:]]


@pytest.mark.parametrize(
    "url,reason",
    [
        ("s3://Not_A_Bucket!/ds/index.json", "Invalid bucket name"),
        ("s3://no-such-bucket-here/ds/index.json", "NoSuchBucket"),
        ("gs://no-such-bucket-here/ds/index.json", "404"),
        ("az://no-such-container/ds/index.json", "ContainerNotFound"),
        ("az://Not_A_Container!/ds/index.json", "HTTP 400"),
    ],
)
def test_bad_or_missing_buckets_fail_at_once_naming_the_url(url, reason, request):
    request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server", "az": "azurite"}[url[:2]])
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        wdsllm.loader(url.rsplit("/", 1)[0], retry=RetryPolicy(base_delay=1.0))
    assert time.monotonic() - t0 < 5, "a permanent failure is not retried"
    assert str(info.value).startswith(url + ":") and reason in str(info.value), info.value


def test_missing_azure_account_fails_at_once_naming_what_to_set(azurite, monkeypatch):
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        storage.read_bytes(f"az://{azurite.new_container()}/ds/index.json", retry=RetryPolicy(base_delay=1.0))
    assert time.monotonic() - t0 < 5
    assert "AZURE_STORAGE_CONNECTION_STRING" in str(info.value) and "AZURE_STORAGE_ACCOUNT_NAME" in str(info.value)


@pytest.mark.parametrize("scheme", READABLE)
def test_http_proxy_is_honoured_and_no_proxy_bypasses_it(scheme, request, synth, fault_proxy, monkeypatch):
    store = Store(scheme, request, Path())
    root = store.upload(synth)
    proxy = fault_proxy()  # a forward proxy
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    assert storage.read_bytes(f"{root}/index.json") == (synth / "index.json").read_bytes()
    assert any(target.startswith("http://127.0.0.1") and "index.json" in target for _, target, _ in proxy.log)
    seen = len(proxy.log)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost,169.254.169.254")  # the Hub's CDN; gcsfs's GCE probe
    assert storage.read_bytes(f"{root}/{NAMES[0]}") == (synth / NAMES[0]).read_bytes()
    assert len(proxy.log) == seen


# ----------------------------------------------------------------------------------------------
# hf://: the revision is resolved once, the token stays with the Hub


def test_hf_revision_is_pinned_for_the_run(fake_hub, synth):
    store_name = f"org/pinned-{uuid.uuid4().hex[:8]}"
    files = {f"ds/{p.name}": p.read_bytes() for p in synth.iterdir()}
    repo = fake_hub.add_repo(store_name, files)
    first = repo.refs["main"]
    url = f"hf://datasets/{store_name}@main/ds"
    assert storage.hf.commit_of(url, 5) == first
    assert storage.hf.pinned(url) == f"hf://datasets/{store_name}@{first}/ds"
    assert storage.hf.pinned(url + "/") == f"hf://datasets/{store_name}@{first}/ds/"
    before = storage.read_bytes(f"{url}/{NAMES[0]}")
    repo.commit({f"ds/{NAMES[0]}": b"a new commit on main"})
    assert storage.read_bytes(f"{url}/{NAMES[0]}") == before, "a push to main mid-run changes nothing"
    storage.hf.HUB.reset()  # another process (a rank started later) resolves main again...
    assert storage.read_bytes(f"hf://datasets/{store_name}@{first}/ds/{NAMES[0]}") == before  # ...the pinned URL not
    assert storage.hf.commit_of(url, 5) == repo.refs["main"] != first
    assert (
        storage.read_bytes(f"hf://datasets/{store_name}@{repo.refs['main']}/ds/{NAMES[0]}") == b"a new commit on main"
    )
    resolves = [p for m, p, _ in fake_hub.requests if "/resolve/" in p and store_name in p]
    assert resolves and all(f"/resolve/{first}/" in p or f"/resolve/{repo.refs['main']}/" in p for p in resolves)
    hub_gets = [h for m, p, h in fake_hub.requests if "/resolve/" in p and store_name in p]
    assert all(h.get("Authorization") == f"Bearer {fake_hub.token}" for h in hub_gets)  # the CDN refuses it


def test_hf_anonymous_reads_public_repositories_only(fake_hub, synth, monkeypatch):
    files = {f"ds/{p.name}": p.read_bytes() for p in synth.iterdir()}
    public, private = (f"org/{kind}-{uuid.uuid4().hex[:8]}" for kind in ("public", "private"))
    fake_hub.add_repo(public, files)
    fake_hub.add_repo(private, files, private=True)
    assert storage.read_bytes(f"hf://datasets/{private}@main/ds/index.json") == (synth / "index.json").read_bytes()
    monkeypatch.setenv("WDSLLM_ANONYMOUS", "hf")
    assert len(documents(wdsllm.loader(f"hf://datasets/{public}@main/ds", **LOAD))) == sum(DOCS_PER_SHARD)
    sent = [h for _, p, h in fake_hub.requests if public in p]
    assert sent and not any("Authorization" in h for h in sent)
    with pytest.raises(NotFoundError, match=f"repository {private} not found, or private"):
        storage.read_bytes(f"hf://datasets/{private}@v1/ds/index.json")


def test_hf_missing_repository_or_revision_is_named(fake_hub):
    with pytest.raises(NotFoundError, match="repository org/none-such not found"):
        storage.read_bytes("hf://datasets/org/none-such@main/ds/index.json")
    name = f"org/rev-{uuid.uuid4().hex[:8]}"
    fake_hub.add_repo(name, {"ds/index.json": b"{}"})
    with pytest.raises(NotFoundError, match="revision 'v9' not found"):
        storage.read_bytes(f"hf://datasets/{name}@v9/ds/index.json")
    with pytest.raises(StorageError, match="huggingface-cli upload"):
        storage.Output(f"hf://datasets/{name}@main/out/")


# ----------------------------------------------------------------------------------------------
# Secrets: URL passwords and query tokens never reach a message (issue #19)


def _no_secret(secret: str, *texts: str) -> None:
    for text in texts:
        assert secret not in text, text


def test_url_password_is_basic_auth_and_never_shown(http_server, synth, reference, caplog, tmp_path):
    store = Store("http", _FakeRequest(http_server), tmp_path)
    store.upload(synth)
    http_server.require_basic_auth("reader", "pa55word")
    root = http_server.url.replace("http://", "http://reader:pa55word@") + "/ds"
    with caplog.at_level(logging.DEBUG, logger="wdsllm"):
        loader = wdsllm.loader(root, retry=FAST, **LOAD)
        assert documents(loader) == reference[0]
        state = json.dumps(loader.state_dict())
        assert all(r.authorization and r.authorization.startswith("Basic ") for r in http_server.log("*"))
        assert all("pa55word" not in r.path for r in http_server.log("*"))
        http_server.faults.add(f"*/{NAMES[2]}", "status", status=503, times=2)
        documents(wdsllm.loader(root, retry=FAST, **LOAD))  # retried, logged
        wrong = root.replace("pa55word", "wrongpa55")
        with pytest.raises(StorageError) as info:
            wdsllm.loader(wrong, retry=FAST)
    assert "401" in str(info.value) and "reader:***@" in str(info.value)
    _no_secret("pa55word", state, str(info.value), repr(info.value), info.value.url or "", caplog.text)
    _no_secret("wrongpa55", str(info.value), caplog.text)
    assert any("retry" in r.getMessage() for r in caplog.records)
    for command in ("info", "verify"):  # (head needs the tokenizer, which synthetic data lacks)
        ok, bad = cli(command, root), cli(command, wrong)
        # (synthetic datasets name no inputs, which verify reports: it still read every shard)
        assert (ok.returncode == 0 or "0 of 4 shards bad" in ok.stderr) and bad.returncode != 0, ok.stderr
        _no_secret("pa55word", ok.stdout, ok.stderr, bad.stdout, bad.stderr)
        _no_secret("wrongpa55", bad.stdout, bad.stderr)


def test_query_token_reaches_every_shard_request_and_is_never_shown(http_server, synth, reference, caplog, tmp_path):
    Store("http", _FakeRequest(http_server), tmp_path).upload(synth)
    token = "sv=2024-01-01&sig=S3CRETsig"
    for source in (f"{http_server.url}/ds?{token}", f"{http_server.url}/ds/index.json?{token}"):
        http_server.reset()
        assert documents(wdsllm.loader(source, retry=FAST, **LOAD)) == reference[0]
        requests = http_server.log("*")
        assert {r.path.rsplit("/", 1)[-1] for r in requests} >= {"index.json", *NAMES}
        assert all(r.query == token for r in requests), [(r.path, r.query) for r in requests]
    http_server.faults.add(f"*/{NAMES[1]}", "status_permanent", status=404)
    with caplog.at_level(logging.DEBUG, logger="wdsllm"), pytest.raises(StorageError) as info:
        documents(wdsllm.loader(f"{http_server.url}/ds?{token}", retry=FAST, **LOAD))
    assert f"{NAMES[1]}?***" in str(info.value)
    result = cli("info", f"{http_server.url}/ds/?{token}")
    assert result.returncode == 0, result.stderr
    _no_secret("S3CRETsig", str(info.value), caplog.text, result.stdout, result.stderr)


def test_azure_sas_on_the_url_is_carried_and_redacted(azurite, synth):
    from datetime import datetime, timedelta, timezone

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    container = azurite.new_container()
    client = azurite.service().get_container_client(container)
    for path in synth.iterdir():
        client.upload_blob(f"ds/{path.name}", path.read_bytes())
    sas = generate_container_sas(
        "devstoreaccount1",
        container,
        account_key=azurite.connection_string.split("AccountKey=")[1].split(";")[0],
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )
    url = f"az://{container}/ds?{sas}"
    assert len(documents(wdsllm.loader(url, **LOAD))) == sum(DOCS_PER_SHARD)
    with pytest.raises(NotFoundError) as info:
        storage.read_bytes(f"az://{container}/ds/missing.tar?{sas}")
    sig = sas.split("sig=")[1].split("&")[0]
    _no_secret(sig, str(info.value))


def test_abfs_urls_name_the_account(azurite, synth):
    container = azurite.new_container()
    client = azurite.service().get_container_client(container)
    for path in synth.iterdir():
        client.upload_blob(f"ds/{path.name}", path.read_bytes())
    assert storage.azure.parse(f"abfss://{container}@devstoreaccount1.dfs.core.windows.net/ds/x.tar?sv=1") == (
        "devstoreaccount1",
        container,
        "ds/x.tar",
        "sv=1",
    )
    # the environment's connection string is for devstoreaccount1: it serves URLs naming that account
    for scheme in ("abfs", "abfss", "az"):
        url = f"{scheme}://{container}@devstoreaccount1.dfs.core.windows.net/ds"
        assert len(documents(wdsllm.loader(url, **LOAD))) == sum(DOCS_PER_SHARD), url


class _FakeRequest:
    """What Store needs of a pytest request when a test holds the server fixture already."""

    def __init__(self, server) -> None:
        self.server = server

    def getfixturevalue(self, name: str):
        return self.server


# ----------------------------------------------------------------------------------------------
# Concurrent ranged reads


def test_blocks_are_read_concurrently_resumed_and_delivered_in_order(http_server, monkeypatch):
    from test_storage import payload

    monkeypatch.setattr(storage.parallel, "BLOCK_SIZE", 64 * 1024)
    data = payload(1_000_000)
    (http_server.root / "big.bin").write_bytes(data)
    url = http_server.url_for("big.bin")
    http_server.faults.add("/big.bin", "delay", seconds=0.2, times=4)
    http_server.faults.add("/big.bin", "drop_after", bytes=10_000, times=3)
    with storage.open_stream(url, expected_size=len(data), retry=FAST) as f:
        assert f.read() == data
    log = http_server.log("/big.bin")
    starts = sorted({int(r.range[6:].split("-")[0]) for r in log})
    blocks = set(range(0, len(data), 64 * 1024))
    assert blocks <= set(starts), "every block was asked for"
    assert len(starts) > len(blocks), "broken blocks resumed inside the block, not from its start"
    first = sorted(log, key=lambda r: r.time)[:4]
    assert max(r.time for r in first) - min(r.time for r in first) < 0.15, "the first blocks were asked at once"
    wrong = storage.open_stream(url, expected_size=len(data), expected_sha256="0" * 64, retry=FAST)
    with wrong as f, pytest.raises(StorageError, match="sha256"):
        f.read()


def test_a_spooled_shard_is_read_in_place_and_keeps_the_bytes_before_an_error(http_server):
    from test_storage import payload

    data = payload(300_000)
    (http_server.root / "s.bin").write_bytes(data)
    url = http_server.url_for("s.bin")

    def open_range(offset: int, length: int):
        return storage.open_stream(url, offset=offset, length=length, expected_size=len(data), retry=FAST)

    http_server.faults.add("/s.bin", "drop_after", bytes=50_000, times=2)
    spool = storage.Spool(open_range, 1000, len(data), name=url, block_size=100_000, in_flight=2)
    spool.wait(len(data))
    assert spool.mm[1000 : len(data)] == data[1000:]
    starts = sorted(int(r[6:].split("-")[0]) for r in http_server.ranges("/s.bin"))
    assert {1000, 101_000, 201_000} <= set(starts) and len(starts) == 5  # 3 blocks, 2 resumed inside one
    http_server.reset()
    http_server.faults.add("/s.bin", "drop_after", bytes=70_000)
    http_server.faults.add("/s.bin", "status_permanent", status=404)
    broken = storage.Spool(open_range, 0, len(data), name=url, block_size=len(data))
    broken.wait(70_000)  # what arrived before the break is there
    assert broken.mm[:70_000] == data[:70_000]
    with pytest.raises(NotFoundError, match="HTTP 404"):
        broken.wait(70_001)


def test_a_spools_mapping_is_recycled_only_once_nothing_views_it(http_server, monkeypatch):
    import gc

    from test_storage import payload

    from wdsllm.storage import mappings

    gc.collect()  # earlier tests' spools give their mappings back as they are collected
    mappings.POOL.reset()
    one, two = payload(300_000), payload(250_000)[::-1]
    (http_server.root / "one.bin").write_bytes(one)
    (http_server.root / "two.bin").write_bytes(two)

    def spool(name: str, data: bytes, offset: int = 0) -> storage.Spool:
        url = http_server.url_for(name)

        def open_range(start: int, length: int):
            return storage.open_stream(url, offset=start, length=length, expected_size=len(data), retry=FAST)

        s = storage.Spool(open_range, offset, len(data), name=url, block_size=64 * 1024, in_flight=2)
        s.wait(len(data))
        return s

    first = spool("one.bin", one)
    tokens = np.frombuffer(first.mm, dtype=np.uint16, count=1000, offset=2000)  # a batch still views it
    kept = tokens.copy()
    first.close()
    with pytest.raises(ValueError, match="closed"):
        first.wait(10)  # a closed spool's mapping may become another's: it answers nothing more
    second = spool("two.bin", two, offset=100)
    assert second.mm is not first.mm, "a mapping that an array views is not handed out"
    assert (tokens == kept).all()
    assert second.mm[100:] == two[100:] and len(second.mm) == len(two)
    second.close()
    del tokens
    third = spool("two.bin", two)
    assert third.mm is first.mm or third.mm is second.mm, "a mapping nothing views is reused"
    assert len(third.mm) == len(two) and third.mm[:] == two, "resized to the object, every byte its own"
    third.close()
    assert len(mappings.POOL.free) <= mappings.KEEP
    # a recycled mapping grown for a larger object: every new page is writable (a shared anonymous
    # mapping grown this way raises SIGBUS past its first size)
    mappings.POOL.reset()
    small = mappings.take(100_000)
    mappings.give(small)
    grown = mappings.take(3_000_000)
    assert grown is small and len(grown) == 3_000_000
    grown[-1000:] = b"x" * 1000
    assert grown[-1000:] == b"x" * 1000


def _hub_gets(hub, name: str) -> tuple[list[str], list[str]]:
    """(resolve GETs of the file, CDN GETs) the fake Hub saw, in order."""
    resolves = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p and p.endswith(name)]
    cdn = [p for m, p, _ in hub.requests if m == "GET" and p.startswith("/cdn/")]
    return resolves, cdn


def test_hf_second_block_goes_straight_to_the_cdn_and_a_refused_address_is_resolved_again(fake_hub):
    name = f"org/cdn-{uuid.uuid4().hex[:8]}"
    data = bytes(range(256)) * 4096  # 1 MiB
    fake_hub.add_repo(name, {"ds/blob.bin": data})
    url = f"hf://datasets/{name}@main/ds/blob.bin"
    fake_hub.requests.clear()

    def ranged(start: int, n: int) -> bytes:
        with storage.open_stream(url, offset=start, length=n) as f:
            return f.read()

    assert ranged(0, 1000) == data[:1000]
    assert ranged(5000, 70000) == data[5000:75000]
    resolves, cdn = _hub_gets(fake_hub, "ds/blob.bin")
    assert len(resolves) == 1 and len(cdn) == 2, "the second read is one request, to the CDN"
    # the CDN forgets the object (an address that expired or was revoked): resolved again, bytes exact
    fake_hub.cdn.clear()
    assert ranged(300000, 12345) == data[300000:312345]
    resolves, cdn = _hub_gets(fake_hub, "ds/blob.bin")
    assert len(resolves) == 2 and len(cdn) == 4  # the refused GET, then the new address
    # an address past its Expires is not tried at all
    key = next(k for k in storage.hf.HUB.cdn if k[0].endswith("ds/blob.bin") and name in k[0])
    storage.hf.HUB.cdn[key] += "&Expires=1000"
    assert ranged(10, 20) == data[10:30]
    resolves, cdn = _hub_gets(fake_hub, "ds/blob.bin")
    assert len(resolves) == 3 and len(cdn) == 5
    assert "Expires" not in storage.hf.HUB.cdn[key]
    storage.hf.HUB.cdn[key] += "&X-Amz-Date=20200101T000000Z&X-Amz-Expires=3600"  # S3-style presigned, long gone
    assert ranged(20, 20) == data[20:40]
    resolves, cdn = _hub_gets(fake_hub, "ds/blob.bin")
    assert len(resolves) == 4 and len(cdn) == 6


def test_hf_remembered_cdn_address_is_not_used_without_the_token(fake_hub, monkeypatch):
    name = f"org/private-cdn-{uuid.uuid4().hex[:8]}"
    fake_hub.add_repo(name, {"ds/blob.bin": b"secret bytes" * 100}, private=True)
    url = f"hf://datasets/{name}@main/ds/blob.bin"
    assert storage.read_bytes(url) == b"secret bytes" * 100
    commit = storage.hf.commit_of(url, 5)
    monkeypatch.setenv("WDSLLM_ANONYMOUS", "hf")
    with pytest.raises(StorageError):
        storage.read_bytes(f"hf://datasets/{name}@{commit}/ds/blob.bin")
