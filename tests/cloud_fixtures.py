"""Real object-store servers on 127.0.0.1 for tests: GCS (gcp-storage-emulator),
Azure (Azurite), a fake Hugging Face Hub, and a fault-injecting reverse / forward proxy.

``tests/conftest.py`` star-imports it beside ``remote_fixtures`` (which has the HTTP server and
moto S3). Every server binds port 0 (or a free port) on 127.0.0.1 and is stopped at
the end of the session. Nothing here reaches outside the machine:

* Azurite is started with ``--disableTelemetry`` (without it, it posts telemetry to the
  Internet on start);
* the GCS emulator subprocess and gcsfs are pointed at the emulator with ``STORAGE_EMULATOR_HOST``
  and ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (else gcsfs probes for gRPC and waits 60 s);
* the fake Hub is reached through ``HF_ENDPOINT`` / ``HfFileSystem(endpoint=...)``.

Fixtures::

    gcs_server, gcs_bucket          gcp-storage-emulator, threaded, writes serialised (subprocess)
    azurite, az_container           Azurite blob service (skips when node/azurite is missing)
    fake_hub                        a fake Hub: revision, tree, paths-info and resolve endpoints
    fault_proxy                     factory: FaultProxy(upstream) -> faults on any emulator

Run ``python cloud_fixtures.py gcs-serve PORT`` to start the threaded GCS emulator by hand.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import http.client
import io
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

try:
    import pytest
except ImportError:  # the servers work without pytest (scripts, benchmarks)
    pytest = None  # type: ignore[assignment]

HERE = Path(__file__).resolve().parent

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "Azurite",
    "FakeHub",
    "FaultProxy",
    "GcsEmulator",
    "az_container",
    "azurite",
    "fake_hub",
    "fault_proxy",
    "gcs_bucket",
    "gcs_server",
]

# gcsfs reads this once, at `import gcsfs` (default "true"): gcsfs.GCSFileSystem then is the
# experimental ExtendedGcsFileSystem, which asks the storage-layout gRPC API first and, against an
# emulator or a proxy, waits ~60 s. It must be set before anything imports gcsfs (conftest time),
# not in a fixture. (`gcsfs.core.GCSFileSystem` is the plain class whatever the variable says.)
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s") from None
            time.sleep(0.05)


class _EnvPatch:
    """Set / remove environment variables and put them back later."""

    def __init__(self) -> None:
        self._saved: dict[str, str | None] = {}

    def set(self, **values: str | None) -> None:
        for k, v in values.items():
            self._saved.setdefault(k, os.environ.get(k))
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def restore(self) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved.clear()


# ----------------------------------------------------------------------------------------------
# GCS: gcp-storage-emulator, threaded, writes serialised


class _RWLock:
    """Many readers or one writer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def read(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def write(self):
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def make_threaded_gcs_emulator(port: int, host: str = "127.0.0.1", data_dir: str | None = None):
    """A gcp-storage-emulator Server whose HTTP server is threaded: GETs run concurrently, every
    other method holds one lock (the emulator's storage is plain dicts and files, not thread-safe).

    The stock emulator is a single-threaded ``http.server.HTTPServer``: a client holding one
    download open (a DataLoader worker) stalls every other client."""
    from gcp_storage_emulator import server as gse

    lock = _RWLock()
    if not getattr(gse.Router, "_wdsllm_locked", False):
        original = gse.Router.handle

        def handle(self, method):
            override = self._request_handler.headers.get("x-http-method-override") or method
            guard = lock.read() if override in ("GET", "HEAD") else lock.write()
            with guard:
                return original(self, method)

        gse.Router.handle = handle
        gse.Router._wdsllm_locked = True

    class _Threading(_QuietServer):
        allow_reuse_address = True

    def run(self) -> None:  # APIThread.run with a threading server
        from functools import partial

        self._httpd = _Threading((self._host, self._port), partial(gse.RequestHandler, self._storage))
        self.is_running.set()
        self._httpd.serve_forever(poll_interval=0.05)

    gse.APIThread.run = run
    return gse.create_server(host, port, in_memory=data_dir is None, data_dir=data_dir)


class GcsEmulator:
    """gcp-storage-emulator in a subprocess (its own GIL), threaded with writes serialised.

    ``install_env()`` sets ``STORAGE_EMULATOR_HOST`` (gcsfs, google-cloud-storage) and
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``."""

    def __init__(self, mode: str = "process") -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._server = None
        if mode == "process":
            self._proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "gcs-serve", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            self._server = make_threaded_gcs_emulator(self.port)
            self._server.start()
        wait_port(self.port)
        self.env = _EnvPatch()

    def install_env(self) -> None:
        self.env.set(
            STORAGE_EMULATOR_HOST=self.endpoint,
            GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
            GOOGLE_APPLICATION_CREDENTIALS=None,
            GOOGLE_CLOUD_PROJECT="test",
            # gcsfs token=None / google.auth.default() must not ask the metadata server
            NO_GCE_CHECK="true",
        )

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def new_bucket(self, prefix: str = "wdsllm-test") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        status, body = self.request(
            "POST",
            "/storage/v1/b?project=test",
            json.dumps({"name": name}).encode(),
            {"Content-Type": "application/json"},
        )
        if status != 200:
            raise RuntimeError(f"cannot create bucket {name}: {status} {body[:200]!r}")
        return name

    def put(self, bucket: str, name: str, data: bytes) -> None:
        status, body = self.request(
            "POST",
            f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(name, safe='')}",
            data,
            {"Content-Type": "application/octet-stream"},
        )
        if status != 200:
            raise RuntimeError(f"cannot upload {name}: {status} {body[:200]!r}")

    def wipe(self) -> None:
        self.request("GET", "/wipe")

    def close(self) -> None:
        self.env.restore()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
        if self._server is not None:
            self._server.stop()


# ----------------------------------------------------------------------------------------------
# Azure: Azurite

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def find_azurite() -> str | None:
    """The azurite-blob launcher: $WDSLLM_AZURITE, node_modules/.bin in the running venv (a git
    worktree runs the main checkout's venv) or beside the repo, or PATH."""
    if shutil.which("node") is None:
        return None
    candidates = [os.environ.get("WDSLLM_AZURITE")]
    for base in (Path(sys.prefix), HERE.parent / ".venv", Path.cwd(), HERE, *HERE.parents):
        candidates.append(str(base / "node_modules" / ".bin" / "azurite-blob"))
    candidates.append(shutil.which("azurite-blob"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


class Azurite:
    """Azurite's blob service on a port the OS picks, data in memory.

    ``connection_string`` uses the well-known devstoreaccount1 key; ``install_env()`` puts it in
    ``AZURE_STORAGE_CONNECTION_STRING`` (adlfs and azure-storage-blob read it)."""

    def __init__(self, binary: str, memory_limit_mb: int = 2048) -> None:
        self._proc = subprocess.Popen(
            [
                binary,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                "0",
                "--inMemoryPersistence",
                "--extentMemoryLimit",
                str(memory_limit_mb),
                "--skipApiVersionCheck",
                "--loose",
                "--silent",
                "--disableTelemetry",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.port = self._read_port()
        self.endpoint = f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"
        self.connection_string = (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={self.endpoint};"
        )
        self.env = _EnvPatch()

    def _read_port(self) -> int:
        deadline = time.monotonic() + 30
        lines = []
        assert self._proc.stdout is not None
        while time.monotonic() < deadline:
            line = self._proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listens on https?://[^:]+:(\d+)", line)
            if m:
                # keep draining stdout so the pipe never fills
                threading.Thread(target=self._proc.stdout.read, daemon=True).start()
                return int(m.group(1))
        self._proc.kill()
        raise RuntimeError("Azurite did not start:\n" + "".join(lines))

    def install_env(self) -> None:
        self.env.set(
            AZURE_STORAGE_CONNECTION_STRING=self.connection_string,
            AZURE_STORAGE_ACCOUNT_NAME=None,
            AZURE_STORAGE_ACCOUNT_KEY=None,
            AZURE_STORAGE_SAS_TOKEN=None,
        )

    def service(self):
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def new_container(self, prefix: str = "wdsllm-test", public: bool = False) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.service().create_container(name, public_access="container" if public else None)
        return name

    def close(self) -> None:
        self.env.restore()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


# ----------------------------------------------------------------------------------------------
# Hugging Face: a fake Hub


@dataclass
class HubRepo:
    """A repository of the fake Hub: branches / tags name commits, commits map paths to bytes."""

    repo_id: str
    repo_type: str = "dataset"
    refs: dict[str, str] = field(default_factory=dict)  # "main" -> sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    private: bool = False

    def commit(self, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit with ``files`` (added to the branch's current files); returns its sha."""
        base = dict(self.commits.get(self.refs.get(branch, ""), {}))
        base.update(files)
        sha = hashlib.sha1(f"{self.repo_id}{len(self.commits)}{sorted(base)}".encode()).hexdigest()
        self.commits[sha] = base
        self.refs[branch] = sha
        return sha

    def resolve(self, rev: str) -> str | None:
        rev = unquote(rev)
        for name in (rev, rev.removeprefix("refs/heads/"), rev.removeprefix("refs/")):
            if name in self.refs:
                return self.refs[name]
        return rev if rev in self.commits else None


class _QuietServer(ThreadingHTTPServer):
    """A threaded server that does not print a traceback when a client hangs up mid-answer
    (every early close of a ranged read does)."""

    daemon_threads = True
    # socketserver's default listen backlog is 5: 8+ concurrent ranged GETs (cat_ranges) overflow
    # it, and the dropped SYNs come back after the kernel's 1 s retransmit timeout.
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # responses
    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, ctype: str = "application/json"
    ) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, code: str, message: str) -> None:
        # huggingface_hub maps X-Error-Code to RepositoryNotFoundError, RevisionNotFoundError, ...
        self._json({"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message})

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def _route(self) -> None:
        hub: FakeHub = self.server.hub
        parts = urlsplit(self.path)
        path = parts.path
        hub.record(self.command, path, self.headers)
        if path.startswith("/cdn/"):
            return self._cdn(path)
        m = re.fullmatch(
            r"/api/(datasets|models|spaces)/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(/.*)?)?", path
        )
        if m:
            kind, repo_id, op, rev, rest = m.groups()
            op, rev = op or "revision", rev or "main"  # /api/datasets/{repo}: repo_info without a revision
            repo = self._repo(kind[:-1], repo_id)
            if repo is None:
                return
            sha = repo.resolve(rev)
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            files = repo.commits[sha]
            if op == "revision":
                return self._json(
                    {
                        "_id": uuid.uuid5(uuid.NAMESPACE_URL, repo_id).hex[:24],
                        "id": repo_id,
                        "sha": sha,
                        "private": repo.private,
                        "disabled": False,
                        "gated": False,
                        "siblings": [{"rfilename": p} for p in sorted(files)],
                        "lastModified": "2025-01-01T00:00:00.000Z",
                        "tags": [],
                        "downloads": 0,
                        "likes": 0,
                    }
                )
            if op == "tree":
                prefix = unquote(rest or "").strip("/")
                recursive = parse_qs(parts.query).get("recursive", ["false"])[0].lower() == "true"
                return self._json(_tree(files, prefix, recursive))
            # paths-info: form data paths=a&paths=b
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            out = []
            for p in form.get("paths", []):
                p = p.strip("/")
                if p in files:
                    out.append(_file_entry(p, files[p]))
                elif any(f.startswith(p + "/") for f in files):
                    out.append({"type": "directory", "path": p, "oid": hashlib.sha1(p.encode()).hexdigest()})
            return self._json(out)
        m = re.fullmatch(r"/(datasets/|spaces/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            kind, repo_id, rev, file_path = m.groups()
            repo = self._repo({"datasets/": "dataset", "spaces/": "space"}.get(kind or "", "model"), repo_id)
            if repo is None:
                return
            sha = repo.resolve(rev)
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            file_path = unquote(file_path)
            data = repo.commits[sha].get(file_path)
            if data is None:
                return self._error(404, "EntryNotFound", f"{file_path} does not exist at {sha}")
            etag = '"' + hub.digest("sha256", data) + '"'
            common = {"X-Repo-Commit": sha, "ETag": etag, "X-Linked-Etag": etag, "X-Linked-Size": str(len(data))}
            if hub.redirect_host:  # like the Hub: 302 to a CDN on another host, signed URL, no auth
                key = hashlib.sha256(f"{sha}/{file_path}".encode()).hexdigest()
                hub.cdn[key] = data
                location = f"http://{hub.redirect_host}:{hub.port}/cdn/{key}?X-Amz-Signature=fake"
                return self._send(302, b"", {**common, "Location": location})
            return self._range(data, common)
        self._error(404, "NotFound", f"no route for {self.command} {path}")

    def _repo(self, repo_type: str, repo_id: str) -> HubRepo | None:
        hub: FakeHub = self.server.hub
        repo = hub.repos.get((repo_type, repo_id))
        auth = self.headers.get("Authorization", "")
        if repo is None or (repo.private and auth != f"Bearer {hub.token}"):
            # The Hub answers 401 + RepoNotFound for missing and for private-without-token repos.
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        return repo

    def _cdn(self, path: str) -> None:
        hub: FakeHub = self.server.hub
        data = hub.cdn.get(path.rsplit("/", 1)[-1])
        if data is None:
            return self._send(404, b"no such object", ctype="text/plain")
        if self.headers.get("Authorization"):  # the CDN refuses a forwarded Hub token, as S3 does
            return self._send(400, b"Only one auth mechanism allowed", ctype="text/plain")
        self._range(data, {"ETag": '"' + hub.digest("md5", data) + '"'})

    def _range(self, data: bytes, headers: dict[str, str]) -> None:
        size = len(data)
        rng = self.headers.get("Range")
        start, end, status = 0, size, 200
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (m.group(1) == "" and m.group(2) == ""):
                return self._send(416, b"", {"Content-Range": f"bytes */{size}"})
            if m.group(1) == "":
                start, end = max(0, size - int(m.group(2))), size
            else:
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            if start >= size or end <= start:
                return self._send(416, b"", {"Content-Range": f"bytes */{size}"})
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{size}"}
        self._send(status, data[start:end], {**headers, "Accept-Ranges": "bytes"}, "application/octet-stream")


def _file_entry(path: str, data: bytes) -> dict[str, Any]:
    return {"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}


def _tree(files: dict[str, bytes], prefix: str, recursive: bool) -> list[dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    base = prefix + "/" if prefix else ""
    for p, data in sorted(files.items()):
        if not p.startswith(base):
            continue
        rest = p[len(base) :]
        if "/" in rest and not recursive:
            d = base + rest.split("/", 1)[0]
            out.setdefault(d, {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()})
        else:
            if recursive:
                segs = rest.split("/")[:-1]
                for i in range(1, len(segs) + 1):
                    d = base + "/".join(segs[:i])
                    out.setdefault(d, {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()})
            out[p] = _file_entry(p, data)
    return list(out.values())


class FakeHub:
    """A local server answering like the Hugging Face Hub for what ``hf://`` reading needs:

    * ``GET  /api/{datasets|models|spaces}/{repo}/revision/{rev}``  (repo_info: ``sha`` resolves a ref)
    * ``GET  /api/.../tree/{rev}[/{path}]?recursive=``               (ls / list_repo_tree)
    * ``POST /api/.../paths-info/{rev}``  form ``paths=...``          (info / get_paths_info)
    * ``GET|HEAD /datasets/{repo}/resolve/{rev}/{path}`` with Range    (file bytes; ETag, X-Repo-Commit,
      X-Linked-Size, X-Linked-Etag; with ``redirect_host`` a 302 to ``/cdn/...`` on that host name,
      which refuses requests that carry an Authorization header)

    Private repos need ``Authorization: Bearer {token}``; otherwise 401 + ``X-Error-Code: RepoNotFound``.
    """

    def __init__(self, token: str = "hf_test_token", redirect_host: str | None = None) -> None:
        self.repos: dict[tuple[str, str], HubRepo] = {}
        self.cdn: dict[str, bytes] = {}
        self.token = token
        self.redirect_host = redirect_host
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._digests: dict[tuple[str, int], tuple[bytes, str]] = {}
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), _HubHandler)
        self._server.hub = self  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def add_repo(
        self, repo_id: str, files: dict[str, bytes], repo_type: str = "dataset", private: bool = False
    ) -> HubRepo:
        repo = HubRepo(repo_id, repo_type, private=private)
        repo.commit(files)
        self.repos[(repo_type, repo_id)] = repo
        return repo

    def record(self, method: str, path: str, headers: Any) -> None:
        with self._lock:
            self.requests.append((method, path, dict(headers)))

    def digest(self, algo: str, data: bytes) -> str:
        """``hashlib``'s hex digest of ``data``, computed once per object: hashing a 27 MB file for
        every ranged GET made this server, not the client, the cost in tools/bench_remote.py."""
        key = (algo, id(data))
        with self._lock:
            hit = self._digests.get(key)
        if hit is None or hit[0] is not data:
            hit = (data, hashlib.new(algo, data).hexdigest())
            with self._lock:
                self._digests[key] = hit
        return hit[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ----------------------------------------------------------------------------------------------
# A fault proxy: any emulator behind the fault kinds of remote_fixtures.HttpServer


FAULT_KINDS = {
    "drop_after": {"bytes": 0, "reset": False},  # K body bytes, then FIN (or RST)
    "stall": {"bytes": 0, "seconds": 5.0},  # K body bytes, then silence, then close
    # answer `status` instead (with Retry-After, and a body such as an S3 XML or GCS JSON error)
    "status": {"status": 503, "retry_after": None, "body": None, "content_type": "text/plain"},
    "delay": {"seconds": 0.5},  # wait, then forward
    # a remote store's shape: `latency` before the answer, then at most `rate` bytes/s per
    # connection (S3 gives one connection ~50-100 MB/s; parallel ranged GETs are how to go faster)
    "throttle": {"latency": 0.02, "rate": 25e6},
}


@dataclass
class ProxyFault:
    pattern: str  # fnmatch on "METHOD /path" (query excluded), e.g. "GET */shard-000001.tar"
    kind: str
    times: int | None
    params: dict[str, Any]
    hits: int = 0


class FaultProxy:
    """A reverse proxy to ``upstream`` (``http://127.0.0.1:PORT``) that injects faults, and a plain
    HTTP forward proxy (requests whose target is an absolute URL go to that URL; for HTTP_PROXY
    tests). Every request is logged as (method, target, headers)."""

    def __init__(self, upstream: str | None = None) -> None:
        self.upstream = upstream
        self.faults: list[ProxyFault] = []
        self.log: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self._server = _QuietServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.proxy = self  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def add(self, pattern: str, kind: str, *, times: int | None = 1, **params: Any) -> ProxyFault:
        fault = ProxyFault(pattern, kind, times, {**FAULT_KINDS[kind], **params})
        with self._lock:
            self.faults.append(fault)
        return fault

    def take(self, key: str) -> ProxyFault | None:
        with self._lock:
            for f in self.faults:
                if (f.times is None or f.hits < f.times) and fnmatch.fnmatchcase(key, f.pattern):
                    f.hits += 1
                    return f
        return None

    def close(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()


_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade", "proxy-authorization"}


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._forward()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_GET

    def _forward(self) -> None:
        proxy: FaultProxy = self.server.proxy
        with proxy._lock:
            proxy.log.append((self.command, self.path, dict(self.headers)))
        if self.path.startswith("http://"):
            target = urlsplit(self.path)
        elif proxy.upstream:
            target = urlsplit(proxy.upstream + self.path)
        else:
            self.send_error(502, "no upstream")
            return
        path = target.path + (f"?{target.query}" if target.query else "")
        fault = proxy.take(f"{self.command} {target.path}")
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.params["seconds"])
            fault = None
        rate = None
        if fault is not None and fault.kind == "throttle":
            time.sleep(fault.params["latency"])
            rate = fault.params["rate"]
            fault = None
        length = int(self.headers.get("Content-Length") or 0)
        body: Any = self.rfile.read(length) if length else None
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = self._read_chunked()
        if fault is not None and fault.kind == "status":
            msg = fault.params["body"] or f"{fault.params['status']} injected\n".encode()
            self.send_response(fault.params["status"])
            self.send_header("Content-Type", fault.params["content_type"])
            if fault.params.get("retry_after") is not None:
                self.send_header("Retry-After", str(fault.params["retry_after"]))
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(msg)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP and k.lower() != "host"}
        headers["Host"] = target.netloc if self.path.startswith("http://") else self.headers.get("Host", target.netloc)
        conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=60)
        try:
            conn.request(self.command, path, body=body, headers=headers)
            resp = conn.getresponse()
        except OSError as exc:
            self.send_error(502, f"upstream: {exc}")
            return
        self.send_response(resp.status, resp.reason)
        chunked = resp.getheader("Content-Length") is None and self.command != "HEAD" and resp.status not in (204, 304)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP:
                self.send_header(k, v)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.command == "HEAD":
            resp.close()
            conn.close()
            return
        limit = None
        if fault is not None and fault.kind in ("drop_after", "stall"):
            limit = fault.params["bytes"]
        sent = 0
        t0 = time.monotonic()
        try:
            while True:
                if rate is not None:  # pace the body: `sent` bytes may leave by t0 + sent / rate
                    ahead = t0 + sent / rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                chunk = resp.read1(65536) if limit is None else resp.read1(min(65536, limit - sent))
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                sent += len(chunk)
                if limit is not None and sent >= limit:
                    break
            if limit is not None and sent >= limit:
                self.wfile.flush()
                if fault.kind == "stall":
                    deadline = time.monotonic() + fault.params["seconds"]
                    while time.monotonic() < deadline and not proxy.stopping.is_set():
                        time.sleep(0.02)
                self._abort(fault.kind == "drop_after" and fault.params["reset"])
            elif chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True
        finally:
            resp.close()
            conn.close()

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()

    def _abort(self, reset: bool) -> None:
        self.close_connection = True
        try:
            self.wfile.flush()
            if reset:
                time.sleep(0.05)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.rfile.close()
                self.wfile.close()
                self.connection.close()
                self.rfile, self.wfile = io.BytesIO(), io.BytesIO()
            else:
                self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# ----------------------------------------------------------------------------------------------
# pytest fixtures

if pytest is not None:

    @pytest.fixture(scope="session")
    def gcs_server() -> Iterator[GcsEmulator]:
        pytest.importorskip("gcsfs", reason="gs:// tests need gcsfs (pip install wdsllm[gcs])")
        pytest.importorskip("gcp_storage_emulator", reason="gs:// tests need gcp-storage-emulator")
        server = GcsEmulator()
        server.install_env()
        yield server
        server.close()

    @pytest.fixture
    def gcs_bucket(gcs_server: GcsEmulator) -> str:
        return f"gs://{gcs_server.new_bucket()}"

    @pytest.fixture(scope="session")
    def azurite() -> Iterator[Azurite]:
        pytest.importorskip("adlfs", reason="az:// tests need adlfs (pip install wdsllm[azure])")
        binary = find_azurite()
        if binary is None:
            why = "node is not installed" if shutil.which("node") is None else "azurite is not installed"
            pytest.skip(
                f"Azure tests need Azurite: {why} (tools/setup.sh runs `npm install azurite` when node is present)"
            )
        server = Azurite(binary)
        server.install_env()
        yield server
        server.close()

    @pytest.fixture
    def az_container(azurite: Azurite) -> str:
        return f"az://{azurite.new_container()}"

    @pytest.fixture(scope="session")
    def fake_hub() -> Iterator[FakeHub]:
        pytest.importorskip("huggingface_hub", reason="hf:// tests need huggingface_hub")
        hub = FakeHub(redirect_host="localhost")
        env = _EnvPatch()
        # HF_ENDPOINT is read when huggingface_hub.constants is imported: subprocesses see it,
        # this process must pass endpoint=hub.endpoint explicitly (or set it before the import).
        env.set(
            HF_ENDPOINT=hub.endpoint,
            HF_TOKEN=hub.token,
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_XET="1",
            HF_HUB_OFFLINE=None,
        )
        yield hub
        env.restore()
        hub.close()

    @pytest.fixture
    def fault_proxy() -> Iterator[Any]:
        """``fault_proxy(upstream)`` -> a FaultProxy in front of that endpoint, closed after the test."""
        proxies: list[FaultProxy] = []

        def make(upstream: str | None = None) -> FaultProxy:
            p = FaultProxy(upstream)
            proxies.append(p)
            return p

        yield make
        for p in proxies:
            p.close()


# ----------------------------------------------------------------------------------------------

if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "gcs-serve":
        import logging

        logging.basicConfig(level=logging.ERROR)
        parent = os.getppid()
        srv = make_threaded_gcs_emulator(int(sys.argv[2]))
        srv.start()
        try:
            while os.getppid() == parent:  # the test process died (killed by a timeout): go too
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        srv.stop()
    else:
        print(__doc__)
