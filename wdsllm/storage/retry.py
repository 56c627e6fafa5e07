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
from ..redact import redact, redact_text
from .counters import count, count_failure, count_in, store_key

log = logging.getLogger(__name__)


def make_error(
    url: str, reason: str, transient: bool = False, missing: bool = False, retry_after: float | None = None
) -> StorageError:
    """The StorageError subclass for a failure: transient (retried), missing, or permanent.

    The URL and the reason are redacted (no password, no query token reaches a message);
    ``retry_after``: the seconds a server asked the client to wait (429/503 ``Retry-After``).
    """
    url, reason = redact(url), redact_text(reason)
    cls = TransientError if transient else (NotFoundError if missing else StorageError)
    error = cls(f"{url}: {reason}", url=url, reason=reason)
    error.retry_after = retry_after
    return error


def parse_retry_after(value: Any) -> float | None:
    """Seconds from a ``Retry-After`` header: delta-seconds or an HTTP date; None if absent or bad."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        from email.utils import parsedate_to_datetime

        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())


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
    #: the longest ``Retry-After`` (429/503/SlowDown) that is honoured; longer asks wait this long
    max_retry_after: float = 60.0

    def delay(self, url: str, retry: int, retry_after: float | None = None) -> float:
        jitter = random.Random(f"{url}#{retry}").uniform(0.5, 1.0)
        backoff = min(self.max_delay, self.base_delay * 2**retry) * jitter
        if retry_after is not None:  # the server said when: wait at least that long
            return max(backoff, min(retry_after, self.max_retry_after))
        return backoff


DEFAULT_RETRY = RetryPolicy()

#: (exception) -> (transient, reason) or (transient, reason, retry_after seconds) or None, one per
#: backend with exceptions of its own
Classifier = Callable[[BaseException], "tuple[bool, str] | tuple[bool, str, float | None] | None"]
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


def retry_after(exc: BaseException) -> float | None:
    """The wait the server asked for with the failure ``exc`` (Retry-After), if it did."""
    kind = classification(exc)
    return None if kind is None else kind[2]


def classification(exc: BaseException) -> tuple[bool, str, float | None] | None:
    """(transient, reason, Retry-After seconds) for the errors we know, None for the rest (bugs
    propagate unchanged)."""
    if isinstance(exc, StorageError):
        return isinstance(exc, TransientError), exc.reason, getattr(exc, "retry_after", None)
    for classify_exc in _classifiers:
        kind = classify_exc(exc)
        if kind is not None:
            transient, reason, *after = kind
            return transient, redact_text(reason), (after[0] if after else None)
    return _classify_builtin(exc)


def _classify_builtin(exc: BaseException) -> tuple[bool, str, None] | None:
    kind = _builtin(exc)
    return None if kind is None else (kind[0], redact_text(kind[1]), None)


def _builtin(exc: BaseException) -> tuple[bool, str] | None:
    # the fsspec clients' public calls say 404 and 403 with these (the store's code in __cause__)
    if isinstance(exc, FileNotFoundError):
        return False, f"not found ({exc})"
    if isinstance(exc, PermissionError):
        return False, f"permission denied ({exc})"
    if isinstance(exc, (FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError):
        return True, f"timed out ({exc or 'no data'})"
    if isinstance(exc, http.client.IncompleteRead):
        return True, f"connection closed early ({exc!r})"
    if isinstance(exc, (ConnectionError, http.client.HTTPException)):
        return True, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):  # unreachable network, DNS failure, EIO on a network filesystem
        return True, f"{type(exc).__name__}: {exc}"
    return None


def sleep_counted(store: str, delay: float) -> None:
    """Wait ``delay`` seconds before a retry, counted in ``store``'s ``fetch_ns``: the time a
    reader waits for a store is every attempt and every wait between them."""
    began = time.perf_counter_ns()
    try:
        time.sleep(delay)
    finally:
        count_in(store, "fetch_ns", time.perf_counter_ns() - began)


def retrying(url: str, policy: RetryPolicy, op: Callable[[], Any]) -> Any:
    """Run a whole idempotent operation (HEAD, PUT, DELETE, upload) under the retry policy; each
    attempt and each wait between them counts in the store's ``fetch_ns``."""
    store = store_key(url)
    for attempt in range(1, policy.attempts + 1):
        count("requests")
        count_in(store, "requests")
        began = time.perf_counter_ns()
        try:
            return op()
        except Exception as exc:
            kind = classification(exc)
            if kind is None:
                raise
            transient, reason, after = kind
            count_failure(url, reason)
            if not transient:
                if isinstance(exc, StorageError):
                    raise
                raise make_error(url, reason, missing=is_missing(exc)) from exc
            if attempt == policy.attempts:
                raise make_error(url, f"giving up after {attempt} attempts: {reason}") from exc
            delay = policy.delay(url, attempt - 1, after)
            log.warning("%s: %s; retry %d/%d in %.2fs", redact(url), reason, attempt, policy.attempts - 1, delay)
            count("retries")
            count_in(store, "retries")
            time.sleep(delay)
        finally:  # the attempt and the wait after it
            count_in(store, "fetch_ns", time.perf_counter_ns() - began)
    raise AssertionError("unreachable")
