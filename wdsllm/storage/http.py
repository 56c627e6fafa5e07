"""http(s): a small HTTP/1.1 client with keep-alive connections pooled per process, redirects and
Range handling (to be replaced by a maintained client, issue #13)."""

from __future__ import annotations

import http.client
import logging
import os
import threading
from typing import Any
from urllib.parse import urljoin, urlsplit

from ..errors import StorageError
from .backends import EmptyBody, discard, parse_content_range, register
from .counters import count
from .retry import make_error

log = logging.getLogger(__name__)

USER_AGENT = "wdsllm-storage/1"
_MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_POOL_MAX = 8  # idle keep-alive connections kept per (scheme, host)


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
        raise make_error(url, "not an http(s) URL")
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
    return make_error(url, _http_reason(resp), transient=transient, missing=resp.status in (404, 410))


class _HttpBody:
    def __init__(self, url: str, resp, conn, total: int | None, etag: str | None) -> None:
        self.url, self.resp, self.conn, self.total, self.etag = url, resp, conn, total, etag

    def readinto(self, b: Any) -> int:
        # read1 makes one socket read: bytes that arrived before a reset are delivered and count
        # as progress, where readinto would wait to fill b and lose them with the exception.
        data = self.resp.read1(len(b))
        n = len(data)
        b[:n] = data
        count("received_bytes", n)
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


def _http_open(url: str, start: int, end: int | None, timeout: float) -> _HttpBody | EmptyBody:
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
        raise make_error(url, f"more than {_MAX_REDIRECTS} redirects")
    try:
        etag = resp.getheader("ETag")
        if resp.status == 206:
            first, total = parse_content_range(url, resp.getheader("Content-Range"))
            if first != start:
                raise make_error(url, f"asked for bytes from {start}, the server sent from {first}")
            return _HttpBody(url, resp, conn, total, etag)
        if resp.status == 200:
            length = resp.getheader("Content-Length")
            total = int(length) if length and length.isdigit() else None
            if start > 0:
                log.warning("%s: server ignored Range and sent the whole object; skipping %d bytes", url, start)
                if total is not None and start >= total:
                    resp.close()
                    conn.close()
                    return EmptyBody(total, etag)
                discard(url, resp, start)
                count("skipped_bytes", start)
            return _HttpBody(url, resp, conn, total, etag)
        if resp.status == 416:
            _, total = parse_content_range(url, resp.getheader("Content-Range"))
            resp.close()
            conn.close()
            if total is not None and start >= total:
                return EmptyBody(total)
            raise make_error(url, f"{_http_reason(resp)} for bytes from {start}")
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


class HttpBackend:
    schemes = ("http", "https")
    remote = True

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return _http_open(url, start, end, timeout)

    def exists(self, url: str, timeout: float) -> bool:
        return _http_exists(url, timeout)

    def output_class(self, url: str) -> Any:
        raise make_error(url, "datasets can only be written to a local directory or s3://bucket/prefix/")


register(HttpBackend())


def _after_fork_in_child() -> None:
    """Sockets of the parent are not ours to use: start with an empty pool."""
    global _http_lock
    _http_lock = threading.Lock()
    _http_pool.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
