"""The async clients' common ground: fsspec's event loop driven from plain threads.

s3fs, gcsfs, adlfs and fsspec's HTTP filesystem are asyncio libraries; their coroutines run on
fsspec's one IO thread, and :func:`run` runs one from any plain thread (a DataLoader worker, a
read-ahead thread), blocking it. A backend makes one ranged GET with its library's own client, so
credentials, signing, endpoints and proxies stay the library's, and hands the unread response to
:class:`LoopBody`, which streams it: the resumable stream above decides about retries.

This module also keeps one filesystem instance per (scheme, options) and process, and drops them
in a forked child with the recipe that makes fsspec's objects fork-safe (``_after_fork``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import fsspec.asyn

from . import versions
from .backends import EmptyBody, parse_content_range
from .counters import count
from .retry import add_classifier, make_error, parse_retry_after
from .state import own

log = logging.getLogger(__name__)

#: Extra seconds the thread waits for the loop beyond a read's own timeout (the read's timeout
#: fires on the loop; this only guards against a loop that does not answer at all).
_LOOP_GRACE = 5.0


def run(fn: Callable[..., Awaitable[Any]], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
    """``await fn(*args, **kwargs)`` on fsspec's IO loop, from this thread.

    A stall past ``timeout`` raises ``fsspec.FSTimeoutError`` (a ``TimeoutError``, so transient).
    """
    return fsspec.asyn.sync(fsspec.asyn.get_loop(), fn, *args, timeout=timeout, **kwargs)


class LoopBody:
    """A streaming response read through the loop: ``readinto`` is one hop to the loop.

    ``read(n)`` is the library's coroutine returning up to ``n`` bytes (``b""`` at the end). A hop
    fills as much of the caller's buffer as arrives without a pause of ``timeout`` seconds. Bytes
    that arrived before a failure are handed over first and the failure is raised by the next
    call, so a resume starts exactly where the body broke.
    """

    def __init__(
        self,
        read: Callable[[int], Awaitable[bytes]],
        aclose: Callable[[], Awaitable[None]] | None,
        total: int | None,
        etag: str | None,
        timeout: float | None,
    ) -> None:
        self._read, self._aclose = read, aclose
        self.total, self.etag, self.timeout = total, etag, timeout
        self._error: BaseException | None = None

    async def _fill(self, view: memoryview) -> int:
        """Copy what arrives into ``view`` (on the loop: one copy, no joined intermediate)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        n = len(view)
        got = 0
        loop = asyncio.get_running_loop()
        try:
            async with _deadline(self.timeout) as deadline:
                while got < n:
                    chunk = await self._read(n - got)
                    if not chunk:
                        break
                    view[got : got + len(chunk)] = chunk
                    got += len(chunk)
                    if deadline is not None and self.timeout is not None:
                        deadline.reschedule(loop.time() + self.timeout)  # a pause, not the whole read
        except Exception as exc:
            if isinstance(exc, TimeoutError) and not str(exc):
                exc = TimeoutError(f"no data for {self.timeout} s")
            if not got:
                raise exc from None
            self._error = exc
        return got

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if not len(view):
            return 0
        timeout = None if self.timeout is None else self.timeout + _LOOP_GRACE
        n = run(self._fill, view, timeout=timeout)
        count("received_bytes", n)
        return n

    def close(self) -> None:
        aclose, self._aclose = self._aclose, None
        if aclose is not None:
            try:
                run(aclose, timeout=5)
            except Exception:  # a broken connection may fail to close; the data is safe
                log.debug("error while closing a response", exc_info=True)


if sys.version_info >= (3, 11):
    _deadline = asyncio.timeout
else:  # pragma: no cover - 3.10 has no asyncio.timeout: the clients' own read timeouts guard stalls

    @contextlib.asynccontextmanager
    async def _deadline(seconds: float | None):
        yield None


def salvaging_reader(content: Any) -> Callable[[int], Awaitable[bytes]]:
    """``read(n)`` over an aiohttp ``StreamReader`` that hands over the bytes already buffered
    when the connection broke before raising the break.

    aiohttp raises a cut body's ``ClientPayloadError`` on the next read even when bytes that
    arrived before the cut are still in its buffer; those bytes are good, and a resume that asks
    for them again costs a request and makes the retry count lie about progress.
    """
    salvage = getattr(content, "_read_nowait", None)  # the buffer without the exception check
    failure: list[BaseException] = []

    async def read(n: int) -> bytes:
        if not failure:
            try:
                return await content.read(n)
            except Exception as exc:
                failure.append(exc)
        data = salvage(n) if salvage is not None and getattr(content, "_buffer", None) else b""
        if data:
            return data
        raise failure[0]

    return read


def range_header(start: int, end: int | None) -> str | None:
    if start <= 0 and end is None:
        return None
    return f"bytes={start}-{'' if end is None else end - 1}"


# ----------------------------------------------------------------------------------------------
# aiohttp answers (http(s), hf, gs)


def client_timeout(timeout: float | None) -> Any:
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)


async def aiohttp_open(
    session: Any,
    url: str,
    shown: str,
    start: int,
    end: int | None,
    headers: dict[str, str],
    timeout: float | None,
    pinned: str | None = None,
) -> tuple[Any, LoopBody | EmptyBody]:
    """(response, body) of one ranged GET; statuses >= 400 become named errors (``shown`` is the
    URL the user knows, for messages), a 416 at or past the end an empty body, and a 412 to a
    request conditional on the version ``pinned`` the error that says the object changed. The
    body's ``etag`` is the answer's version (:mod:`.versions`): its ETag, else its Last-Modified."""
    resp = await session.get(url, headers=headers, timeout=client_timeout(timeout))
    try:
        if resp.status == 412 and pinned:
            raise versions.changed(shown, pinned, None)
        if resp.status == 416:
            _, total = parse_content_range(shown, resp.headers.get("Content-Range"))
            if total is not None and start >= total:
                return resp, EmptyBody(total)
            raise make_error(shown, f"HTTP 416 {resp.reason} for bytes from {start}")
        if resp.status >= 400:
            raise await status_error(shown, resp)
        etag = versions.entity_tag(resp.headers.get("ETag")) or versions.modified(resp.headers.get("Last-Modified"))
        if resp.status == 206:
            first, total = parse_content_range(shown, resp.headers.get("Content-Range"))
            if first != start:
                raise make_error(shown, f"asked for bytes from {start}, the server sent from {first}")
        else:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
    except BaseException:
        resp.close()
        raise

    async def aclose() -> None:
        if not release_if_read(resp):
            resp.close()

    return resp, LoopBody(salvaging_reader(resp.content), aclose, total, etag or None, timeout)


def release_if_read(resp: Any) -> bool:
    """Give an aiohttp response's connection back to the pool if its body was read to the end, so
    that it carries the next request (a new connection per ranged GET is a TLS handshake on a
    real store). False for anything else: the caller closes it, since an unread body must not go
    back to the pool."""
    if resp is not None and hasattr(resp, "content") and resp.content.at_eof():
        resp.release()
        return True
    return False


async def status_error(url: str, resp: Any) -> Exception:
    """The StorageError for an answer of status >= 400 (its body read and dropped)."""
    try:
        await resp.read()
    except Exception:  # the status says enough
        pass
    finally:
        resp.release()
    status = resp.status
    transient = status in (408, 429) or status >= 500
    return make_error(
        url,
        f"HTTP {status} {resp.reason or ''}".rstrip(),
        transient=transient,
        missing=status in (404, 410),
        retry_after=parse_retry_after(resp.headers.get("Retry-After")) if transient else None,
    )


def _classify_aiohttp(exc: BaseException) -> tuple[bool, str] | None:
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is None:
        return None
    if isinstance(exc, aiohttp.ClientResponseError):
        status = exc.status
        transient = status in (408, 429) or status >= 500
        return transient, f"HTTP {status} {exc.message}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = exc.os_error
        return True, f"cannot connect to {exc.host}:{exc.port}: {type(cause).__name__}: {cause.strerror or cause}"
    if isinstance(exc, aiohttp.ClientError):  # ClientPayloadError (a cut body) is not an OSError
        return True, f"{type(exc).__name__}: {exc}"
    return None


add_classifier(_classify_aiohttp)


# ----------------------------------------------------------------------------------------------
# One filesystem instance per (scheme, options) and process


_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


_PROXIES_AIOHTTP_READS = tuple(v for v in _PROXY_VARIABLES if v.lower() != "no_proxy")


def environment_to_trust() -> bool:
    """Whether aiohttp's ``trust_env`` has anything to find here: a proxy variable for http(s) or a
    netrc file (``NETRC``, ``~/.netrc``).

    With ``trust_env`` aiohttp looks both up again for every request, each in a thread, a cost
    of the order of a small ranged GET's (docs/benchmarks.md). Where neither is
    set there is nothing to trust, and sessions are made without it. :func:`process_key` holds
    the answer, so a proxy or a netrc that appears later gets a new filesystem that uses it.
    Outside Linux urllib also reads the system's proxy settings, so the answer there is always yes.
    """
    if not sys.platform.startswith("linux"):
        return True
    if any(os.environ.get(name) for name in _PROXIES_AIOHTTP_READS) or os.environ.get("NETRC"):
        return True
    return os.path.exists(os.path.expanduser("~/.netrc"))


def process_key(key: Any) -> Any:
    """``key`` with the proxy variables as they are now, and whether there is an environment to
    trust (:func:`environment_to_trust`): the key :func:`instance` files it under."""
    return (key, tuple(os.environ.get(v) for v in _PROXY_VARIABLES), environment_to_trust())


class Filesystems:
    """This process's filesystems by :func:`process_key` (a scheme and its options, the proxies)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[Any, Any] = {}
        #: a forked child's copies of the parent's filesystems: never used, never freed (collecting
        #: them would warn about the parent's unclosed sessions)
        self._inherited: list[Any] = []

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            fs = self._made.get(key)
            if fs is None:
                fs = self._made[key] = make()
        return fs

    def reset(self) -> None:
        """Forget the filesystems (their sessions close with them, on fsspec's loop)."""
        with self._lock:
            self._made = {}

    def after_fork(self) -> None:
        """Objects of the parent's loop are not ours to use in a forked child.

        fsspec resets its loop in the child, and a filesystem made by the parent raises
        "not fork-safe" there: start without them. fsspec's own hook misses its ``_lock``
        (``reset_lock`` resets it), and the parent's instances leave ``weakref.finalize`` callbacks
        that would run ``sync()`` on the parent's loop at the child's exit and hang (adlfs) or wait
        (s3fs, http): the parent owns those sessions, so they are detached.
        """
        self._lock = threading.Lock()
        self._inherited.extend(self._made.values())
        self._made = {}
        fsspec.asyn.reset_lock()
        for ref, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]
            func = getattr(info, "func", None)
            module = getattr(func, "__module__", "") or ""
            if func is fsspec.asyn.sync or module.startswith(("s3fs", "fsspec", "adlfs", "gcsfs")):
                ref.detach()


FILESYSTEMS = own("filesystems", Filesystems())


def instance(key: Any, make: Callable[[], Any]) -> Any:
    """The filesystem of this process for ``key``, made once with ``make()`` (again when the proxy
    variables change: some clients read them only when they are made)."""
    return FILESYSTEMS.get(process_key(key), make)
