"""storage.py against real servers: local files, an HTTP server with injected faults, moto S3."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from wdsllm import storage
from wdsllm.storage import (
    Output,
    RetryPolicy,
    ShardCache,
    StorageError,
    dirname_url,
    exists,
    expand_urls,
    is_remote,
    join_url,
    open_stream,
    prefetch_iter,
    read_bytes,
)

FAST = RetryPolicy(attempts=8, base_delay=0.01, max_delay=0.05, timeout=2.0)


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic bytes that differ at every offset, so a duplicated or lost byte shows."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def delta(before: dict[str, int]) -> dict[str, int]:
    now = storage.stats()
    return {k: now[k] - before[k] for k in now}


@pytest.fixture
def served(http_server):
    """Write a file under the HTTP root and return (url, bytes)."""

    def put(name: str, data: bytes) -> str:
        path = http_server.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return http_server.url_for(name)

    return put


# ----------------------------------------------------------------------------------------------
# URLs


def test_expand_urls_keeps_order_and_duplicates():
    assert expand_urls("s3://b/shard-{000001..000003}.tar") == [
        "s3://b/shard-000001.tar",
        "s3://b/shard-000002.tar",
        "s3://b/shard-000003.tar",
    ]
    assert expand_urls(["a-{1,1}.tar", "b.tar"]) == ["a-1.tar", "a-1.tar", "b.tar"]


def test_join_and_dirname_round_trip():
    for root in ("/data/ds", "file:///data/ds", "https://host/x/ds", "s3://bucket/prefix/ds"):
        for base in (root, root + "/"):
            url = join_url(base, "index.json")
            assert url == root.rstrip("/") + "/index.json"
            assert dirname_url(url) == root
        assert dirname_url(root + "/") == root
    assert dirname_url("index.json") == "."
    assert dirname_url("s3://bucket/index.json") == "s3://bucket"
    assert is_remote("s3://b/k") and is_remote("https://h/x") and not is_remote("/tmp/x")
    assert not is_remote("pipe:cat x")
    for bad in ("../x", "/etc/passwd", "a//b", ""):
        with pytest.raises(StorageError):
            join_url("/data", bad)


# ----------------------------------------------------------------------------------------------
# Local files


def test_local_read_whole_offset_and_range(tmp_path):
    data = payload(100_000)
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(data)
    for url in (str(path), f"file://{path}"):
        with open_stream(url) as f:
            assert f.read() == data
        with open_stream(url, offset=12345) as f:
            assert f.read() == data[12345:]
        with open_stream(url, offset=12345, length=1000) as f:
            assert f.read() == data[12345:13345]
        assert read_bytes(url) == data
        assert exists(url)


def test_local_checksum_checked_at_end(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"hello world")
    with open_stream(str(path), expected_sha256=sha(b"hello world")) as f:
        assert f.read() == b"hello world"
    with pytest.raises(StorageError, match="sha256"), open_stream(str(path), expected_sha256=sha(b"other")) as f:
        f.read()
    with pytest.raises(StorageError, match="expected 3"):
        open_stream(str(path), expected_size=3)


def test_local_missing_file_error_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "shard-000001.tar"
    with pytest.raises(StorageError) as info:
        open_stream(str(missing))
    assert str(missing) in str(info.value) and "no such file" in str(info.value)
    assert not exists(str(missing))


# ----------------------------------------------------------------------------------------------
# HTTP


def test_http_full_read_equals_file(served, http_server):
    data = payload(300_000)
    url = served("ds/shard-000000.tar", data)
    with open_stream(url, retry=FAST) as f:
        assert f.read() == data
    assert read_bytes(url, retry=FAST) == data
    assert exists(url, retry=FAST)
    assert not exists(http_server.url_for("ds/missing.tar"), retry=FAST)


def test_http_connections_are_kept_alive(served, http_server):
    urls = [served(f"k{i}.bin", payload(20_000, seed=i)) for i in range(3)]
    for i, url in enumerate(urls):
        with open_stream(url, retry=FAST) as f:
            assert f.read() == payload(20_000, seed=i)
    with open_stream(urls[0], offset=10, length=10, retry=FAST) as f:
        assert f.read() == payload(20, seed=0)[10:]
    # aiohttp's pool reuses kept-alive connections (it may hold more than one idle connection to
    # the host from earlier tests, so the requests need not all share one)
    assert len({r.client_port for r in http_server.log()}) < len(http_server.log()) == 4


def test_http_netrc_is_honoured_where_there_is_one(served, http_server, tmp_path, monkeypatch):
    """aiohttp's trust_env (proxies and netrc) is on only where the environment has one of them
    (it looks both up in a thread for every request); a netrc that appears is then used."""
    import base64

    from wdsllm.storage import aio, http

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    url = served("n.bin", payload(100))
    assert not aio.environment_to_trust()
    assert read_bytes(url, retry=FAST) == payload(100)
    assert http.filesystem().client_kwargs["trust_env"] is False
    assert http_server.log("/n.bin")[-1].authorization is None
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login reader password s3cret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert aio.environment_to_trust()
    assert read_bytes(url, retry=FAST) == payload(100)
    assert http.filesystem().client_kwargs["trust_env"] is True
    sent = http_server.log("/n.bin")[-1].authorization
    assert sent == "Basic " + base64.b64encode(b"reader:s3cret").decode()


def test_http_idle_connection_closed_by_server_is_not_a_fault(served, http_server):
    a, b = served("a.bin", payload(1000, seed=1)), served("b.bin", payload(1000, seed=2))
    http_server.faults.add("/a.bin", "close_after")
    before = storage.stats()
    assert read_bytes(a, retry=FAST) == payload(1000, seed=1)
    time.sleep(0.05)
    assert read_bytes(b, retry=FAST) == payload(1000, seed=2)
    assert delta(before)["retries"] == 0
    assert http_server.count() == 2


def test_http_offset_and_length_ask_for_ranges(served, http_server):
    data = payload(50_000)
    url = served("x.bin", data)
    with open_stream(url, offset=1000, retry=FAST) as f:
        assert f.read() == data[1000:]
    with open_stream(url, offset=1000, length=999, retry=FAST) as f:
        assert f.read() == data[1000:1999]
    with open_stream(url, offset=49_000, length=5000, retry=FAST) as f:  # past the end: clipped
        assert f.read() == data[49_000:]
    with open_stream(url, offset=50_000, retry=FAST) as f:  # exactly at the end: empty
        assert f.read() == b""
    assert http_server.ranges("/x.bin")[:3] == ["bytes=1000-", "bytes=1000-1998", "bytes=49000-53999"]


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_http_stream_resumes_after_dropped_connections(served, http_server, reset):
    data = payload(200_000)
    url = served("ds/shard-000001.tar", data)
    http_server.faults.add("*/shard-000001.tar", "drop_after", bytes=30_000, reset=reset, times=4)
    before = storage.stats()
    with open_stream(url, retry=FAST) as f:
        got = b"".join(iter(lambda: f.read(7777), b""))
    assert got == data
    d = delta(before)
    assert d["retries"] == 4 and d["requests"] == 5
    ranges = http_server.ranges("*/shard-000001.tar")
    if not reset:
        # Each retry resumes at the byte where the previous body broke, never from byte 0.
        assert ranges == [None, "bytes=30000-", "bytes=60000-", "bytes=90000-", "bytes=120000-"]
        assert d["resumed_bytes"] == 30_000 + 60_000 + 90_000 + 120_000
    else:
        # An RST may discard bytes the client had not read yet; resumes still move forward only.
        starts = [int(r[len("bytes=") : -1]) for r in ranges[1:]]
        assert ranges[0] is None and starts == sorted(starts) and starts[-1] > 0


def test_http_resume_of_a_ranged_read_keeps_its_end(served, http_server):
    data = payload(100_000)
    url = served("r.bin", data)
    http_server.faults.add("/r.bin", "drop_after", bytes=10_000, times=2)
    with open_stream(url, offset=5000, length=50_000, retry=FAST) as f:
        assert f.read() == data[5000:55_000]
    assert http_server.ranges("/r.bin") == ["bytes=5000-54999", "bytes=15000-54999", "bytes=25000-54999"]


def test_http_whole_read_of_megabytes_is_exact_through_cuts_and_checks_its_digest(served, http_server):
    """read() of a whole object (read_bytes: an index's lengths, a tokenizer) asks the body for
    megabytes at a time; it still resumes at the byte where a body broke and checks the digest."""
    data = payload(6_000_000)
    url = served("big.bin", data)
    http_server.faults.add("/big.bin", "drop_after", bytes=2_500_000, times=2)
    assert read_bytes(url, retry=FAST) == data
    assert http_server.ranges("/big.bin") == [None, "bytes=2500000-", "bytes=5000000-"]
    good = hashlib.sha256(data).hexdigest()
    with open_stream(url, retry=FAST, expected_sha256=good) as f:
        assert f.read(10) == data[:10] and f.read() == data[10:]
    with open_stream(url, retry=FAST, expected_sha256="0" * 64) as f, pytest.raises(StorageError, match="sha256"):
        f.read()


def test_http_server_that_ignores_range_is_skipped_not_duplicated(served, http_server):
    data = payload(80_000)
    url = served("i.bin", data)
    http_server.faults.add("/i.bin", "drop_after", bytes=20_000)
    http_server.faults.add("/i.bin", "ignore_range")
    before = storage.stats()
    with open_stream(url, retry=FAST) as f:
        assert f.read() == data
    assert delta(before)["skipped_bytes"] == 20_000


@pytest.mark.parametrize("status", [503, 500, 429])
def test_http_transient_status_then_success(served, http_server, status):
    data = payload(10_000)
    url = served("s.bin", data)
    http_server.faults.add("/s.bin", "status", status=status, times=3)
    with open_stream(url, retry=FAST) as f:
        assert f.read() == data
    assert http_server.count("/s.bin") == 4


def test_http_stall_past_timeout_then_resume(served, http_server):
    data = payload(60_000)
    url = served("stall.bin", data)
    http_server.faults.add("/stall.bin", "stall", bytes=10_000, seconds=5)
    policy = RetryPolicy(base_delay=0.01, timeout=0.5)
    t0 = time.monotonic()
    with open_stream(url, retry=policy) as f:
        assert f.read() == data
    assert time.monotonic() - t0 < 2.5
    assert http_server.ranges("/stall.bin") == [None, "bytes=10000-"]


@pytest.mark.parametrize("status,reason", [(404, "Not Found"), (403, "Forbidden"), (401, "Unauthorized")])
def test_http_permanent_status_fails_fast(served, http_server, status, reason):
    url = served("ds/shard-000003.tar", payload(1000))
    http_server.faults.add("*/shard-000003.tar", "status_permanent", status=status)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        open_stream(url, retry=RetryPolicy(base_delay=0.5))
    assert time.monotonic() - t0 < 0.4
    assert str(info.value) == f"{url}: HTTP {status} {reason}"
    assert http_server.count("*/shard-000003.tar") == 1


def test_http_checksum_mismatch_fails_at_the_end(served, http_server):
    data = payload(30_000)
    url = served("sum.bin", data)
    http_server.faults.add("/sum.bin", "corrupt", at=20_000)
    with open_stream(url, expected_sha256=sha(data), retry=FAST) as f:
        head = f.read(20_000)
        with pytest.raises(StorageError, match=r"sum\.bin: sha256 .* does not match"):
            f.read()
        with pytest.raises(StorageError, match="sha256"):
            f.read()  # still an error, not a quiet end
    assert head == data[:20_000]
    with pytest.raises(StorageError, match="is 30000 bytes, expected 1"):
        open_stream(url, expected_size=1, retry=FAST)


def test_exists_fails_fast_on_forbidden(served, http_server):
    url = served("secret.bin", b"x")
    http_server.faults.add("/secret.bin", "status_permanent", status=403)
    with pytest.raises(StorageError, match="HTTP 403"):
        exists(url, retry=FAST)
    assert http_server.count("/secret.bin", method="HEAD") == 1


def test_http_missing_file_is_404(http_server):
    url = http_server.url_for("nothing/here.tar")
    with pytest.raises(StorageError, match="HTTP 404"):
        read_bytes(url, retry=FAST)
    assert http_server.count() == 1


def test_http_retries_exhausted_names_url_and_attempts(served, http_server):
    url = served("down.bin", b"x")
    http_server.faults.add("/down.bin", "status", status=503, times=None)
    with pytest.raises(StorageError) as info:
        open_stream(url, retry=RetryPolicy(attempts=3, base_delay=0.01))
    message = str(info.value)
    assert message.startswith(f"{url}: giving up after 3 attempts") and "HTTP 503" in message
    assert not isinstance(info.value, storage.TransientError)
    assert http_server.count("/down.bin") == 3


def test_connection_refused_is_retried_then_fails():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x.tar"
    before = storage.stats()
    with pytest.raises(StorageError, match="giving up after 3 attempts.*ConnectionRefused"):
        open_stream(url, retry=RetryPolicy(attempts=3, base_delay=0.01))
    assert delta(before)["retries"] == 2


def test_http_object_replaced_during_read_is_an_error(served, http_server):
    data = payload(100_000)
    url = served("v.bin", data)
    http_server.faults.add("/v.bin", "drop_after", bytes=40_000)
    with open_stream(url, retry=FAST) as f:
        first = f.read(10_000)
        (http_server.root / "v.bin").write_bytes(payload(100_000, seed=1) + b"longer")
        with pytest.raises(StorageError, match="changed"):
            f.read()
    assert first == data[:10_000]


def test_storage_error_survives_pickling():
    import pickle

    original = storage.StorageError("s3://b/k: S3 NoSuchKey", url="s3://b/k", reason="S3 NoSuchKey")
    err = pickle.loads(pickle.dumps(original))
    assert (str(err), err.url, err.reason) == ("s3://b/k: S3 NoSuchKey", "s3://b/k", "S3 NoSuchKey")


def test_retry_delays_are_capped_and_repeatable():
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    delays = [policy.delay("s3://b/k", k) for k in range(8)]
    assert delays == [policy.delay("s3://b/k", k) for k in range(8)]
    assert all(0.05 * 2**k <= d <= 0.1 * 2**k for k, d in enumerate(delays[:3]))
    assert max(delays) <= 1.0


# ----------------------------------------------------------------------------------------------
# S3


def test_boto3_honours_aws_endpoint_url(s3_server):
    import boto3

    assert boto3.session.Session().client("s3").meta.endpoint_url == s3_server.endpoint
    assert storage.s3_endpoint() == s3_server.endpoint


def test_s3_read_ranged_read_and_exists(s3_server, s3_bucket, tmp_path):
    data = payload(150_000)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "shard-000000.tar").write_bytes(data)
    (tmp_path / "ds" / "index.json").write_bytes(b'{"x": 1}')
    s3_server.upload_dir(tmp_path / "ds", f"{s3_bucket}/prefix/ds/")
    url = f"{s3_bucket}/prefix/ds/shard-000000.tar"
    with open_stream(url, retry=FAST) as f:
        assert f.read() == data
    with open_stream(url, offset=100, length=5000, retry=FAST) as f:
        assert f.read() == data[100:5100]
    with open_stream(url, offset=140_000, retry=FAST) as f:
        assert f.read() == data[140_000:]
    with open_stream(url, offset=150_000, retry=FAST) as f:
        assert f.read() == b""
    assert read_bytes(join_url(dirname_url(url), "index.json")) == b'{"x": 1}'
    assert exists(url) and not exists(f"{s3_bucket}/prefix/ds/missing.tar")


def test_s3_timestamps_parse_as_botocore_parses_them(s3_server, s3_bucket):
    """Our quick parser gives botocore's datetime for every form, and real S3 answers (a HEAD's
    Last-Modified, a listing's LastModified) come back as zone-aware datetimes of now."""
    import datetime

    from botocore.utils import parse_timestamp as botocore_parse

    from wdsllm.storage import s3 as s3mod

    for value in [
        "Thu, 26 Nov 2026 13:21:27 GMT",
        "2026-11-26T13:21:27.000Z",
        "2026-11-26T13:21:27+02:00",
        "2026-11-26T13:21:27",  # no zone: botocore's own rule
        "1700000000",
        1700000000,
        "Donnerstag, 26 Nov 2026 13:21:27 GMT",  # not the C locale's day name: botocore decides
    ]:
        try:
            expected = botocore_parse(value)
        except Exception as exc:
            with pytest.raises(type(exc)):
                s3mod.parse_timestamp(value)
            continue
        got = s3mod.parse_timestamp(value)
        assert got == expected and got.utcoffset() == expected.utcoffset(), value
    s3_server.client().put_object(Bucket=s3_bucket.removeprefix("s3://"), Key="when/t.bin", Body=b"x")
    fs = s3mod.filesystem()
    now = datetime.datetime.now(datetime.timezone.utc)
    listed = fs.ls(f"{s3_bucket}/when", detail=True, refresh=True)[0]["LastModified"]
    headed = fs.info(f"{s3_bucket}/when/t.bin", refresh=True)["LastModified"]
    for when in (listed, headed):
        assert when.tzinfo is not None and abs(when - now) < datetime.timedelta(hours=1)


def test_s3_missing_key_or_bucket_fails_fast(s3_server, s3_bucket):
    for url, code in ((f"{s3_bucket}/nope.tar", "NoSuchKey"), ("s3://no-such-bucket-wdsllm/x.tar", "NoSuchBucket")):
        before = storage.stats()
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            open_stream(url, retry=RetryPolicy(base_delay=0.5))
        assert time.monotonic() - t0 < 0.4
        assert str(info.value).startswith(f"{url}: S3 {code}")
        assert delta(before)["retries"] == 0


def test_s3_stream_resumes_with_ranged_gets(http_server, monkeypatch):
    """S3's GetObject over the fault-injecting server: drops resume with Range, 503s are retried."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", http_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    data = payload(120_000)
    (http_server.root / "bucket").mkdir()
    (http_server.root / "bucket" / "shard-000002.tar").write_bytes(data)
    http_server.faults.add("/bucket/shard-000002.tar", "drop_after", bytes=25_000, times=2)
    http_server.faults.add("/bucket/shard-000002.tar", "status", status=503)
    with open_stream("s3://bucket/shard-000002.tar", retry=FAST) as f:
        assert f.read() == data
    assert http_server.ranges("/bucket/shard-000002.tar") == [None, "bytes=25000-", "bytes=50000-", "bytes=50000-"]
    http_server.faults.add("/bucket/shard-000002.tar", "status_permanent", status=403)
    with pytest.raises(StorageError, match=r"^s3://bucket/shard-000002.tar: S3 403"):
        open_stream("s3://bucket/shard-000002.tar", retry=FAST)


def _check_output(out: Output, staging_file_size: int) -> None:
    assert out.is_empty()
    assert out.list_names() == []
    assert out.get_bytes("index.json") is None
    out.put_bytes("index.json", b'{"shards": []}')
    assert out.get_bytes("index.json") == b'{"shards": []}'
    assert not out.is_empty()
    staging = Path(out.local_staging_dir())
    shard = payload(staging_file_size)
    tmp = staging / ".shard-000000.tar.tmp"
    tmp.write_bytes(shard)
    out.put_file(str(tmp), "shard-000000.tar")
    assert not tmp.exists()
    assert out.get_bytes("shard-000000.tar") == shard
    assert read_bytes(out.url_of("shard-000000.tar")) == shard
    out.put_bytes("sub/lengths.npy", b"123")
    assert out.list_names() == ["index.json", "shard-000000.tar", "sub/lengths.npy"]
    out.delete("index.json")
    out.delete("index.json")  # deleting what is gone is fine
    assert out.list_names() == ["shard-000000.tar", "sub/lengths.npy"]
    out.clear()
    assert out.is_empty() and out.list_names() == []


@pytest.mark.parametrize("scheme", ["path", "file"])
def test_output_local(tmp_path, scheme):
    url = str(tmp_path / "out") if scheme == "path" else f"file://{tmp_path}/out/"
    with Output(url) as out:
        _check_output(out, 100_000)
        assert out.local_staging_dir() == str(tmp_path / "out")
    assert not list((tmp_path / "out").iterdir())


def test_output_s3_with_multipart_upload(s3_server, s3_bucket):
    url = f"{s3_bucket}/datasets/run1/"
    with Output(url, retry=FAST, multipart_threshold=10 << 20) as out:
        staging = out.local_staging_dir()
        _check_output(out, 6 * 2**20)  # below the threshold: one PUT
        assert Path(staging).is_dir()
        big = Path(staging) / "big.tar"
        big.write_bytes(payload(12 * 2**20, seed=3))
        out.put_file(str(big), "big.tar")
        bucket = s3_bucket[len("s3://") :]
        etag = s3_server.client().head_object(Bucket=bucket, Key="datasets/run1/big.tar")["ETag"]
        assert etag.strip('"').endswith("-3"), etag  # a multipart upload of 5 + 5 + 2 MiB
        assert s3_server.get(f"{s3_bucket}/datasets/run1/big.tar") == payload(12 * 2**20, seed=3)
        # Output only lists under its own prefix.
        s3_server.client().put_object(Bucket=bucket, Key="datasets/run10/other", Body=b"x")
        assert out.list_names() == ["big.tar"]
    assert not Path(staging).exists()


def test_output_refuses_http():
    with pytest.raises(StorageError, match="cannot be written over http"):
        Output("https://host/ds/")


# ----------------------------------------------------------------------------------------------
# pipe:


def test_pipe_refused_unless_allowed(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"data")
    with pytest.raises(StorageError, match="allow_pipe"):
        open_stream(f"pipe:cat {path}")
    with pytest.raises(StorageError, match="allow_pipe"):
        read_bytes(f"pipe:cat {path}")


def test_pipe_reads_command_output(tmp_path):
    data = payload(100_000)
    path = tmp_path / "a.bin"
    path.write_bytes(data)
    assert read_bytes(f"pipe:cat {path}", allow_pipe=True) == data
    with open_stream(f"pipe:cat {path}", offset=500, length=1000, allow_pipe=True) as f:
        assert f.read() == data[500:1500]
    with pytest.raises(StorageError, match="exited with status"):
        read_bytes(f"pipe:cat {tmp_path / 'missing'} 2>/dev/null", allow_pipe=True)


# ----------------------------------------------------------------------------------------------
# Cache


def test_cache_second_open_is_served_locally(served, http_server, tmp_path):
    data = payload(200_000)
    url = served("ds/shard-000000.tar", data)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=10 << 20)
    before = storage.stats()
    for _ in range(2):
        with open_stream(url, cache=cache, expected_sha256=sha(data), retry=FAST) as f:
            assert f.read() == data
    with open_stream(url, cache=cache, expected_sha256=sha(data), offset=1000, length=10, retry=FAST) as f:
        assert f.read() == data[1000:1010]
    assert http_server.count("*/shard-000000.tar") == 1
    d = delta(before)
    assert d["cache_misses"] == 1 and d["cache_hits"] == 2
    assert Path(cache.path_for(url, sha(data))).read_bytes() == data


def test_cache_download_survives_faults(served, http_server, tmp_path):
    data = payload(150_000)
    url = served("f.tar", data)
    http_server.faults.add("/f.tar", "drop_after", bytes=50_000, times=2)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=10 << 20)
    with cache.open(url, expected_size=len(data), retry=FAST) as f:
        assert f.read() == data
    assert http_server.ranges("/f.tar") == [None, "bytes=50000-", "bytes=100000-"]


def test_cache_rejects_a_corrupt_download(served, http_server, tmp_path):
    data = payload(100_000)
    url = served("c.tar", data)
    http_server.faults.add("/c.tar", "corrupt", at=54_321)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=10 << 20)
    with pytest.raises(StorageError, match=r"c\.tar: sha256 .* not cached"):
        cache.open(url, expected_sha256=sha(data), retry=FAST)
    assert cache.entries() == []
    assert not [p for p in os.listdir(cache.directory) if p.endswith(".part")]
    with cache.open(url, expected_sha256=sha(data), retry=FAST) as f:  # the next try downloads again
        assert f.read() == data
    assert http_server.count("/c.tar") == 2


def _cache_worker(cache_dir: str, url: str, expected: str, go, results) -> None:
    go.wait(10)
    cache = ShardCache(cache_dir, max_bytes=10 << 20)
    with open_stream(url, cache=cache, expected_sha256=expected, retry=FAST) as f:
        results.put(sha(f.read()))


def test_cache_concurrent_processes_download_once(served, http_server, tmp_path):
    data = payload(500_000)
    url = served("ds/shard-000007.tar", data)
    http_server.faults.add("*/shard-000007.tar", "delay", seconds=0.3)  # keeps the download window open
    ctx = multiprocessing.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_cache_worker, args=(str(tmp_path / "cache"), url, sha(data), go, results)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    go.set()
    digests = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert digests == [sha(data), sha(data)]
    assert http_server.count("*/shard-000007.tar") == 1


@pytest.mark.timeout(20)
def test_cache_entry_is_read_by_many_at_once(served, http_server, tmp_path):
    data = payload(100_000)
    url = served("m.tar", data)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=10 << 20)
    with cache.open(url, retry=FAST) as f1, cache.open(url, retry=FAST) as f2:
        assert f1.read(10) == data[:10]
        assert f2.read() == data  # a second reader of an entry in use does not wait
        assert f1.read() == data[10:]
    assert http_server.count("/m.tar") == 1


def test_cache_lru_eviction_keeps_total_under_max_bytes(served, http_server, tmp_path):
    shards = {i: payload(10_000, seed=i) for i in range(1, 5)}
    urls = {i: served(f"shard-00000{i}.tar", d) for i, d in shards.items()}
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=25_000)

    def use(i: int) -> None:
        with cache.open(urls[i], expected_sha256=sha(shards[i]), retry=FAST) as f:
            assert f.read() == shards[i]
        assert cache.total_bytes() <= 25_000

    def cached() -> set[int]:
        return {i for i in shards if os.path.exists(cache.path_for(urls[i], sha(shards[i])))}

    use(1)
    use(2)
    use(1)  # a hit makes 1 the most recently used
    use(3)
    assert cached() == {1, 3}
    use(4)
    assert cached() == {3, 4}
    assert http_server.count("/shard-000001.tar") == 1


def test_cache_never_evicts_an_entry_being_read(served, tmp_path):
    a, b = payload(10_000, seed=1), payload(10_000, seed=2)
    url_a, url_b = served("a.tar", a), served("b.tar", b)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=15_000)
    with cache.open(url_a, retry=FAST) as fa:
        head = fa.read(100)
        with cache.open(url_b, retry=FAST) as fb:
            assert fb.read() == b
        assert os.path.exists(cache.path_for(url_a))  # in use: kept although over the limit
        assert head + fa.read() == a
    with cache.open(url_b, retry=FAST) as fb:  # now a can go
        fb.read()
    assert not os.path.exists(cache.path_for(url_a))


# ----------------------------------------------------------------------------------------------
# Prefetch


def test_prefetch_iterates_shards_in_order(served, http_server, tmp_path):
    shards = [payload(50_000 + 1000 * i, seed=i) for i in range(6)]
    urls = [served(f"ds/shard-{i:06d}.tar", d) for i, d in enumerate(shards)]
    http_server.faults.add("*/shard-000002.tar", "drop_after", bytes=10_000, times=2)
    cache = ShardCache(str(tmp_path / "cache"), max_bytes=10 << 20)
    items = [
        (u, {"retry": FAST, "cache": cache if i % 2 else None, "expected_sha256": sha(d)})
        for i, (u, d) in enumerate(zip(urls, shards))
    ]
    got = []
    for stream in prefetch_iter(items, depth=2, chunk_size=8192, max_chunks=2):
        got.append(b"".join(iter(lambda s=stream: s.read(3000), b"")))
    assert got == shards
    local = tmp_path / "local.bin"
    local.write_bytes(b"local")
    assert [s.read() for s in prefetch_iter([str(local), urls[0]], depth=0)] == [b"local", shards[0]]


def test_prefetch_starts_small_shards_ahead_up_to_a_byte_budget(served, http_server):
    """Beyond ``depth``, objects of known size are started while those waiting behind the current
    one fit ``ahead_bytes``: with 4 shards of 40 kB and a budget of 100 kB, the first and the two
    behind it have been requested before the first is read, and every byte arrives in order."""
    shards = [payload(40_000, seed=i) for i in range(5)]
    urls = [served(f"small/shard-{i:06d}.tar", d) for i, d in enumerate(shards)]
    items = [(u, {"retry": FAST, "expected_size": len(d)}) for u, d in zip(urls, shards)]
    it = prefetch_iter(items, depth=1, spool=True, ahead_bytes=100_000)
    first = next(it)
    deadline = time.monotonic() + 5
    while http_server.count("*/small/*") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {r.path.rsplit("/", 1)[-1] for r in http_server.log("*/small/*")} == {f"shard-{i:06d}.tar" for i in range(3)}
    got = [first.read()] + [s.read() for s in it]
    assert got == shards


def test_prefetch_error_reaches_the_consumer(served, http_server):
    url_ok = served("ok.tar", b"ok")
    url_missing = http_server.url_for("missing.tar")
    it = prefetch_iter([url_ok, (url_missing, {"retry": FAST})], depth=1)
    assert next(it).read() == b"ok"
    failing = next(it)
    with pytest.raises(StorageError, match="missing.tar: HTTP 404"):
        failing.read()
    with pytest.raises(StorageError, match="missing.tar: HTTP 404"):  # not a silent end on retry
        failing.read()


def test_prefetch_stopped_early_stops_its_threads(served, http_server):
    urls = [served(f"p{i}.tar", payload(3 << 20, seed=i)) for i in range(3)]
    baseline = threading.active_count()
    it = prefetch_iter([(u, {"retry": FAST}) for u in urls], depth=2, chunk_size=1 << 16, max_chunks=2)
    first = next(it)
    assert first.read(10) == payload(10, seed=0)
    it.close()
    assert first.closed
    deadline = time.monotonic() + 5
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() <= baseline


@pytest.mark.parametrize("anonymous", [False, True])
def test_s3_worker_forked_after_prepare_workers_reads_with_the_prepared_client(s3_server, anonymous, monkeypatch):
    """The parent builds a client once (never entered); each forked child enters its own copy on
    its own loop and reads exact bytes; the parent keeps its copy for the next epoch's workers."""
    from wdsllm.storage import s3 as s3mod

    data = os.urandom(300_000)
    bucket = s3_server.new_bucket(public=anonymous)
    s3_server.client().put_object(Bucket=bucket, Key="w.bin", Body=data)
    url = f"s3://{bucket}/w.bin"
    if anonymous:
        monkeypatch.setenv("WDSLLM_ANONYMOUS", "s3")
    assert storage.read_bytes(url) == data  # the parent's own client
    storage.prepare_workers()
    assert s3mod.CLIENTS.prepared, "a prepared session for the workers"
    prepared = dict(s3mod.CLIENTS.prepared)
    clients = [session.prepared[1] for session in prepared.values()]  # built, not entered
    # the TLS contexts (the CA bundle loaded: 43 ms of CPU) are built here, once, for every child
    contexts = [c._endpoint.http_session._build_ssl_contexts(None)[0] for c in clients]
    assert all(ctx.cert_store_stats()["x509_ca"] > 0 for ctx in contexts)
    assert [c._endpoint.http_session._build_ssl_contexts(None)[0] for c in clients] == contexts
    for _ in range(2):  # two epochs of workers, both from the same prepared client
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                ok = storage.read_bytes(url) == data
                with storage.open_stream(url, offset=1000, length=5000) as f:
                    ok = ok and f.read() == data[1000:6000]
                fs = s3mod.filesystem()
                took = any(fs._s3 is c for c in clients) and len(s3mod.CLIENTS.prepared) == len(prepared) - 1
                tls = fs._s3._endpoint.http_session._build_ssl_contexts(None)[0]
                took = took and any(tls is ctx for ctx in contexts)
                os.write(w, f"{ok} {took}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        assert os.read(r, 100).decode() == "True True" and status == 0
        os.close(r)
    assert s3mod.CLIENTS.prepared == prepared  # the parent never uses it
    assert storage.read_bytes(url) == data
