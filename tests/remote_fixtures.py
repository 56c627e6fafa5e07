"""Real HTTP and S3 servers on 127.0.0.1 for tests, with faults injected on demand.

``tests/conftest.py`` star-imports this module, so every test file can use the fixtures:

``http_server`` (:class:`HttpServer`, fresh state per test, one server per session)
    Serves ``http_server.root`` (the test's ``tmp_path / "www"`` unless a test assigns another
    directory) with Range (``bytes=N-``, ``bytes=N-M``, ``bytes=-S``), HEAD, ETag and keep-alive.
    ``http_server.url_for("ds/index.json")`` gives the URL of a file under the root. Faults::

        http_server.faults.add("*/shard-000001.tar", "drop_after", bytes=5000, times=3)
        http_server.faults.add("*.tar", "status", status=503, times=2)
        http_server.faults.add("*/index.json", "stall", bytes=0, seconds=3)
        http_server.faults.add("*/shard-000002.tar", "status_permanent", status=404)

    and the log of what clients asked for::

        http_server.ranges("*/shard-000001.tar")   # [None, 'bytes=5000-', 'bytes=10000-', ...]
        http_server.count("*/shard-000001.tar")    # GET requests to that path
        http_server.log("*.tar")                   # RecordedRequest(method, path, range, status, ...)

    Fault kinds and their parameters are listed in ``FAULT_KINDS``; ``times`` (default 1) says how
    many matching requests a fault affects, ``times=None`` all of them.

``s3_server`` (:class:`S3Server`, session scope) and ``s3_bucket`` (a fresh ``s3://bucket`` per test)
    A moto server. Starting it sets ``AWS_ENDPOINT_URL`` and test credentials in ``os.environ``
    for the rest of the session, so subprocesses (DataLoader workers, torchrun) reach it too.
    ``s3_server.upload_dir(local_dir, "s3://bucket/prefix/")`` copies a dataset there.
"""

from __future__ import annotations

import fnmatch
import io
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

__all__ = [
    "Fault",
    "Faults",
    "HttpServer",
    "RecordedRequest",
    "S3Server",
    "http_server",
    "http_server_session",
    "s3_bucket",
    "s3_server",
]

# ----------------------------------------------------------------------------------------------
# HTTP


FAULT_KINDS = {
    # kind: (parameters with defaults, methods it applies to)
    "drop_after": ({"bytes": 0, "reset": False}, ("GET",)),  # K body bytes, then FIN (or RST)
    "stall": ({"bytes": 0, "seconds": 5.0}, ("GET",)),  # K body bytes, then silence, then close
    "status": ({"status": 503}, ("GET", "HEAD")),  # answer `status` instead of the file
    "status_permanent": ({"status": 404}, ("GET", "HEAD")),  # same, forever unless `times` is given
    "corrupt": (
        {"at": 0, "length": 1, "whole": False},
        ("GET",),
    ),  # flip `length` bytes at object offset `at` if served
    # wrong bytes of the right length at object offset `at` (Content-Length and Range stay honest):
    "truncate": (
        {"at": 0, "length": 1, "whole": False},
        ("GET",),
    ),  # zeros in place of the bytes from `at` on (a cut copy)
    "reorder": ({"at": 0, "length": 1, "whole": False}, ("GET",)),  # `length` bytes at `at` sent reversed
    "repeat": (
        {"at": 0, "length": 1, "whole": False},
        ("GET",),
    ),  # the `length` bytes before `at` sent again in place of those at `at`
    "ignore_range": ({}, ("GET",)),  # answer 200 with the whole object even when Range was asked
    "delay": ({"seconds": 0.5}, ("GET", "HEAD")),  # wait before answering, then answer normally
    "close_after": ({}, ("GET",)),  # answer normally, then close the kept-alive connection unannounced
    "rate": ({"bytes_per_s": 1e6}, ("GET",)),  # the body sent no faster than this (a far or throttled store)
}


@dataclass
class Fault:
    """One injected fault. ``times`` requests are affected (None: all), counted in ``hits``."""

    pattern: str
    kind: str
    times: int | None
    params: dict[str, Any]
    hits: int = 0

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["params"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.hits >= self.times


class Faults:
    """Faults of an :class:`HttpServer`, matched in the order they were added.

    ``pattern`` is an fnmatch glob on the request path (``"*/shard-000003.tar"``, ``"*"``). A
    request gets at most one fault: the first one that matches and is not exhausted.
    """

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    def add(self, pattern: str, kind: str, *, times: Any = ..., **params: Any) -> Fault:
        """Add a fault; ``times`` defaults to 1, or to None (every request) for ``status_permanent``."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {sorted(FAULT_KINDS)}")
        defaults, _ = FAULT_KINDS[kind]
        unknown = set(params) - set(defaults)
        if unknown:
            raise ValueError(f"fault {kind!r} takes {sorted(defaults)}, not {sorted(unknown)}")
        if times is ...:
            times = None if kind == "status_permanent" else 1
        fault = Fault(pattern, kind, times, {**defaults, **params})
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def take(self, path: str, method: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.exhausted or method not in FAULT_KINDS[fault.kind][1]:
                    continue
                if fnmatch.fnmatchcase(path, fault.pattern):
                    fault.hits += 1
                    return fault
        return None

    def __iter__(self) -> Iterator[Fault]:
        with self._lock:
            return iter(list(self._faults))


@dataclass
class RecordedRequest:
    method: str
    path: str
    range: str | None
    status: int | None = None
    query: str = ""
    authorization: str | None = None
    fault: str | None = None
    client_port: int = 0  # the same port on two requests means a reused keep-alive connection
    time: float = field(default_factory=time.monotonic)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def _simple(self, rec: RecordedRequest, status: int, headers: dict[str, str] | None = None) -> None:
        body = f"{status} {self.responses.get(status, ('',))[0]}\n".encode()
        rec.status = status
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _abort(self, reset: bool) -> None:
        """Close the connection mid-body: FIN (the client sees an early end) or RST."""
        self.close_connection = True
        try:
            self.wfile.flush()
            if reset:
                time.sleep(0.05)  # let the client take the bytes first: an RST discards unread data
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.rfile.close()
                self.wfile.close()
                self.connection.close()  # the last reference: the kernel sends RST
                self.rfile, self.wfile = io.BytesIO(), io.BytesIO()  # for the handler's own cleanup
            else:
                self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _serve(self, send_body: bool) -> None:
        state = self.server.state
        parts = urlsplit(self.path)
        path = parts.path
        rng = self.headers.get("Range")
        auth = self.headers.get("Authorization")
        rec = RecordedRequest(
            self.command, path, rng, client_port=self.client_address[1], query=parts.query, authorization=auth
        )
        fault = state.faults.take(path, self.command)
        rec.fault = fault.kind if fault else None
        state.record(rec)
        if state.basic_auth is not None and auth != state.basic_auth:
            self._simple(rec, 401, {"WWW-Authenticate": 'Basic realm="wdsllm"'})
            return
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.seconds)
            fault = None
        if fault is not None and fault.kind in ("status", "status_permanent"):
            self._simple(rec, fault.status)
            return
        file = state.resolve(path)
        if file is None:
            self._simple(rec, 404)
            return
        size = file.stat().st_size
        st = file.stat()
        etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
        start, end = 0, size  # end exclusive
        status = 200
        whole = fault is not None and (fault.kind == "ignore_range" or (fault.kind in LIES and fault.whole))
        if rng and not whole:  # `whole`: a 200 with the full body although Range was asked
            parsed = _parse_range(rng, size)
            if parsed is None:
                self._simple(rec, 416, {"Content-Range": f"bytes */{size}"})
                return
            start, end = parsed
            status = 206
        rec.status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not send_body:
            return
        limit = end - start
        if fault is not None and fault.kind in ("drop_after", "stall"):
            limit = min(limit, fault.bytes)
        with open(file, "rb") as f:
            if fault is None:  # as a real server does: the kernel sends the file, no copy here
                try:
                    self.wfile.flush()
                    self.connection.sendfile(f, offset=start, count=limit)
                except OSError:  # the client went away
                    self.close_connection = True
                return
            content = _lie(f.read(), fault) if fault.kind in LIES else None
            f.seek(start)
            sent = 0
            while sent < limit:
                if content is not None:
                    chunk = content[start + sent : start + min(limit, sent + 65536)]
                else:
                    chunk = f.read(min(65536, limit - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except OSError:  # the client went away
                    self.close_connection = True
                    return
                sent += len(chunk)
                if fault.kind == "rate":
                    time.sleep(len(chunk) / fault.bytes_per_s)
        if fault is not None and fault.kind == "close_after":
            self._abort(reset=False)
        elif fault is not None and fault.kind == "drop_after" and limit < end - start:
            self._abort(reset=fault.reset)
        elif fault is not None and fault.kind == "stall" and limit < end - start:
            self.wfile.flush()
            deadline = time.monotonic() + fault.seconds
            while time.monotonic() < deadline and not state.stopping.is_set():
                time.sleep(0.02)
            self._abort(reset=False)


LIES = ("corrupt", "truncate", "reorder", "repeat")


def _lie(data: bytes, fault: Fault) -> bytes:
    """The object as a lying server sends it: same length, wrong bytes at ``fault.at``."""
    at, n = fault.at, fault.length
    if at >= len(data):
        return data
    out = bytearray(data)
    end = min(len(out), at + n)
    if fault.kind == "corrupt":
        out[at:end] = bytes(b ^ 0xFF for b in out[at:end])
    elif fault.kind == "truncate":
        out[at:] = bytes(len(out) - at)
    elif fault.kind == "reorder":
        out[at:end] = out[at:end][::-1]
    elif fault.kind == "repeat":
        back = max(0, at - n)
        out[at:end] = data[back : back + (end - at)]
    return bytes(out)


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
    """[start, end) of a single-range header, or None when it cannot be satisfied."""
    unit, _, spec = value.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    if first == "":
        n = int(last)
        return (max(0, size - n), size) if n > 0 and size > 0 else None
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    if start >= size or end <= start:
        return None
    return start, end


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # socketserver's backlog of 5 drops the SYNs of 8+ concurrent ranged GETs (a 1 s retransmit each)
    request_queue_size = 128
    state: HttpServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet where a client hung up mid-answer (a reader's early close, a fault the test made)."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class HttpServer:
    """A threaded HTTP server on 127.0.0.1 serving ``root``, with :class:`Faults` and a request log."""

    def __init__(self) -> None:
        self.faults = Faults()
        self.requests: list[RecordedRequest] = []
        self.basic_auth: str | None = None  # "Basic ..." that every request must carry, when set
        self.root: Path = Path.cwd()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="http-fixture", daemon=True
        )
        self._thread.start()

    # what tests call
    def url_for(self, relpath: str | os.PathLike = "") -> str:
        """URL of ``relpath`` under ``root`` (a path relative to it, or an absolute path inside it)."""
        p = Path(relpath)
        if p.is_absolute():
            p = p.relative_to(self.root)
        rel = p.as_posix()
        return f"{self.url}/" + ("" if rel == "." else rel)

    def require_basic_auth(self, user: str, password: str) -> None:
        """Answer 401 to every request without this user and password (until :meth:`reset`)."""
        import base64

        self.basic_auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def reset(self) -> None:
        """Forget faults, recorded requests and the password."""
        self.basic_auth = None
        self.faults.clear()
        with self._lock:
            self.requests.clear()

    def log(self, pattern: str = "*", method: str | None = "GET") -> list[RecordedRequest]:
        with self._lock:
            return [
                r
                for r in self.requests
                if fnmatch.fnmatchcase(r.path, pattern) and (method is None or r.method == method)
            ]

    def count(self, pattern: str = "*", method: str | None = "GET") -> int:
        return len(self.log(pattern, method))

    def ranges(self, pattern: str = "*") -> list[str | None]:
        """Range headers of the GET requests to matching paths, in order (None: no Range)."""
        return [r.range for r in self.log(pattern)]

    # what the handler calls
    def record(self, rec: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(rec)

    def resolve(self, path: str) -> Path | None:
        root = Path(self.root).resolve()
        target = (root / unquote(path).lstrip("/")).resolve()
        if target != root and root not in target.parents:
            return None
        return target if target.is_file() else None

    def close(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="session")
def http_server_session() -> Iterator[HttpServer]:
    """The one HTTP server of the session; tests want ``http_server``, which resets it."""
    server = HttpServer()
    yield server
    server.close()


@pytest.fixture
def http_server(http_server_session: HttpServer, tmp_path: Path) -> Iterator[HttpServer]:
    """The session's HTTP server, reset, serving ``tmp_path / "www"`` (created, empty)."""
    server = http_server_session
    server.reset()
    server.root = tmp_path / "www"
    server.root.mkdir(exist_ok=True)
    yield server
    server.reset()


# ----------------------------------------------------------------------------------------------
# S3


_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probing if a test drops the keys
}
_S3_ENV_REMOVED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")


class S3Server:
    """A moto S3 server on 127.0.0.1; ``endpoint`` is also in ``os.environ['AWS_ENDPOINT_URL']``."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a log line per request otherwise
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._saved: dict[str, str | None] = {}

    def install_env(self) -> None:
        """Point every AWS client of this process and its children at this server."""
        names = [*_S3_ENV, "AWS_ENDPOINT_URL", *_S3_ENV_REMOVED, "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"]
        self._saved = {k: os.environ.get(k) for k in names}
        os.environ.update(_S3_ENV)
        os.environ["AWS_ENDPOINT_URL"] = self.endpoint
        os.environ["AWS_CONFIG_FILE"] = os.devnull  # a developer's ~/.aws must not leak in
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
        for k in _S3_ENV_REMOVED:
            os.environ.pop(k, None)

    def restore_env(self) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client("s3", endpoint_url=self.endpoint)

    def new_bucket(self, prefix: str = "wdsllm-test", public: bool = False) -> str:
        """Create a bucket with a unique name and return that name; ``public``: anyone may read
        and list it (moto enforces bucket policies for unsigned requests)."""
        import json

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        client = self.client()
        client.create_bucket(Bucket=name)
        if public:
            policy = {
                "Version": "2012-10-17",
                "Statement": [
                    {
                        "Effect": "Allow",
                        "Principal": "*",
                        "Action": ["s3:GetObject", "s3:ListBucket"],
                        "Resource": [f"arn:aws:s3:::{name}", f"arn:aws:s3:::{name}/*"],
                    }
                ],
            }
            client.put_bucket_policy(Bucket=name, Policy=json.dumps(policy))
        return name

    def upload_dir(self, local_dir: str | os.PathLike, url: str) -> list[str]:
        """Copy every file under ``local_dir`` to ``s3://bucket/prefix/``; returns the keys."""
        bucket, _, prefix = url[len("s3://") :].partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        client = self.client()
        keys = []
        root = Path(local_dir)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = prefix + path.relative_to(root).as_posix()
            client.upload_file(str(path), bucket, key)
            keys.append(key)
        return keys

    def get(self, url: str) -> bytes:
        bucket, _, key = url[len("s3://") :].partition("/")
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def close(self) -> None:
        self._moto.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server for the session, with ``AWS_ENDPOINT_URL`` and test credentials set."""
    server = S3Server()
    server.install_env()
    yield server
    server.restore_env()
    server.close()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket as ``s3://name`` (no trailing slash)."""
    return f"s3://{s3_server.new_bucket()}"
