"""The resumable stream: exactly an object's bytes, once, in order, through any number of faults.

Training reads shards for days over networks that drop connections, throttle and stall. A
:class:`ResumableStream` turns those faults into either a stream that delivers exactly the
requested bytes (transient faults are retried, and a retry resumes with a ranged request at the
byte where the stream broke) or a :class:`~wdsllm.errors.StorageError` that names the URL and the
reason (permanent faults fail at once, without retries). :func:`open_stream` is the public way in:
it picks the backend for the URL's scheme, the shard cache and the checks.

One stream must be used by one thread at a time; different streams may be used from different
threads.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any, BinaryIO

from ..errors import StorageError
from . import parallel, versions
from .backends import Backend, backend_for
from .counters import count, count_failure, count_in, store_key
from .retry import DEFAULT_RETRY, RetryPolicy, classification, is_missing, make_error, retrying, sleep_counted
from .urls import redact, scheme_of

log = logging.getLogger(__name__)

#: Buffer of the stream objects that :func:`open_stream` returns for remote URLs.
STREAM_BUFFER = 256 * 1024

#: ``read()`` of the whole rest of a stream asks the body for up to this much at a time.
READALL_CHUNK = 4 * 2**20


class ResumableStream(io.RawIOBase):
    """Bytes ``[offset, offset+length)`` of one object, through any number of transient faults.

    ``opener(start, end, etag)`` answers one request with a body. When a body fails (an error, or
    an end before the known size), the body is dropped and a new one is opened at the current
    position: nothing is delivered twice and nothing is lost. The object's size and ETag from the
    first answer are checked against every later answer, so a resume never splices two versions;
    with ``version`` (as :mod:`.versions` writes it) every request, the first included, asks for
    that version and every answer must be of it. With ``expected_sha256`` (whole-object reads
    only) the digest is checked when the consumer reaches the end; reading less skips the check.
    """

    def __init__(
        self,
        url: str,
        opener: Callable[[int, int | None, str | None], Any],
        *,
        offset: int,
        length: int | None,
        policy: RetryPolicy,
        expected_size: int | None = None,
        expected_sha256: str | None = None,
        version: str | None = None,
    ) -> None:
        super().__init__()
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"{redact(url)}: negative offset or length ({offset}, {length})")
        self.name = redact(url)
        self._store = store_key(self.name)  # where its requests, bytes and failures are counted
        self._opener = opener
        self._policy = policy
        self._start = self._pos = offset
        # _limit is what the caller asked for and what requests name: an open range "bytes=N-"
        # unless a length was given. _end also learns the object's size from the first answer.
        self._limit = offset + length if length is not None else None
        self._end = self._limit
        self._expected_size = expected_size
        self._expected_sha256 = expected_sha256.lower() if expected_sha256 else None
        self._hasher = hashlib.sha256() if self._expected_sha256 and offset == 0 and length is None else None
        self._total: int | None = None
        self._etag: str | None = version or None
        self._body = None
        self._failures = 0
        self._resuming = False
        self._done = False
        self._error: StorageError | None = None
        if self._end is None or self._end > self._start:
            self._open()

    # io.RawIOBase
    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed stream")
        if self._error is not None:
            raise self._error
        view = memoryview(b).cast("B")
        if self._done or not len(view):
            return 0
        if self._end is not None:
            view = view[: max(0, self._end - self._pos)]
            if not len(view):
                self._finish()
                return 0
        while True:
            if self._body is None:
                self._open()
                if self._end is not None and self._pos >= self._end:
                    self._finish()
                    return 0
                view = view[: max(0, self._end - self._pos)] if self._end is not None else view
            began = time.perf_counter_ns()
            try:
                n = self._body.readinto(view)
                count_in(self._store, "received_bytes", n)
                if not n and self._end is not None and self._pos < self._end:
                    raise make_error(self.name, f"stream ended at byte {self._pos} of {self._end}", transient=True)
            except Exception as exc:
                count_in(self._store, "fetch_ns", time.perf_counter_ns() - began)  # a read that broke is a wait too
                self._drop_body()
                self._failed(exc)
                continue
            count_in(self._store, "fetch_ns", time.perf_counter_ns() - began)
            break
        if n:
            self._pos += n
            self._failures = 0
            if self._hasher is not None:
                self._hasher.update(view[:n])
        else:
            self._finish()
        return n

    def readall(self) -> bytes:
        """The rest of the range (what ``read()`` returns), asked for in reads of up to 4 MiB.

        RawIOBase's own reads 8 KiB at a time, and each read is one hop to the client's event
        loop: ten times the CPU for a large side file (an index's lengths, a tokenizer).
        Memory grows with the bytes that arrive, never with a size a server claims.
        """
        parts = []
        while True:
            left = READALL_CHUNK if self._end is None else self._end - self._pos
            part = bytearray(max(1, min(READALL_CHUNK, left)))  # 1: the end is then noticed (checks)
            n = self.readinto(part)
            if not n:
                return b"".join(parts)
            parts.append(part if n == len(part) else part[:n])

    def close(self) -> None:
        if not self.closed:
            self._drop_body()
        super().close()

    # internals
    def _open(self) -> None:
        while True:
            count("requests")
            count_in(self._store, "requests")
            began = time.perf_counter_ns()
            try:
                body = self._opener(self._pos, self._limit, self._etag)
            except Exception as exc:
                count_in(self._store, "fetch_ns", time.perf_counter_ns() - began)  # a request's wait too
                self._failed(exc)  # its wait before the next try counts there
                continue
            count_in(self._store, "fetch_ns", time.perf_counter_ns() - began)
            try:
                self._accept(body)
            except BaseException:
                body.close()
                raise
            self._body = body
            if self._resuming:
                self._resuming = False
                if self._pos > self._start:
                    count("resumed_bytes", self._pos - self._start)
            return

    def _accept(self, body) -> None:
        total = body.total
        if total is not None:
            if self._total is not None and total != self._total:
                raise make_error(self.name, f"object size changed from {self._total} to {total} during the read")
            if self._expected_size is not None and total != self._expected_size:
                raise make_error(self.name, f"object is {total} bytes, expected {self._expected_size}")
            self._total = total
            self._end = total if self._end is None else min(self._end, total)
        if body.etag:
            if self._etag and body.etag != self._etag:
                raise versions.changed(self.name, self._etag, body.etag)
            self._etag = body.etag

    def _failed(self, exc: Exception) -> None:
        """Back off and return if ``exc`` is worth another try; raise otherwise."""
        kind = classification(exc)
        if kind is None:
            raise exc
        transient, reason, after = kind
        count_failure(self.name, reason)
        if not transient:
            if isinstance(exc, StorageError):
                raise exc
            raise make_error(self.name, reason, missing=is_missing(exc)) from exc
        self._failures += 1
        if self._failures >= self._policy.attempts:
            raise make_error(
                self.name, f"giving up after {self._failures} attempts at byte {self._pos}: {reason}"
            ) from exc
        delay = self._policy.delay(self.name, self._failures - 1, after)
        log.warning(
            "%s: %s; retry %d/%d at byte %d in %.2fs",
            redact(self.name),
            reason,
            self._failures,
            self._policy.attempts - 1,
            self._pos,
            delay,
        )
        count("retries")
        count_in(self._store, "retries")
        self._resuming = True
        sleep_counted(self._store, delay)

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:  # closing a broken connection may fail again; the data is safe
                log.debug("%s: error while closing a body", self.name, exc_info=True)

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        self._drop_body()
        whole = self._start == 0 and self._limit is None
        if whole and self._expected_size is not None and self._pos != self._expected_size:
            self._error = make_error(self.name, f"object is {self._pos} bytes, expected {self._expected_size}")
        elif self._hasher is not None and self._hasher.hexdigest() != self._expected_sha256:
            digest = self._hasher.hexdigest()
            self._error = make_error(self.name, f"sha256 {digest} does not match the expected {self._expected_sha256}")
        if self._error is not None:
            raise self._error  # and again on every later read: a bad object must not look complete


def open_stream(
    url: str,
    *,
    offset: int = 0,
    length: int | None = None,
    retry: RetryPolicy | None = None,
    allow_pipe: bool = False,
    cache: Any = None,
    expected_sha256: str | None = None,
    expected_size: int | None = None,
    one_request: bool = False,
    version: str | None = None,
) -> BinaryIO:
    """A readable binary stream of bytes ``[offset, offset+length)`` of ``url``.

    The stream never holds the whole object in memory; ``read(n)`` returns ``n`` bytes unless the
    end comes first. Remote streams retry transient faults and resume where they broke (see
    :class:`RetryPolicy`); permanent faults (404, 403, NoSuchKey, ...) raise :class:`StorageError`
    at once, already here when the first answer is one. ``pipe:CMD`` runs only with
    ``allow_pipe=True`` and is never retried. With ``cache`` (a
    :class:`~wdsllm.storage.cache.ShardCache`), remote objects are served from a verified local
    copy. ``expected_size`` is checked against the object's size as soon as it is known;
    ``expected_sha256`` when a whole-object read reaches its end. A remote range longer than
    ``BLOCK_SIZE`` is read as concurrent blocks; ``one_request=True`` reads it with one GET
    (resumed where it breaks), for a caller that schedules its own blocks. With ``version`` (an
    :class:`~wdsllm.storage.listing.ObjectInfo`'s) every request is for that version of the object
    and another one is a named error (:func:`~wdsllm.storage.versions.changed`); reads through
    ``cache`` are checked by the cache's sha256 instead.
    """
    policy = retry or DEFAULT_RETRY
    backend = backend_for(url)
    scheme = scheme_of(url)
    if cache is not None and backend.remote:
        return cache.open(
            url,
            offset=offset,
            length=length,
            expected_sha256=expected_sha256,
            expected_size=expected_size,
            retry=policy,
        )
    if scheme == "file" and length is None and expected_sha256 is None:
        return _open_local(url, offset, expected_size)
    if scheme == "pipe":
        if not allow_pipe:
            raise make_error(
                url, "pipe: URLs run a shell command and are only accepted from the user (allow_pipe=True)"
            )
        policy = RetryPolicy(attempts=1, timeout=policy.timeout)
    end = offset + length if length is not None else expected_size
    if backend.remote and not one_request and end is not None and end - offset > parallel.BLOCK_SIZE:
        whole = offset == 0 and length is None
        return _open_blocks(
            url, backend, policy, offset, end, expected_size, expected_sha256 if whole else None, version
        )
    raw = ResumableStream(
        url,
        partial(_open_range, backend, url, policy.timeout),
        offset=offset,
        length=length,
        policy=policy,
        expected_size=expected_size,
        expected_sha256=expected_sha256,
        version=version,
    )
    return io.BufferedReader(raw, buffer_size=STREAM_BUFFER)


def _open_range(backend: Backend, url: str, timeout: float, start: int, end: int | None, etag: str | None) -> Any:
    return backend.open(url, start, end, timeout, etag)


def _open_block(
    backend: Backend,
    url: str,
    policy: RetryPolicy,
    expected_size: int | None,
    version: str | None,
    start: int,
    size: int,
) -> ResumableStream:
    return ResumableStream(
        url,
        partial(_open_range, backend, url, policy.timeout),
        offset=start,
        length=size,
        policy=policy,
        expected_size=expected_size,
        version=version,
    )


def _open_blocks(
    url: str,
    backend: Backend,
    policy: RetryPolicy,
    offset: int,
    end: int,
    expected_size: int | None,
    expected_sha256: str | None,
    version: str | None = None,
) -> BinaryIO:
    """Several ranged GETs in flight: the network's wait overlaps the consumer's work."""
    blocks = parallel.ParallelStream(
        url,
        partial(_open_block, backend, url, policy, expected_size, version),
        offset,
        end,
        block_size=parallel.BLOCK_SIZE,
        in_flight=parallel.IN_FLIGHT,
        expected_sha256=expected_sha256,
    )
    return io.BufferedReader(blocks, buffer_size=STREAM_BUFFER)


def _open_local(url: str, offset: int, expected_size: int | None) -> BinaryIO:
    """The plain file object: fastest, and resumable-stream features are not needed locally."""
    from .local import open_regular

    f = open_regular(url)
    try:
        if expected_size is not None:
            size = os.fstat(f.fileno()).st_size
            if size != expected_size:
                raise make_error(url, f"file is {size} bytes, expected {expected_size}")
        f.seek(offset)
    except BaseException:
        f.close()
        raise
    return f


def read_bytes(url: str, *, retry: RetryPolicy | None = None, allow_pipe: bool = False) -> bytes:
    """The whole content of a small object (an index, a lengths file)."""
    with open_stream(url, retry=retry, allow_pipe=allow_pipe) as f:
        return f.read()


def exists(url: str, *, retry: RetryPolicy | None = None) -> bool:
    """Whether the object exists. Transient faults are retried; a 403 raises rather than
    answering False, because "no permission" is not "absent"."""
    policy = retry or DEFAULT_RETRY
    backend = backend_for(url)
    if not backend.remote:
        return backend.exists(url, policy.timeout)
    return retrying(url, policy, lambda: backend.exists(url, policy.timeout))
