"""Counters of storage traffic in this process (requests, retries, bytes received, cache hits)."""

from __future__ import annotations

import threading

from .state import own

NAMES = ("requests", "retries", "resumed_bytes", "received_bytes", "skipped_bytes", "cache_hits", "cache_misses")


class Counters:
    """The process's counters by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(NAMES, 0)

    def add(self, name: str, n: int) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(NAMES, 0)

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # the parent's may have been held by another thread at fork time


COUNTERS = own("counters", Counters())


def count(name: str, n: int = 1) -> None:
    COUNTERS.add(name, n)


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
