"""URLs: brace expansion, and reading or writing datasets on local disks, http(s), s3 and ``pipe:``.

Training reads shards for days over networks that drop connections, throttle and stall. This
module turns those faults into either a stream that delivers exactly the object's bytes once, in
order (transient faults are retried, and a retry resumes with a ranged request at the byte where
the stream broke), or a :class:`StorageError` that names the URL and the reason (permanent faults
fail at once, without retries).

Layers, from the bottom:

* openers (``_http_open``, ``_s3_open``, ``_local_open``, ``_PipeBody``) answer one request for
  the bytes ``[start, end)`` of one object with a *body*;
* :class:`_ResumableStream` reads bodies, classifies errors, backs off and reopens at its position;
* :func:`open_stream` picks the opener, the :class:`ShardCache` and the verification;
* :class:`ReadAhead` and :func:`prefetch_iter` overlap the next shard's latency with the current
  shard's consumption;
* :class:`Output` writes a dataset directory (local or ``s3://``) atomically, name by name.

Processes and threads: boto3 clients and keep-alive http connections are created lazily and
cached per process (the caches are dropped in a forked child, see ``os.register_at_fork``). One
stream must be used by one thread at a time; different streams may be used from different threads.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import hashlib
import http.client
import io
import logging
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Union
from urllib.parse import quote, unquote, urljoin, urlsplit

import braceexpand

log = logging.getLogger(__name__)

#: Files above this size go to S3 as multipart uploads (``WDSLLM_S3_MULTIPART_THRESHOLD``, in
#: bytes, overrides it, e.g. for tests that run ``wdsllm pack`` in a subprocess).
MULTIPART_THRESHOLD = int(os.environ.get("WDSLLM_S3_MULTIPART_THRESHOLD") or 64 * 2**20)
#: Read size of downloads into the cache and of :class:`ReadAhead` chunks.
CHUNK_SIZE = 1 << 20
#: Buffer of the stream objects that :func:`open_stream` returns for remote URLs.
STREAM_BUFFER = 256 * 1024
USER_AGENT = "wdsllm-storage/1"
_MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_POOL_MAX = 8  # idle keep-alive connections kept per (scheme, host)
_REMOTE_SCHEMES = ("http", "https", "s3")

# ----------------------------------------------------------------------------------------------
# Errors, retry policy, counters


class StorageError(IOError):
    """A permanent failure. The message always names the URL and the reason.

    ``url`` and ``reason`` are also attributes, so callers can re-word the message. The class pickles
    (DataLoader workers send exceptions to the main process).
    """

    def __init__(self, message: str, url: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.reason = reason if reason is not None else message


class TransientError(StorageError):
    """A failure worth retrying (connection reset, timeout, 5xx, throttling, early end).

    It is raised internally and never escapes the retry loop: when the attempts are used up the
    caller gets a plain :class:`StorageError`.
    """


class NotFoundError(StorageError):
    """A permanent failure because the object does not exist (HTTP 404/410, S3 NoSuchKey or
    NoSuchBucket, a missing local file). Callers that probe for optional objects (an index beside
    shards) catch this one and let every other failure through."""


def _error(url: str, reason: str, transient: bool = False, missing: bool = False) -> StorageError:
    cls = TransientError if transient else (NotFoundError if missing else StorageError)
    return cls(f"{url}: {reason}", url=url, reason=reason)


_S3_MISSING = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}


def _is_missing(exc: BaseException) -> bool:
    """Whether a non-StorageError exception says that the object does not exist."""
    if isinstance(exc, NotFoundError) or isinstance(exc, FileNotFoundError):
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _S3_MISSING or status == 404
    return False


@dataclass
class RetryPolicy:
    """How hard to try. ``attempts`` counts tries, the first included.

    For a stream the count restarts whenever a try delivered bytes: a long download survives many
    faults spread over its length, while a stream that makes no progress gives up after
    ``attempts`` tries. The delay before retry ``k`` (0-based) is
    ``min(max_delay, base_delay * 2**k)`` times a jitter in [0.5, 1) drawn from a generator seeded
    with (url, k): repeatable in tests, and unable to influence which bytes are read.
    """

    attempts: int = 8
    base_delay: float = 0.1
    max_delay: float = 5.0
    timeout: float = 30.0

    def delay(self, url: str, retry: int) -> float:
        jitter = random.Random(f"{url}#{retry}").uniform(0.5, 1.0)
        return min(self.max_delay, self.base_delay * 2**retry) * jitter


DEFAULT_RETRY = RetryPolicy()

_STAT_NAMES = ("requests", "retries", "resumed_bytes", "received_bytes", "skipped_bytes", "cache_hits", "cache_misses")
_stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)
_stats_lock = threading.Lock()


def _count(name: str, n: int = 1) -> None:
    with _stats_lock:
        _stats[name] += n


def stats() -> dict[str, int]:
    """Counters of this process since import or :func:`reset_stats`.

    ``requests``: requests sent (opens, resumes, HEADs); ``retries``: tries after a failure;
    ``resumed_bytes``: bytes that resumed retries did not read again (sum of the resume positions
    past the stream's start); ``received_bytes``: body bytes received over HTTP and from S3;
    ``skipped_bytes``: bytes read and dropped because a server ignored Range; ``cache_hits`` / ``cache_misses``: :class:`ShardCache` lookups.
    """
    with _stats_lock:
        return dict(_stats)


def reset_stats() -> None:
    with _stats_lock:
        for k in _stats:
            _stats[k] = 0


def _classify(url: str, exc: BaseException) -> tuple[bool, str] | None:
    """(transient, reason) for the errors we know, None for the rest (bugs propagate unchanged)."""
    if isinstance(exc, StorageError):
        return isinstance(exc, TransientError), exc.reason
    s3 = _classify_boto(exc)
    if s3 is not None:
        return s3
    if isinstance(exc, TimeoutError):
        return True, f"timed out ({exc or 'no data'})"
    if isinstance(exc, http.client.IncompleteRead):
        return True, f"connection closed early ({exc!r})"
    if isinstance(exc, (ConnectionError, http.client.HTTPException)):
        return True, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):  # unreachable network, DNS failure, EIO on a network filesystem
        return True, f"{type(exc).__name__}: {exc}"
    return None


# ----------------------------------------------------------------------------------------------
# URLs


def _scheme(url: str) -> str:
    """'file' for local paths, else the lower-case scheme ('pipe' for ``pipe:CMD``)."""
    if url.startswith("pipe:"):
        return "pipe"
    head, sep, _ = url.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        return head.lower()
    return "file"


def _local_path(url: str) -> str:
    if url.startswith("file://"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise _error(url, f"file URL names host {parts.netloc!r}; only local files are supported")
        return unquote(parts.path)
    return url


def is_remote(url: str) -> bool:
    """True for URLs read over the network (http, https, s3): the ones worth caching."""
    return _scheme(url) in _REMOTE_SCHEMES


def expand_urls(patterns: str | list[str]) -> list[str]:
    """Brace-expand each pattern (``shard-{000000..000009}.tar``), keeping order and duplicates."""
    if isinstance(patterns, str):
        patterns = [patterns]
    urls: list[str] = []
    for pattern in patterns:
        urls.extend(braceexpand.braceexpand(pattern))
    return urls


def _check_name(name: str) -> str:
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(p in ("", ".", "..") for p in parts)
        or any(ord(c) < 32 for c in name)
    ):
        raise StorageError(f"{name!r}: not a plain relative name", reason="not a plain relative name")
    return name


def join_url(base: str, name: str) -> str:
    """The URL of ``name`` inside the dataset root ``base`` (with or without a trailing slash).

    In http(s) and ``file://`` URLs the name is percent-encoded, so that it stays one literal
    name: a name such as ``%2e%2e%2fsecret`` from an untrusted index must not be decoded into a
    path that leaves the root (s3 keys and local paths are literal already).
    """
    _check_name(name)
    scheme = _scheme(base)
    if scheme == "pipe":
        raise _error(base, "a pipe: URL has no directory to join names to")
    if scheme == "file" and not base.startswith("file://"):
        return os.path.join(base, name) if base else name
    if scheme != "s3":
        name = quote(name, safe="/")
    return base.rstrip("/") + "/" + name


def dirname_url(url: str) -> str:
    """The dataset root of ``.../index.json`` or ``.../shard-000001.tar``; a root given with a
    trailing slash comes back without it."""
    scheme = _scheme(url)
    if scheme == "pipe":
        raise _error(url, "a pipe: URL has no directory")
    if scheme == "file" and not url.startswith("file://"):
        if url.endswith("/"):
            return url.rstrip("/") or "/"
        return os.path.dirname(url) or "."
    if url.endswith("/"):
        return url.rstrip("/")
    head, _, _ = url.rpartition("/")
    if head.endswith(":/"):  # "s3://bucket" has no parent inside the store
        return url
    return head


def _split_s3(url: str) -> tuple[str, str]:
    rest = url[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise _error(url, "s3 URL has no bucket")
    return bucket, key


# ----------------------------------------------------------------------------------------------
# http(s): keep-alive connections pooled per process


_http_pool: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
_http_lock = threading.Lock()


def _http_connection(scheme: str, netloc: str, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
    with _http_lock:
        idle = _http_pool.get((scheme, netloc))
        conn = idle.pop() if idle else None
    if conn is not None:
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, True
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    return cls(netloc, timeout=timeout), False


def _http_release(scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
    with _http_lock:
        idle = _http_pool.setdefault((scheme, netloc), [])
        if len(idle) < _POOL_MAX:
            idle.append(conn)
            return
    conn.close()


def _http_request(method: str, url: str, headers: dict[str, str], timeout: float):
    """Send one request; a pooled connection that the server closed while idle is replaced once,
    silently, because that is the normal end of keep-alive and not a fault."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise _error(url, "not an http(s) URL")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn, reused = _http_connection(parts.scheme, parts.netloc, timeout)
    while True:
        try:
            conn.request(method, path, headers=headers)
            return conn.getresponse(), conn
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, http.client.BadStatusLine):
            conn.close()
            if not reused:
                raise
            reused = False
        except BaseException:
            conn.close()
            raise


def _http_reason(resp) -> str:
    return f"HTTP {resp.status} {resp.reason}".rstrip()


def _http_status_error(url: str, resp) -> StorageError:
    transient = resp.status in (408, 429) or resp.status >= 500
    return _error(url, _http_reason(resp), transient=transient, missing=resp.status in (404, 410))


_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")


def _parse_content_range(url: str, value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size or None) of a Content-Range header."""
    m = _CONTENT_RANGE.fullmatch((value or "").strip())
    if not m:
        raise _error(url, f"bad Content-Range header {value!r}")
    first = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(3)) if m.group(3) != "*" else None
    return first, total


class _HttpBody:
    def __init__(self, url: str, resp, conn, total: int | None, etag: str | None) -> None:
        self.url, self.resp, self.conn, self.total, self.etag = url, resp, conn, total, etag

    def readinto(self, b) -> int:
        # read1 makes one socket read: bytes that arrived before a reset are delivered and count
        # as progress, where readinto would wait to fill b and lose them with the exception.
        data = self.resp.read1(len(b))
        n = len(data)
        b[:n] = data
        _count("received_bytes", n)
        return n

    def close(self) -> None:
        if self.conn is None:
            return
        conn, self.conn = self.conn, None
        resp = self.resp
        if resp.isclosed() or (not resp.chunked and resp.length == 0):
            resp.close()  # fully read: the connection can carry the next request
            parts = urlsplit(self.url)
            _http_release(parts.scheme, parts.netloc, conn)
        else:
            self.resp.close()
            conn.close()


class _EmptyBody:
    """What a request at or past the end of an object returns."""

    def __init__(self, total: int | None, etag: str | None = None) -> None:
        self.total, self.etag = total, etag

    def readinto(self, b) -> int:
        return 0

    def close(self) -> None:
        pass


def _discard(url: str, resp, n: int) -> None:
    buf = bytearray(min(n, CHUNK_SIZE))
    view = memoryview(buf)
    while n:
        got = resp.readinto(view[: min(n, len(buf))])
        if not got:
            raise _error(url, "connection closed while skipping to the requested offset", transient=True)
        n -= got


def _http_open(url: str, start: int, end: int | None, timeout: float) -> _HttpBody | _EmptyBody:
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if start > 0 or end is not None:
        headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    target = url
    for _ in range(_MAX_REDIRECTS + 1):
        resp, conn = _http_request("GET", target, headers, timeout)
        location = resp.getheader("Location")
        if resp.status not in _REDIRECTS or not location:
            break
        resp.close()
        conn.close()
        target = urljoin(target, location)
    else:
        raise _error(url, f"more than {_MAX_REDIRECTS} redirects")
    try:
        etag = resp.getheader("ETag")
        if resp.status == 206:
            first, total = _parse_content_range(url, resp.getheader("Content-Range"))
            if first != start:
                raise _error(url, f"asked for bytes from {start}, the server sent from {first}")
            return _HttpBody(url, resp, conn, total, etag)
        if resp.status == 200:
            length = resp.getheader("Content-Length")
            total = int(length) if length and length.isdigit() else None
            if start > 0:
                log.warning("%s: server ignored Range and sent the whole object; skipping %d bytes", url, start)
                if total is not None and start >= total:
                    resp.close()
                    conn.close()
                    return _EmptyBody(total, etag)
                _discard(url, resp, start)
                _count("skipped_bytes", start)
            return _HttpBody(url, resp, conn, total, etag)
        if resp.status == 416:
            _, total = _parse_content_range(url, resp.getheader("Content-Range"))
            resp.close()
            conn.close()
            if total is not None and start >= total:
                return _EmptyBody(total)
            raise _error(url, f"{_http_reason(resp)} for bytes from {start}")
        resp.close()
        conn.close()
        raise _http_status_error(url, resp)
    except BaseException:
        resp.close()
        conn.close()
        raise


def _http_exists(url: str, timeout: float, redirects: int = _MAX_REDIRECTS) -> bool:
    resp, conn = _http_request("HEAD", url, {"User-Agent": USER_AGENT}, timeout)
    resp.read()
    location = resp.getheader("Location")
    if resp.status in _REDIRECTS and location and redirects > 0:
        conn.close()
        return _http_exists(urljoin(url, location), timeout, redirects - 1)
    parts = urlsplit(url)
    _http_release(parts.scheme, parts.netloc, conn)
    if 200 <= resp.status < 300:
        return True
    if resp.status in (404, 410):
        return False
    raise _http_status_error(url, resp)


# ----------------------------------------------------------------------------------------------
# s3: boto3 imported lazily, clients cached per process

_s3_clients: dict[tuple[Any, ...], Any] = {}
_s3_lock = threading.Lock()
_S3_PERMANENT = {
    "NoSuchKey",
    "NoSuchBucket",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NotFound",
    "PreconditionFailed",
}
_S3_TRANSIENT = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "429",
}


def _import_boto3(url: str):
    try:
        import boto3
    except ImportError as exc:
        raise _error(url, "s3:// URLs need boto3, which is not installed: pip install wdsllm[s3]") from exc
    return boto3


def s3_endpoint() -> str | None:
    """The S3-compatible endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, if set.

    Recent botocore reads these variables itself; passing the value explicitly also works with
    older versions and lets the client cache notice a change.
    """
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


_boto_loader: Any = None  # botocore's parsed service models, kept across fork (see _boto_session)


def _boto_session(boto3):
    """A new boto3 session that shares this process's parsed service models.

    Sessions and clients are per process (credentials may refresh under locks, connections are
    sockets), but the models are plain data: a DataLoader worker forked from a process that has
    used S3 then makes its client in about 20 ms instead of 80 ms, once per worker and epoch.
    """
    global _boto_loader
    import botocore.session

    core = botocore.session.get_session()
    if _boto_loader is None:
        _boto_loader = core.get_component("data_loader")
    else:
        core.register_component("data_loader", _boto_loader)
    return boto3.session.Session(botocore_session=core)


def _s3_client(timeout: float = DEFAULT_RETRY.timeout, url: str = "s3://"):
    """A client for this process. botocore's own retries are off: :class:`RetryPolicy` is the one
    place that decides how often to try, so ``attempts`` means what it says."""
    endpoint = s3_endpoint()
    key = (os.getpid(), endpoint, timeout)
    with _s3_lock:
        client = _s3_clients.get(key)
        if client is None:
            boto3 = _import_boto3(url)
            from botocore.config import Config

            config = Config(
                connect_timeout=timeout,
                read_timeout=timeout,
                retries={"total_max_attempts": 1, "mode": "standard"},
                max_pool_connections=32,
                # S3-compatible stores (MinIO, Ceph, moto) rarely resolve bucket subdomains.
                s3={"addressing_style": "path"} if endpoint else None,
            )
            client = _boto_session(boto3).client("s3", endpoint_url=endpoint, config=config)
            _s3_clients[key] = client
    return client


def _classify_boto(exc: BaseException) -> tuple[bool, str] | None:
    # Only look at botocore if something imported it: reading local files must not import boto3.
    be = sys.modules.get("botocore.exceptions")
    if be is None:
        return None
    upload_failed = getattr(sys.modules.get("boto3.exceptions"), "S3UploadFailedError", None)
    if upload_failed is not None and isinstance(exc, upload_failed):
        cause = exc.__cause__ or exc.__context__
        kind = _classify(getattr(cause, "url", ""), cause) if cause is not None else None
        return kind if kind is not None else (False, str(exc))
    if isinstance(exc, be.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "?"))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        message = err.get("Message") or ""
        reason = f"S3 {code}" + (f" (HTTP {status})" if status else "") + (f": {message}" if message else "")
        if code in _S3_PERMANENT:
            return False, reason
        transient = code in _S3_TRANSIENT or status >= 500 or status in (408, 429)
        return transient, reason
    if isinstance(exc, (be.ConnectionError, be.HTTPClientError, be.IncompleteReadError)):
        return True, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, be.NoCredentialsError):
        return False, f"no AWS credentials found ({exc})"
    if isinstance(exc, be.BotoCoreError):
        return False, f"{type(exc).__name__}: {exc}"
    urllib3 = sys.modules.get("urllib3.exceptions")
    if urllib3 is not None and isinstance(exc, urllib3.HTTPError):
        return True, f"{type(exc).__name__}: {exc}"
    return None


class _S3Body:
    def __init__(self, body, total: int | None, etag: str | None) -> None:
        self.body, self.total, self.etag = body, total, etag

    def readinto(self, b) -> int:
        # urllib3 reads until `amt` is filled; small reads bound what a reset can throw away.
        data = self.body.read(min(len(b), 64 * 1024))
        n = len(data)
        b[:n] = data
        _count("received_bytes", n)
        return n

    def close(self) -> None:
        self.body.close()


def _s3_open(url: str, start: int, end: int | None, timeout: float, etag: str | None) -> _S3Body | _EmptyBody:
    bucket, key = _split_s3(url)
    client = _s3_client(timeout, url)
    kwargs: dict[str, Any] = {}
    if start > 0 or end is not None:
        kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    if etag:  # a resumed read must see the same object version, or fail
        kwargs["IfMatch"] = etag
    try:
        resp = client.get_object(Bucket=bucket, Key=key, **kwargs)
    except Exception as exc:
        response = getattr(exc, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code != "InvalidRange":
            raise
        size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        if start >= size:
            return _EmptyBody(size, etag)
        raise
    content_range = resp.get("ContentRange")
    if content_range:
        first, total = _parse_content_range(url, content_range)
        if first != start:
            resp["Body"].close()
            raise _error(url, f"asked for bytes from {start}, S3 sent from {first}")
    else:
        total = resp.get("ContentLength")
        if start > 0:  # a store that ignored Range
            log.warning("%s: store ignored Range and sent the whole object; skipping %d bytes", url, start)
            body = _S3Body(resp["Body"], total, resp.get("ETag"))
            try:
                _discard(url, body, start)
            except BaseException:
                body.close()
                raise
            _count("skipped_bytes", start)
            return body
    return _S3Body(resp["Body"], total, resp.get("ETag"))


def _s3_exists(url: str, timeout: float) -> bool:
    bucket, key = _split_s3(url)
    try:
        _s3_client(timeout, url).head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        resp = getattr(exc, "response", None)
        if resp and (resp.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")):
            return False
        raise
    return True


# ----------------------------------------------------------------------------------------------
# local files and pipes as bodies


class _FileBody:
    def __init__(self, path: str, start: int) -> None:
        self.file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        try:
            self.total = os.fstat(self.file.fileno()).st_size
            self.file.seek(start)
        except BaseException:
            self.file.close()
            raise
        self.etag = None

    def readinto(self, b) -> int:
        return self.file.readinto(b)

    def close(self) -> None:
        self.file.close()


def _local_open(url: str, start: int) -> _FileBody:
    path = _local_path(url)
    try:
        return _FileBody(path, start)
    except FileNotFoundError:
        raise _error(url, "no such file", missing=True) from None
    except IsADirectoryError:
        raise _error(url, "is a directory") from None
    except OSError as exc:
        raise _error(url, f"cannot open: {exc.strerror or exc}") from exc


class _PipeBody:
    """stdout of ``sh -c CMD``; a non-zero exit status at the end of the output is an error."""

    def __init__(self, url: str, start: int) -> None:
        self.url = url
        self.proc = subprocess.Popen(url[len("pipe:") :], shell=True, stdout=subprocess.PIPE, bufsize=0)
        self.total = self.etag = None
        try:
            _discard(url, self, start)
        except BaseException:
            self.close()
            raise

    def readinto(self, b) -> int:
        n = self.proc.stdout.readinto(b)
        if not n and len(b):
            status = self.proc.wait()
            if status != 0:
                raise _error(self.url, f"command exited with status {status}")
        return n

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # an early close: the consumer does not want the rest
        self.proc.stdout.close()
        self.proc.wait()


# ----------------------------------------------------------------------------------------------
# The resumable stream


class _ResumableStream(io.RawIOBase):
    """Bytes ``[offset, offset+length)`` of one object, through any number of transient faults.

    ``opener(start, end, etag)`` answers one request with a body. When a body fails (an error, or
    an end before the known size), the body is dropped and a new one is opened at the current
    position: nothing is delivered twice and nothing is lost. The object's size and ETag from the
    first answer are checked against every later answer, so a resume never splices two versions.
    With ``expected_sha256`` (whole-object reads only) the digest is checked when the consumer
    reaches the end; reading less skips the check.
    """

    def __init__(
        self,
        url: str,
        opener: Callable[[int, int | None, str | None], Any],
        *,
        offset: int,
        length: int | None,
        policy: RetryPolicy,
        expected_size: int | None = None,
        expected_sha256: str | None = None,
    ) -> None:
        super().__init__()
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"{url}: negative offset or length ({offset}, {length})")
        self.name = url
        self._opener = opener
        self._policy = policy
        self._start = self._pos = offset
        # _limit is what the caller asked for and what requests name: an open range "bytes=N-"
        # unless a length was given. _end also learns the object's size from the first answer.
        self._limit = offset + length if length is not None else None
        self._end = self._limit
        self._expected_size = expected_size
        self._expected_sha256 = expected_sha256.lower() if expected_sha256 else None
        self._hasher = hashlib.sha256() if self._expected_sha256 and offset == 0 and length is None else None
        self._total: int | None = None
        self._etag: str | None = None
        self._body = None
        self._failures = 0
        self._resuming = False
        self._done = False
        self._error: StorageError | None = None
        if self._end is None or self._end > self._start:
            self._open()

    # io.RawIOBase
    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed stream")
        if self._error is not None:
            raise self._error
        view = memoryview(b).cast("B")
        if self._done or not len(view):
            return 0
        if self._end is not None:
            view = view[: max(0, self._end - self._pos)]
            if not len(view):
                self._finish()
                return 0
        while True:
            if self._body is None:
                self._open()
                if self._end is not None and self._pos >= self._end:
                    self._finish()
                    return 0
                view = view[: max(0, self._end - self._pos)] if self._end is not None else view
            try:
                n = self._body.readinto(view)
                if not n and self._end is not None and self._pos < self._end:
                    raise _error(
                        self.name, f"stream ended at byte {self._pos} of {self._end}", transient=True
                    )
            except Exception as exc:
                self._drop_body()
                self._failed(exc)
                continue
            break
        if n:
            self._pos += n
            self._failures = 0
            if self._hasher is not None:
                self._hasher.update(view[:n])
        else:
            self._finish()
        return n

    def close(self) -> None:
        if not self.closed:
            self._drop_body()
        super().close()

    # internals
    def _open(self) -> None:
        while True:
            _count("requests")
            try:
                body = self._opener(self._pos, self._limit, self._etag)
            except Exception as exc:
                self._failed(exc)
                continue
            try:
                self._accept(body)
            except BaseException:
                body.close()
                raise
            self._body = body
            if self._resuming:
                self._resuming = False
                if self._pos > self._start:
                    _count("resumed_bytes", self._pos - self._start)
            return

    def _accept(self, body) -> None:
        total = body.total
        if total is not None:
            if self._total is not None and total != self._total:
                raise _error(self.name, f"object size changed from {self._total} to {total} during the read")
            if self._expected_size is not None and total != self._expected_size:
                raise _error(self.name, f"object is {total} bytes, expected {self._expected_size}")
            self._total = total
            self._end = total if self._end is None else min(self._end, total)
        if body.etag:
            if self._etag and body.etag != self._etag:
                raise _error(self.name, f"object changed during the read (ETag {self._etag} -> {body.etag})")
            self._etag = body.etag

    def _failed(self, exc: Exception) -> None:
        """Back off and return if ``exc`` is worth another try; raise otherwise."""
        kind = _classify(self.name, exc)
        if kind is None:
            raise exc
        transient, reason = kind
        if not transient:
            if isinstance(exc, StorageError):
                raise exc
            raise _error(self.name, reason, missing=_is_missing(exc)) from exc
        self._failures += 1
        if self._failures >= self._policy.attempts:
            raise _error(
                self.name, f"giving up after {self._failures} attempts at byte {self._pos}: {reason}"
            ) from exc
        delay = self._policy.delay(self.name, self._failures - 1)
        log.warning(
            "%s: %s; retry %d/%d at byte %d in %.2fs",
            self.name, reason, self._failures, self._policy.attempts - 1, self._pos, delay,
        )
        _count("retries")
        self._resuming = True
        time.sleep(delay)

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:  # closing a broken connection may fail again; the data is safe
                log.debug("%s: error while closing a body", self.name, exc_info=True)

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        self._drop_body()
        whole = self._start == 0 and self._limit is None
        if whole and self._expected_size is not None and self._pos != self._expected_size:
            self._error = _error(self.name, f"object is {self._pos} bytes, expected {self._expected_size}")
        elif self._hasher is not None and self._hasher.hexdigest() != self._expected_sha256:
            digest = self._hasher.hexdigest()
            self._error = _error(self.name, f"sha256 {digest} does not match the expected {self._expected_sha256}")
        if self._error is not None:
            raise self._error  # and again on every later read: a bad object must not look complete


def _retrying(url: str, policy: RetryPolicy, op: Callable[[], Any]) -> Any:
    """Run a whole idempotent operation (HEAD, PUT, DELETE, upload) under the retry policy."""
    for attempt in range(1, policy.attempts + 1):
        _count("requests")
        try:
            return op()
        except Exception as exc:
            kind = _classify(url, exc)
            if kind is None:
                raise
            transient, reason = kind
            if not transient:
                if isinstance(exc, StorageError):
                    raise
                raise _error(url, reason, missing=_is_missing(exc)) from exc
            if attempt == policy.attempts:
                raise _error(url, f"giving up after {attempt} attempts: {reason}") from exc
            delay = policy.delay(url, attempt - 1)
            log.warning("%s: %s; retry %d/%d in %.2fs", url, reason, attempt, policy.attempts - 1, delay)
            _count("retries")
            time.sleep(delay)
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------
# Public reading API


def _opener_for(url: str, policy: RetryPolicy, allow_pipe: bool):
    scheme = _scheme(url)
    if scheme in ("http", "https"):
        return lambda start, end, etag: _http_open(url, start, end, policy.timeout)
    if scheme == "s3":
        _split_s3(url)
        return lambda start, end, etag: _s3_open(url, start, end, policy.timeout, etag)
    if scheme == "file":
        return lambda start, end, etag: _local_open(url, start)
    if scheme == "pipe":
        if not allow_pipe:
            raise _error(url, "pipe: URLs run a shell command and are only accepted from the user (allow_pipe=True)")
        return lambda start, end, etag: _PipeBody(url, start)
    raise _error(url, f"unsupported URL scheme {scheme!r} (use a path, file://, http(s)://, s3:// or pipe:)")


def open_stream(
    url: str,
    *,
    offset: int = 0,
    length: int | None = None,
    retry: RetryPolicy | None = None,
    allow_pipe: bool = False,
    cache: ShardCache | None = None,
    expected_sha256: str | None = None,
    expected_size: int | None = None,
) -> BinaryIO:
    """A readable binary stream of bytes ``[offset, offset+length)`` of ``url``.

    The stream never holds the whole object in memory; ``read(n)`` returns ``n`` bytes unless the
    end comes first. Remote streams retry transient faults and resume where they broke (see
    :class:`RetryPolicy`); permanent faults (404, 403, NoSuchKey, ...) raise :class:`StorageError`
    at once, already here when the first answer is one. ``pipe:CMD`` runs only with
    ``allow_pipe=True`` and is never retried. With ``cache``, remote objects are served from a
    verified local copy (:class:`ShardCache`). ``expected_size`` is checked against the object's
    size as soon as it is known; ``expected_sha256`` when a whole-object read reaches its end.
    """
    policy = retry or DEFAULT_RETRY
    scheme = _scheme(url)
    if cache is not None and scheme in _REMOTE_SCHEMES:
        return cache.open(
            url, offset=offset, length=length, expected_sha256=expected_sha256,
            expected_size=expected_size, retry=policy,
        )
    if scheme == "file" and length is None and expected_sha256 is None:
        # The plain file object is fastest, and resumable-stream features are not needed locally.
        path = _local_path(url)
        try:
            f = open(path, "rb")  # noqa: SIM115 - the caller closes it
        except FileNotFoundError:
            raise _error(url, "no such file", missing=True) from None
        except IsADirectoryError:
            raise _error(url, "is a directory") from None
        except OSError as exc:
            raise _error(url, f"cannot open: {exc.strerror or exc}") from exc
        try:
            if expected_size is not None:
                size = os.fstat(f.fileno()).st_size
                if size != expected_size:
                    raise _error(url, f"file is {size} bytes, expected {expected_size}")
            f.seek(offset)
        except BaseException:
            f.close()
            raise
        return f
    opener = _opener_for(url, policy, allow_pipe)
    if scheme == "pipe":
        policy = RetryPolicy(attempts=1, timeout=policy.timeout)
    raw = _ResumableStream(
        url, opener, offset=offset, length=length, policy=policy,
        expected_size=expected_size, expected_sha256=expected_sha256,
    )
    return io.BufferedReader(raw, buffer_size=STREAM_BUFFER)


def read_bytes(url: str, *, retry: RetryPolicy | None = None, allow_pipe: bool = False) -> bytes:
    """The whole content of a small object (an index, a lengths file)."""
    with open_stream(url, retry=retry, allow_pipe=allow_pipe) as f:
        return f.read()


def exists(url: str, *, retry: RetryPolicy | None = None) -> bool:
    """Whether the object exists. Transient faults are retried; a 403 raises rather than
    answering False, because "no permission" is not "absent"."""
    policy = retry or DEFAULT_RETRY
    scheme = _scheme(url)
    if scheme == "file":
        return os.path.exists(_local_path(url))
    if scheme in ("http", "https"):
        return _retrying(url, policy, lambda: _http_exists(url, policy.timeout))
    if scheme == "s3":
        return _retrying(url, policy, lambda: _s3_exists(url, policy.timeout))
    if scheme == "pipe":
        raise _error(url, "cannot tell whether a pipe: URL exists")
    raise _error(url, f"unsupported URL scheme {scheme!r}")


# ----------------------------------------------------------------------------------------------
# Shard cache


def _lock(path: str, mode: int) -> int:
    """An fd holding ``flock(mode)`` on ``path``; retried when the file was replaced meanwhile
    (the evictor unlinks lock files of entries it removes)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            st = os.fstat(fd)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            if current is not None and (current.st_ino, current.st_dev) == (st.st_ino, st.st_dev):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _try_lock(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    try:
        current = os.stat(path)
    except FileNotFoundError:
        current = None
    st = os.fstat(fd)
    if current is None or (current.st_ino, current.st_dev) != (st.st_ino, st.st_dev):
        os.close(fd)  # another evictor removed this entry meanwhile
        return None
    return fd


def _safe_basename(url: str) -> str:
    base = url.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)[:80] or "object"


class _CachedFile(io.RawIOBase):
    """A cache entry opened for reading; holds the entry's shared lock until closed."""

    def __init__(self, url: str, file: io.FileIO, lock_fd: int, offset: int, length: int | None) -> None:
        super().__init__()
        self.name = url
        self._file = file
        self._lock_fd: int | None = lock_fd
        size = os.fstat(file.fileno()).st_size
        self._end = size if length is None else min(size, offset + length)
        self._pos = offset
        file.seek(offset)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")[: max(0, self._end - self._pos)]
        n = self._file.readinto(view) if len(view) else 0
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._file.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the shared lock
                self._lock_fd = None
        super().close()


class ShardCache:
    """A size-bounded local copy of remote shards, shared by the processes of one host.

    An entry exists only after a complete download that matched ``expected_sha256`` (else
    ``expected_size``, else the object's own length): the download goes to a ``.part`` file and
    is renamed into place when verified. Entries are keyed by URL and expected sha256, so a
    dataset rewritten in place with a new index is never served stale bytes.

    Each entry has a lock file. Readers hold it shared while they read, so any number of workers
    read one entry at once. A reader that finds the entry missing takes the lock exclusively and
    downloads; others wait for that lock and then read the finished file. Eviction removes
    least-recently-used entries (mtime, touched on every hit) until the total is under
    ``max_bytes``, skipping any entry it cannot lock exclusively, that is any being read. An
    entry larger than ``max_bytes`` is still served; the cache is over its limit until that entry
    is closed and a later open evicts it.
    """

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = os.path.abspath(directory)
        self.max_bytes = int(max_bytes)
        os.makedirs(self.directory, exist_ok=True)

    def _paths(self, url: str, expected_sha256: str | None) -> tuple[str, str, str]:
        key = hashlib.sha256(f"{url}\n{(expected_sha256 or '').lower()}".encode()).hexdigest()[:32]
        d = self.directory
        return (
            os.path.join(d, f"{key}-{_safe_basename(url)}"),
            os.path.join(d, f"{key}.lock"),
            # Unique per downloader: even a broken lock could not make two writers share a file.
            os.path.join(d, f"{key}.part.{os.getpid()}.{threading.get_ident()}"),
        )

    def path_for(self, url: str, expected_sha256: str | None = None) -> str:
        """Where the verified copy of ``url`` lives (it may not exist)."""
        return self._paths(url, expected_sha256)[0]

    def open(
        self,
        url: str,
        *,
        offset: int = 0,
        length: int | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> BinaryIO:
        """A stream of the verified local copy of ``url``, downloading it first when missing."""
        data, lock, part = self._paths(url, expected_sha256)
        fd = _lock(lock, fcntl.LOCK_SH)
        try:
            file = self._open_entry(url, data, expected_size, repair=False)
            if file is None:
                os.close(fd)
                fd = -1
                fd = _lock(lock, fcntl.LOCK_EX)
                file = self._open_entry(url, data, expected_size, repair=True)  # downloaded meanwhile?
                if file is None:
                    _count("cache_misses")
                    self.evict(reserve=expected_size or 0)
                    self._download(url, data, part, expected_sha256, expected_size, retry)
                    file = open(data, "rb", buffering=0)  # noqa: SIM115 - owned by _CachedFile
                    self._touch(data)
                else:
                    _count("cache_hits")
                # The file is open before the lock is downgraded, so even an eviction that slips
                # into the downgrade cannot take the bytes away from this reader.
                fcntl.flock(fd, fcntl.LOCK_SH)
            else:
                _count("cache_hits")
            # Also on hits: entries that were in use at the last eviction may be free now.
            self.evict()
            raw = _CachedFile(url, file, fd, offset, length)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return io.BufferedReader(raw, buffer_size=STREAM_BUFFER)

    @staticmethod
    def _touch(path: str) -> None:
        now = time.time_ns()  # explicit: file timestamps from the kernel clock are too coarse for LRU
        os.utime(path, ns=(now, now))

    def _open_entry(self, url: str, data: str, expected_size: int | None, repair: bool) -> io.FileIO | None:
        """The entry's file, or None when missing or of the wrong size (removed if ``repair``,
        which the caller may only ask while holding the entry's lock exclusively)."""
        try:
            file = open(data, "rb", buffering=0)  # noqa: SIM115
        except FileNotFoundError:
            return None
        size = os.fstat(file.fileno()).st_size
        if expected_size is not None and size != expected_size:
            file.close()
            if repair:
                log.warning("%s: cached copy is %d bytes, expected %d; downloading again", url, size, expected_size)
                os.unlink(data)
            return None
        self._touch(data)
        return file

    def _download(
        self, url: str, data: str, part: str, sha: str | None, size: int | None, retry: RetryPolicy | None
    ) -> None:
        hasher = hashlib.sha256()
        got = 0
        try:
            with open_stream(url, retry=retry, expected_size=size) as src, open(part, "wb") as out:
                buf = bytearray(CHUNK_SIZE)
                while n := src.readinto(buf):
                    chunk = memoryview(buf)[:n]
                    out.write(chunk)
                    hasher.update(chunk)
                    got += n
                out.flush()
                os.fsync(out.fileno())
            if sha and hasher.hexdigest() != sha.lower():
                raise _error(url, f"sha256 {hasher.hexdigest()} does not match the expected {sha.lower()}; not cached")
            if size is not None and got != size:
                raise _error(url, f"downloaded {got} bytes, expected {size}; not cached")
            os.replace(part, data)
        except BaseException:
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass
            raise
        log.debug("%s: cached %d bytes", url, got)

    def entries(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime_ns) of the complete entries, least recently used first."""
        out = []
        for entry in os.scandir(self.directory):
            if len(entry.name) > 33 and entry.name[32] == "-":
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((entry.path, st.st_size, st.st_mtime_ns))
        out.sort(key=lambda e: (e[2], e[0]))
        return out

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, reserve: int = 0) -> None:
        """Remove LRU entries nobody reads until the total plus ``reserve`` fits ``max_bytes``;
        also remove ``.part`` files left by downloads that died."""
        for entry in os.scandir(self.directory):
            if entry.name[32:38] == ".part.":
                lock = os.path.join(self.directory, entry.name[:32] + ".lock")
                fd = _try_lock(lock)
                if fd is None and os.path.exists(lock):
                    continue  # its download is running
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
                finally:
                    if fd is not None:
                        os.close(fd)
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if total + reserve <= self.max_bytes:
                break
            lock = os.path.join(self.directory, os.path.basename(path)[:32] + ".lock")
            fd = _try_lock(lock)
            if fd is None:
                continue  # being read or downloaded right now
            try:
                os.unlink(path)
                total -= size
                os.unlink(lock)
                log.debug("evicted %s (%d bytes)", path, size)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)


# ----------------------------------------------------------------------------------------------
# Read-ahead and prefetch


_EOF = object()


class ReadAhead(io.RawIOBase):
    """A stream read ahead by a background thread into a bounded queue of chunks.

    ``opener()`` runs in the thread, so opening (and a cache download) overlaps with whatever the
    consumer does meanwhile. At most ``max_chunks`` chunks of ``chunk_size`` bytes wait in memory.
    Errors, opening errors included, are raised by the consumer's next read. Closing stops the
    thread at its next chunk boundary and closes the source.
    """

    def __init__(
        self, opener: Callable[[], BinaryIO], *, name: str = "", chunk_size: int = CHUNK_SIZE, max_chunks: int = 4
    ) -> None:
        super().__init__()
        self.name = name
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_chunks))
        self._stop = threading.Event()
        self._chunk: memoryview = memoryview(b"")
        self._eof = False
        self._error: BaseException | None = None
        self._pos = 0
        # The thread gets the queue and the event, not self: a consumer that drops the stream
        # without closing it lets it be collected, and __del__ -> close() stops the thread.
        self._thread = threading.Thread(
            target=ReadAhead._run,
            args=(opener, chunk_size, self._queue, self._stop),
            name=f"readahead {name}",
            daemon=True,
        )
        self._thread.start()

    @staticmethod
    def _put(q: queue.Queue, stop: threading.Event, item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    @staticmethod
    def _run(opener: Callable[[], BinaryIO], chunk_size: int, q: queue.Queue, stop: threading.Event) -> None:
        try:
            src = opener()
        except BaseException as exc:  # handed to the consumer, who decides
            ReadAhead._put(q, stop, exc)
            return
        # readinto1 hands over what each read got: bytes that arrived before an error reach the
        # consumer ahead of the error (read(n) would drop them with it, and with on_error="skip"
        # that is documents lost that were already downloaded).
        fill = getattr(src, "readinto1", None) or src.readinto
        try:
            while not stop.is_set():
                buf = bytearray(chunk_size)
                view = memoryview(buf)
                got, error = 0, None
                try:
                    while got < chunk_size:
                        n = fill(view[got:])
                        if not n:
                            break
                        got += n
                except BaseException as exc:
                    error = exc
                if got and not ReadAhead._put(q, stop, view[:got]):
                    return
                if error is not None:
                    ReadAhead._put(q, stop, error)
                    return
                if got < chunk_size:
                    ReadAhead._put(q, stop, _EOF)
                    return
        finally:
            try:
                src.close()
            except Exception:  # the consumer already has every byte, or the error that matters
                log.debug("error while closing a read-ahead source", exc_info=True)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed stream")
        if not len(self._chunk):
            if self._error is not None:
                raise self._error  # again: reading on after an error must not look like an end
            if self._eof:
                return 0
            item = self._queue.get()
            if item is _EOF:
                self._eof = True
                return 0
            if isinstance(item, BaseException):
                self._error = item
                raise item
            self._chunk = memoryview(item)
        view = memoryview(b).cast("B")
        n = min(len(view), len(self._chunk))
        view[:n] = self._chunk[:n]
        self._chunk = self._chunk[n:]
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._stop.set()
            while True:  # unblock a thread waiting to put
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._chunk = memoryview(b"")
        super().close()


StreamSpec = Union[str, "tuple[str, dict[str, Any]]"]


def prefetch_iter(
    urls_and_kwargs: Iterable[StreamSpec], depth: int = 1, *, chunk_size: int = CHUNK_SIZE, max_chunks: int = 4
) -> Iterator[BinaryIO]:
    """Streams of the given objects in order, each remote one started ``depth`` shards early.

    Items are URLs or ``(url, open_stream keyword arguments)``. Remote objects are read through
    :class:`ReadAhead`, so while the consumer reads one shard the next ``depth`` are being opened
    (downloaded into the cache, when one is given) and read ahead by at most
    ``max_chunks * chunk_size`` bytes each. Local files and pipes open at once and need no thread.
    A yielded stream belongs to the consumer until it asks for the next one; then it is closed.
    Stopping the iteration early closes every stream it started.
    """

    def start(item: StreamSpec) -> BinaryIO:
        url, kwargs = (item, {}) if isinstance(item, str) else item
        if not is_remote(url) or depth <= 0:
            return open_stream(url, **kwargs)
        ahead = ReadAhead(
            lambda: open_stream(url, **kwargs), name=url, chunk_size=chunk_size, max_chunks=max_chunks
        )
        return io.BufferedReader(ahead, buffer_size=STREAM_BUFFER)

    items = iter(urls_and_kwargs)
    pending: collections.deque[BinaryIO] = collections.deque()
    current: BinaryIO | None = None

    def fill(n: int) -> None:
        while len(pending) < n:
            item = next(items, _EOF)
            if item is _EOF:
                return
            pending.append(start(item))

    try:
        while True:
            fill(max(depth, 0) + 1)  # the one to yield now, and `depth` started behind it
            if not pending:
                return
            current = pending.popleft()
            yield current
            current.close()
            current = None
    finally:
        if current is not None:
            current.close()
        for stream in pending:
            stream.close()


# ----------------------------------------------------------------------------------------------
# Output


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Output:
    """A dataset directory being written: a local directory or ``s3://bucket/prefix/``.

    The packer relies on the atomicity contract: a name appears only when its content is complete
    (local: temp file, fsync, rename; s3: an object becomes visible only when its upload
    completes), so putting ``index.json`` last means an interrupted job never leaves an index that
    points at missing shards. ``Output(url)`` returns the subclass for the URL's scheme.
    """

    url: str

    def __new__(cls, url: str, **kwargs: Any) -> Output:
        if cls is Output:
            scheme = _scheme(url)
            if scheme == "s3":
                cls = _S3Output
            elif scheme == "file":
                cls = _LocalOutput
            else:
                raise _error(url, "datasets can only be written to a local directory or s3://bucket/prefix/")
        return super().__new__(cls)

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.url = url

    def __enter__(self) -> Output:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def url_of(self, name: str) -> str:
        return join_url(self.url, name)

    def is_empty(self) -> bool:
        raise NotImplementedError

    def list_names(self) -> list[str]:
        raise NotImplementedError

    def put_file(self, local_path: str, name: str) -> None:
        raise NotImplementedError

    def put_bytes(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def get_bytes(self, name: str) -> bytes | None:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def local_staging_dir(self) -> str:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release local resources (the staging directory of remote outputs)."""


class _LocalOutput(Output):
    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url)
        self.path = os.path.abspath(_local_path(url))

    def _target(self, name: str) -> str:
        return os.path.join(self.path, *_check_name(name).split("/"))

    def is_empty(self) -> bool:
        try:
            with os.scandir(self.path) as it:
                return next(it, None) is None
        except FileNotFoundError:
            return True

    def list_names(self) -> list[str]:
        names = []
        for root, _, files in os.walk(self.path):
            rel = os.path.relpath(root, self.path)
            for f in files:
                names.append(f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}")
        return sorted(names)

    def put_file(self, local_path: str, name: str) -> None:
        target = self._target(name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(local_path, "rb") as f:  # the rename must not outlive the data in a crash
            os.fsync(f.fileno())
        try:
            os.replace(local_path, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise _error(target, f"cannot move {local_path} into place: {exc.strerror}") from exc
            tmp = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
            shutil.copyfile(local_path, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
            os.unlink(local_path)

    def put_bytes(self, name: str, data: bytes) -> None:
        target = self._target(name)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(directory)

    def get_bytes(self, name: str) -> bytes | None:
        try:
            with open(self._target(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._target(name))
        except FileNotFoundError:
            pass

    def local_staging_dir(self) -> str:
        os.makedirs(self.path, exist_ok=True)
        return self.path

    def clear(self) -> None:
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


class _S3Output(Output):
    def __init__(
        self, url: str, *, retry: RetryPolicy | None = None, multipart_threshold: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(url)
        self.bucket, prefix = _split_s3(url)
        self.prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        self.retry = retry or DEFAULT_RETRY
        self.multipart_threshold = multipart_threshold or MULTIPART_THRESHOLD
        self._staging: str | None = None

    def _key(self, name: str) -> str:
        return self.prefix + _check_name(name)

    def _client(self):
        return _s3_client(self.retry.timeout, self.url)

    def _keys(self, limit: int | None = None) -> list[str]:
        def op() -> list[str]:
            keys: list[str] = []
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix}
            if limit:
                kwargs["MaxKeys"] = limit
            while True:
                resp = self._client().list_objects_v2(**kwargs)
                keys.extend(o["Key"] for o in resp.get("Contents", []))
                if (limit and len(keys) >= limit) or not resp.get("IsTruncated"):
                    return keys
                kwargs["ContinuationToken"] = resp["NextContinuationToken"]

        return _retrying(self.url, self.retry, op)

    def is_empty(self) -> bool:
        return not self._keys(limit=1)

    def list_names(self) -> list[str]:
        return sorted(k[len(self.prefix) :] for k in self._keys())

    def put_file(self, local_path: str, name: str) -> None:
        from boto3.s3.transfer import TransferConfig

        key = self._key(name)
        config = TransferConfig(
            multipart_threshold=self.multipart_threshold,
            # S3 parts are at least 5 MiB; 16 MiB parts upload in parallel without many requests.
            multipart_chunksize=max(5 * 2**20, min(self.multipart_threshold, 16 * 2**20)),
            max_concurrency=4,
        )
        _retrying(
            self.url_of(name), self.retry,
            lambda: self._client().upload_file(local_path, self.bucket, key, Config=config),
        )
        os.unlink(local_path)

    def put_bytes(self, name: str, data: bytes) -> None:
        key = self._key(name)
        _retrying(
            self.url_of(name), self.retry,
            lambda: self._client().put_object(Bucket=self.bucket, Key=key, Body=data),
        )

    def get_bytes(self, name: str) -> bytes | None:
        url = self.url_of(name)
        try:
            return read_bytes(url, retry=self.retry)
        except NotFoundError:
            return None

    def delete(self, name: str) -> None:
        key = self._key(name)
        _retrying(self.url_of(name), self.retry, lambda: self._client().delete_object(Bucket=self.bucket, Key=key))

    def local_staging_dir(self) -> str:
        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix="wdsllm-stage-")
        return self._staging

    def clear(self) -> None:
        keys = self._keys()
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}

            def op(batch: dict = batch) -> None:
                resp = self._client().delete_objects(Bucket=self.bucket, Delete=batch)
                if resp.get("Errors"):
                    first = resp["Errors"][0]
                    raise _error(self.url, f"cannot delete {first.get('Key')}: S3 {first.get('Code')}")

            _retrying(self.url, self.retry, op)

    def close(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


# ----------------------------------------------------------------------------------------------
# fork safety


def _after_fork_in_child() -> None:
    """Sockets, clients and locks of the parent are not ours to use: start empty."""
    global _http_lock, _s3_lock, _stats_lock
    _http_lock = threading.Lock()
    _s3_lock = threading.Lock()
    _stats_lock = threading.Lock()
    _http_pool.clear()
    _s3_clients.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
