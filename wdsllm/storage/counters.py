"""Counters of storage traffic in this process (requests, retries, bytes received, cache hits)."""

from __future__ import annotations

import os
import threading

NAMES = ("requests", "retries", "resumed_bytes", "received_bytes", "skipped_bytes", "cache_hits", "cache_misses")
_counts: dict[str, int] = dict.fromkeys(NAMES, 0)
_lock = threading.Lock()


def count(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def stats() -> dict[str, int]:
    """Counters of this process since import or :func:`reset_stats`.

    ``requests``: requests sent (opens, resumes, HEADs); ``retries``: tries after a failure;
    ``resumed_bytes``: bytes that resumed retries did not read again (sum of the resume positions
    past the stream's start); ``received_bytes``: body bytes received from remote stores;
    ``skipped_bytes``: bytes read and dropped because a server ignored Range; ``cache_hits`` /
    ``cache_misses``: :class:`~wdsllm.storage.cache.ShardCache` lookups.
    """
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    with _lock:
        for k in _counts:
            _counts[k] = 0


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread at fork time


os.register_at_fork(after_in_child=_after_fork_in_child)
