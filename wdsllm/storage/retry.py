"""Retry policy and error classification: which failures are worth another try, and how long to wait.

Backends answer one request; this module decides what their exceptions mean. Each backend that
raises exceptions of its own registers a classifier (``add_classifier``), so this module never
imports a cloud client, and reading local files never imports one either.
"""

from __future__ import annotations

import http.client
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import NotFoundError, StorageError, TransientError
from .counters import count

log = logging.getLogger(__name__)


def make_error(url: str, reason: str, transient: bool = False, missing: bool = False) -> StorageError:
    """The StorageError subclass for a failure: transient (retried), missing, or permanent."""
    cls = TransientError if transient else (NotFoundError if missing else StorageError)
    return cls(f"{url}: {reason}", url=url, reason=reason)


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

#: (exception) -> (transient, reason) or None, one per backend with exceptions of its own
Classifier = Callable[[BaseException], "tuple[bool, str] | None"]
_classifiers: list[Classifier] = []
#: (exception) -> whether it says the object does not exist, one per backend
_missing_tests: list[Callable[[BaseException], bool]] = []


def add_classifier(classify_exc: Classifier, is_missing: Callable[[BaseException], bool] | None = None) -> None:
    """Teach the retry layer a backend's exceptions."""
    _classifiers.append(classify_exc)
    if is_missing is not None:
        _missing_tests.append(is_missing)


def is_missing(exc: BaseException) -> bool:
    """Whether a non-StorageError exception says that the object does not exist."""
    if isinstance(exc, (NotFoundError, FileNotFoundError)):
        return True
    return any(test(exc) for test in _missing_tests)


def classify(exc: BaseException) -> tuple[bool, str] | None:
    """(transient, reason) for the errors we know, None for the rest (bugs propagate unchanged)."""
    if isinstance(exc, StorageError):
        return isinstance(exc, TransientError), exc.reason
    for classify_exc in _classifiers:
        kind = classify_exc(exc)
        if kind is not None:
            return kind
    if isinstance(exc, TimeoutError):
        return True, f"timed out ({exc or 'no data'})"
    if isinstance(exc, http.client.IncompleteRead):
        return True, f"connection closed early ({exc!r})"
    if isinstance(exc, (ConnectionError, http.client.HTTPException)):
        return True, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):  # unreachable network, DNS failure, EIO on a network filesystem
        return True, f"{type(exc).__name__}: {exc}"
    return None


def retrying(url: str, policy: RetryPolicy, op: Callable[[], Any]) -> Any:
    """Run a whole idempotent operation (HEAD, PUT, DELETE, upload) under the retry policy."""
    for attempt in range(1, policy.attempts + 1):
        count("requests")
        try:
            return op()
        except Exception as exc:
            kind = classify(exc)
            if kind is None:
                raise
            transient, reason = kind
            if not transient:
                if isinstance(exc, StorageError):
                    raise
                raise make_error(url, reason, missing=is_missing(exc)) from exc
            if attempt == policy.attempts:
                raise make_error(url, f"giving up after {attempt} attempts: {reason}") from exc
            delay = policy.delay(url, attempt - 1)
            log.warning("%s: %s; retry %d/%d in %.2fs", url, reason, attempt, policy.attempts - 1, delay)
            count("retries")
            time.sleep(delay)
    raise AssertionError("unreachable")
