"""Counters of storage traffic in this process (requests, retries, bytes received, cache hits),
in all and per store (scheme and host: ``urls.store_of``)."""

from __future__ import annotations

import re
import threading

from .state import own
from .stores import store_of

NAMES = ("requests", "retries", "resumed_bytes", "received_bytes", "skipped_bytes", "cache_hits", "cache_misses")
#: what each store counts: ``fetch_ns`` is the time spent receiving its bodies (the fetch stage);
#: failures by the status a server answered (429, 503) or any other; ``checksum_rereads``: ranges
#: read again after a checksum mismatch
STORE_NAMES = (
    "requests",
    "retries",
    "status_429",
    "status_503",
    "other_errors",
    "received_bytes",
    "fetch_ns",
    "checksum_rereads",
    "cache_hits",
    "cache_misses",
)
_STATUS = re.compile(r"\bHTTP (\d{3})\b")


class Counters:
    """The process's counters by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(NAMES, 0)
        self._stores: dict[str, dict[str, int]] = {}
        self.fetch_ns = 0  # over every store: what a reader waiting for bytes compares
        #: changes whenever a store's counters do: a report made of them is made again only then
        self.stores_version = 0
        #: per store, ``stores_version`` as of its last change (never reused: the global number
        #: only grows), so that a report makes again only the stores that moved
        self.store_versions: dict[str, int] = {}

    def add(self, name: str, n: int) -> None:
        with self._lock:
            self._counts[name] += n

    def add_store(self, store: str, name: str, n: int) -> None:
        with self._lock:
            counts = self._stores.get(store)
            if counts is None:
                counts = self._stores[store] = dict.fromkeys(STORE_NAMES, 0)
            counts[name] += n
            self.stores_version += 1
            self.store_versions[store] = self.stores_version
            if name == "fetch_ns":
                self.fetch_ns += n

    def stores(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {store: dict(counts) for store, counts in self._stores.items()}

    def store(self, store: str) -> dict[str, int] | None:
        """One store's counters (None: it counted nothing)."""
        with self._lock:
            counts = self._stores.get(store)
            return None if counts is None else dict(counts)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(NAMES, 0)
            self._stores = {}
            self.fetch_ns = 0
            self.stores_version += 1
            self.store_versions = {}

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # the parent's may have been held by another thread at fork time


COUNTERS = own("counters", Counters())


def count(name: str, n: int = 1) -> None:
    COUNTERS.add(name, n)


def store_key(url: str) -> str:
    """``scheme://host`` of the store ``url`` is in (no user name, password, path or query)."""
    scheme, host = store_of(url)
    return f"{scheme}://{host}"


def count_store(url: str, name: str, n: int = 1) -> None:
    """Count ``n`` of ``name`` (one of ``STORE_NAMES``) for the store of ``url``."""
    COUNTERS.add_store(store_key(url), name, n)


def count_in(store: str, name: str, n: int = 1) -> None:
    """:func:`count_store` with the store's key (``store_key``) already made."""
    COUNTERS.add_store(store, name, n)


def count_failure(url: str, reason: str) -> None:
    """A failed request to the store of ``url``, by the HTTP status its reason names (429, 503),
    else as another error."""
    found = _STATUS.search(reason)
    status = found.group(1) if found else ""
    count_store(url, f"status_{status}" if status in ("429", "503") else "other_errors")


def stores_moved(before: dict[str, dict[str, int]], now: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What each store counted between two :func:`store_stats` (only what moved): what another
    process (a DataLoader worker, the fetch process) sends to the one that reports."""
    moved = {}
    for store, counts in now.items():
        was = before.get(store, {})
        delta = {name: n - was.get(name, 0) for name, n in counts.items() if n != was.get(name, 0)}
        if delta:
            moved[store] = delta
    return moved


def add_stores(moved: dict[str, dict[str, int]]) -> None:
    """Count here what :func:`stores_moved` found in another process."""
    for store, counts in moved.items():
        for name, n in counts.items():
            if name in STORE_NAMES:
                COUNTERS.add_store(store, name, n)


def fetch_ns() -> int:
    """Nanoseconds this process has spent on requests and receiving bodies, over every store."""
    return COUNTERS.fetch_ns


def stores_version() -> int:
    """A number that changes whenever any store's counters change (and only then)."""
    return COUNTERS.stores_version


def store_versions() -> dict[str, int]:
    """Per store, a number that changes whenever its counters do (a copy: the C-level copy of a
    dict is one step under the GIL, so no lock is needed)."""
    return COUNTERS.store_versions.copy()


def one_store_stats(store: str) -> dict[str, int] | None:
    """:func:`store_stats` of one store (``scheme://host``); None where it counted nothing."""
    return COUNTERS.store(store)


def store_stats() -> dict[str, dict[str, int]]:
    """This process's counters per store (``scheme://host``: ``STORE_NAMES``), since import or
    :func:`reset_stats`; stores never asked are absent."""
    return COUNTERS.stores()


def stats() -> dict[str, int]:
    """Counters of this process since import or :func:`reset_stats`.

    ``requests``: requests sent (opens, resumes, HEADs); ``retries``: tries after a failure;
    ``resumed_bytes``: bytes that resumed retries did not read again (sum of the resume positions
    past the stream's start); ``received_bytes``: body bytes received from remote stores;
    ``skipped_bytes``: bytes read and dropped because a server ignored Range; ``cache_hits`` /
    ``cache_misses``: :class:`~wdsllm.storage.cache.ShardCache` lookups.
    """
    return COUNTERS.snapshot()


def reset_stats() -> None:
    COUNTERS.reset()
