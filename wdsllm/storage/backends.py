"""The seam between the storage layer and the stores: one backend per URL scheme, behind one table.

A backend answers one request for the bytes ``[start, end)`` of one object with a :class:`Body`
(retries, resumption and checks are :mod:`.resumable`'s), says whether an object exists, and
makes the :class:`~wdsllm.storage.output.Output` that writes datasets under its URLs. Adding a
store is one module that calls :func:`register`; no caller changes (as mosaic streaming's
``storage/`` table does).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any, Protocol

from .retry import make_error
from .urls import scheme_of

#: Read size of downloads into the cache, of read-ahead chunks and of discarded prefixes.
CHUNK_SIZE = 1 << 20

log = logging.getLogger(__name__)


class Body(Protocol):
    """One answered request: the object's size and version as the store reported them, and bytes."""

    total: int | None  # the object's size, when the answer says
    etag: str | None  # the object's version, when the store has one

    def readinto(self, b: Any) -> int: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What the storage layer needs of a store."""

    schemes: tuple[str, ...]
    remote: bool  # read over a network: worth caching, read ahead, ranged reads

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Body:
        """Bytes ``[start, end)`` (``end`` None: to the end); a resumed read passes the ETag it saw."""
        ...

    def exists(self, url: str, timeout: float) -> bool: ...

    def output_class(self, url: str) -> type:
        """The Output class that writes datasets under ``url``; raises when the store cannot be written to."""
        ...


_backends: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    for scheme in backend.schemes:
        _backends[scheme] = backend
    return backend


def backend_for(url: str) -> Backend:
    scheme = scheme_of(url)
    backend = _backends.get(scheme)
    if backend is None:
        known = ", ".join(sorted(f"{s}://" if s not in ("file", "pipe") else s for s in _backends))
        raise make_error(url, f"unsupported URL scheme {scheme!r} (supported: {known})")
    return backend


_before_workers: list[Callable[[], None]] = []


def on_prepare_workers(hook: Callable[[], None]) -> Callable[[], None]:
    """Register ``hook`` to run in a process about to fork DataLoader workers (see :func:`prepare_workers`)."""
    _before_workers.append(hook)
    return hook


def prepare_workers() -> None:
    """Do, once in this process, the fork-safe set-up that each worker forked from it would
    otherwise repeat (an S3 client's construction, per worker and epoch).

    The loader calls it before it starts workers. A hook prepares only plain data and objects that
    have never touched a socket or an event loop; each child takes its own copy. Failing hooks are
    logged and ignored: the workers then build everything themselves, as without this call.
    """
    for hook in _before_workers:
        try:
            hook()
        except Exception:
            log.debug("preparing for workers failed in %s", getattr(hook, "__qualname__", hook), exc_info=True)


def anonymous(scheme: str) -> bool:
    """Whether ``WDSLLM_ANONYMOUS`` asks for unsigned requests to ``scheme``'s store (public
    buckets): ``1``/``true`` for every store, or a comma-separated list (``s3,gs``)."""
    value = os.environ.get("WDSLLM_ANONYMOUS", "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    return value in ("1", "true", "yes", "all") or scheme in {v.strip() for v in value.split(",")}


def is_remote(url: str) -> bool:
    """True for URLs read over the network (http(s), s3, gs, az, hf): the ones worth caching."""
    backend = _backends.get(scheme_of(url))
    return backend is not None and backend.remote


class EmptyBody:
    """What a request at or past the end of an object returns."""

    def __init__(self, total: int | None, etag: str | None = None) -> None:
        self.total, self.etag = total, etag

    def readinto(self, b: Any) -> int:
        return 0

    def close(self) -> None:
        pass


def discard(url: str, body: Any, n: int) -> None:
    """Read and drop ``n`` bytes of ``body`` (a store that ignored Range sent them)."""
    buf = bytearray(min(n, CHUNK_SIZE))
    view = memoryview(buf)
    while n:
        got = body.readinto(view[: min(n, len(buf))])
        if not got:
            raise make_error(url, "connection closed while skipping to the requested offset", transient=True)
        n -= got


_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")


def parse_content_range(url: str, value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size or None) of a Content-Range header."""
    m = _CONTENT_RANGE.fullmatch((value or "").strip())
    if not m:
        raise make_error(url, f"bad Content-Range header {value!r}")
    first = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(3)) if m.group(3) != "*" else None
    return first, total
