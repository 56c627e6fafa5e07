"""Concurrent ranged reads: several blocks of one object in flight at once, delivered in order.

A store caps what one connection delivers (S3 gives one GET tens of MB/s) and every request waits
out a round trip, so one stream at a time leaves the network idle while the reader decodes. A
:class:`ParallelStream` reads blocks of ``block_size`` bytes with up to ``in_flight`` ranged GETs
at once, each block a :class:`~wdsllm.storage.resumable.ResumableStream` of its own (retries resume
inside the block at the byte where it broke), and hands the bytes over in order. Every block must
come from the same version of the object (size and ETag compared), and a whole-object read checks
its sha256 at the end as a plain stream does.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from . import versions
from .retry import make_error
from .state import own
from .stores import store_of  # noqa: F401 - where the spools find it (parallel.store_of)
from .urls import redact

#: Bytes per ranged GET, and GETs in flight per stream (``WDSLLM_BLOCK_SIZE``,
#: ``WDSLLM_BLOCKS_IN_FLIGHT`` override them). Objects at most one block long are one plain GET.
BLOCK_SIZE = int(os.environ.get("WDSLLM_BLOCK_SIZE") or 8 << 20)
IN_FLIGHT = int(os.environ.get("WDSLLM_BLOCKS_IN_FLIGHT") or 4)
_READ = 4 << 20  # bytes per readinto of a block (one hop to the event loop)
#: Spools read one block at a time (the next one starting when the current one is half in) while
#: their bytes arrive at least this fast (bytes/s, counted from the first bytes' arrival;
#: ``WDSLLM_SERIAL_RATE``), and ``IN_FLIGHT`` at a time below it: blocks in flight together share
#: the rate, so the one the reader needs next arrives that much slower. A store one connection
#: reads this fast (on the same host or rack) gains nothing from more; one whose connections are
#: capped below it (far, or throttled per connection) does (:class:`BlockQueue`). A slow first
#: byte alone is overlapped by the next block starting while the current one is half in.
SERIAL_RATE = float(os.environ.get("WDSLLM_SERIAL_RATE") or 256e6)
#: Bytes per ranged GET of a spool made once the store measured fast (``WDSLLM_SERIAL_BLOCK_SIZE``):
#: blocks then go one at a time anyway, and each GET costs a request on both ends (figures:
#: docs/benchmarks.md). A block that breaks still resumes at the byte where it broke.
SERIAL_BLOCK_SIZE = int(os.environ.get("WDSLLM_SERIAL_BLOCK_SIZE") or 4 * BLOCK_SIZE)
#: A GET of at most ``BLOCK_SIZE`` / this takes about its request's round trip whatever the store's
#: rate: ``IN_FLIGHT`` of them run at once even where a store measured fast, so that small ranged
#: reads (an epoch's blocks of a shard, side-file chunks) do not wait out one round trip each in turn.
SMALL_GET_SHARE = 4


class Ticket:
    """One queued block: ``run(ticket)`` downloads it, and calls :meth:`half_in` once half of it
    has arrived (the queue then starts the next block, so that its first-byte wait overlaps)."""

    __slots__ = ("busy", "owner", "queue", "run", "small", "store")

    def __init__(
        self, queue: BlockQueue, owner: Any, store: tuple[str, str], run: Callable[[Ticket], None], small: bool
    ) -> None:
        self.queue, self.owner, self.store, self.run, self.small = queue, owner, store, run, small
        self.busy = False

    def half_in(self) -> None:
        self.queue._idle(self)


class StorePace:
    """What a store's spools measured: blocks of it start one at a time (``want`` 1) while it
    sends at least :data:`SERIAL_RATE`, ``IN_FLIGHT`` at a time below."""

    __slots__ = ("busy", "fast", "want")

    def __init__(self) -> None:
        self.want = 1
        self.fast = False  # measured at least SERIAL_RATE by its last spool
        self.busy = 0  # its blocks started and not yet half in


class BlockQueue:
    """The blocks of every spool of this process, started in the order they were queued.

    Spools are made in the order their shards are read, so a first-in-first-out queue gives the
    bytes the reader needs next the whole rate: blocks (and shards) downloading together share
    it. Each store is paced on its own (:class:`StorePace`, by :func:`store_of`): a fast bucket
    and a slow repository in one mixture each get what their own measurement says. At most
    ``limit`` of one owner's blocks run at once.
    """

    def __init__(self, submit: Callable[[Callable[[], None]], Any]) -> None:
        self._submit = submit
        self._lock = threading.Lock()
        self._pending: deque[tuple[Ticket, int]] = deque()
        self._running: dict[Any, int] = {}  # started and not finished, by owner
        self._stores: dict[tuple[str, str], StorePace] = {}

    def pace_of(self, store: tuple[str, str]) -> StorePace:
        with self._lock:
            return self._pace(store)

    def _pace(self, store: tuple[str, str]) -> StorePace:
        pace = self._stores.get(store)
        if pace is None:
            pace = self._stores[store] = StorePace()
        return pace

    def put(
        self, owner: Any, store: tuple[str, str], run: Callable[[Ticket], None], limit: int, size: int | None = None
    ) -> None:
        """Queue a block of ``size`` bytes (None: unknown, paced as a large one)."""
        small = size is not None and size * SMALL_GET_SHARE <= BLOCK_SIZE
        with self._lock:
            self._pending.append((Ticket(self, owner, store, run, small), limit))
            self._start()

    def drop(self, owner: Any) -> list[Ticket]:
        """Remove ``owner``'s blocks that have not started (they never will)."""
        with self._lock:
            mine = [t for t, _ in self._pending if t.owner is owner]
            self._pending = deque((t, n) for t, n in self._pending if t.owner is not owner)
            self._start()
        return mine

    def measured(self, store: tuple[str, str], slow: bool) -> None:
        """A spool of ``store`` measured its rate: below SERIAL_RATE (``slow``) or not."""
        with self._lock:
            pace = self._pace(store)
            pace.want = IN_FLIGHT if slow else 1
            pace.fast = not slow
            self._start()

    def idle(self) -> bool:
        """Whether no block waits or runs."""
        with self._lock:
            return not self._pending and not self._running

    def _start(self) -> None:
        """Start queued blocks in order while their store has fewer than it wants busy (the
        caller holds the lock)."""
        running = sum(self._running.values())
        while self._pending and running < 2 * IN_FLIGHT:
            ticket, limit = self._pending[0]
            pace = self._pace(ticket.store)
            want = IN_FLIGHT if ticket.small else pace.want
            if pace.busy >= want or self._running.get(ticket.owner, 0) >= limit:
                return  # in order: the next block waits for its store's or its spool's
            self._pending.popleft()
            ticket.busy = True
            pace.busy += 1
            self._running[ticket.owner] = self._running.get(ticket.owner, 0) + 1
            running += 1
            self._submit(partial(self._run, ticket))

    def _run(self, ticket: Ticket) -> None:
        try:
            ticket.run(ticket)
        finally:
            self._idle(ticket)
            with self._lock:
                left = self._running[ticket.owner] - 1
                if left:
                    self._running[ticket.owner] = left
                else:
                    del self._running[ticket.owner]
                self._start()

    def _idle(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.busy:
                ticket.busy = False
                self._pace(ticket.store).busy -= 1
                self._start()


_READER_NAME = "wdsllm-block"


class BlockReaders:
    """The process's block reader threads and its :class:`BlockQueue` (made on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._queue: BlockQueue | None = None

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=4 * IN_FLIGHT, thread_name_prefix=_READER_NAME)
            return self._pool

    def queue(self) -> BlockQueue:
        with self._lock:
            if self._queue is None:
                self._queue = BlockQueue(self._submit)
            return self._queue

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on a reader thread (on a new pool where :meth:`stop_threads` just
        stopped the one this asked first)."""
        while True:
            pool = self.executor()
            try:
                return pool.submit(fn, *args)
            except RuntimeError:  # shut down between the two lines above
                with self._lock:
                    if self._pool is pool:
                        self._pool = None

    def _submit(self, run: Callable[[], None]) -> None:
        self.submit(run)

    def idle(self) -> bool:
        with self._lock:
            queue = self._queue
        return queue is None or queue.idle()

    def stop_threads(self) -> None:
        """Stop the reader threads once their blocks end (closed spools end theirs at once; a
        stalled read within its timeout). Measured paces are kept; a later block starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            # a reader thread (a loader collected there) cannot wait for itself: the others end alone
            pool.shutdown(wait=not threading.current_thread().name.startswith(_READER_NAME))

    def reset(self) -> None:
        self.stop_threads()
        with self._lock:
            self._queue = None

    def after_fork(self) -> None:
        """The parent's threads do not exist in a forked child: a new pool on first use."""
        self._lock = threading.Lock()
        self._pool, self._queue = None, None


READERS = own("block readers", BlockReaders())


def block_queue() -> BlockQueue:
    """The process's queue of spool blocks."""
    return READERS.queue()


class _Block:
    """One block's bytes, how many arrived, and the error that stopped it (if any)."""

    __slots__ = ("data", "error", "etag", "got", "total")

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.got = 0
        self.error: BaseException | None = None
        self.etag: str | None = None
        self.total: int | None = None


class ParallelStream(io.RawIOBase):
    """Bytes ``[start, end)`` of ``url``, read ``in_flight`` blocks at a time.

    ``open_block(offset, length)`` returns a stream of exactly that range (a resumable stream: it
    retries and resumes on its own) whose ``etag`` and ``total`` say which object answered.
    """

    def __init__(
        self,
        url: str,
        open_block: Callable[[int, int], Any],
        start: int,
        end: int,
        *,
        block_size: int = BLOCK_SIZE,
        in_flight: int = IN_FLIGHT,
        expected_sha256: str | None = None,
    ) -> None:
        super().__init__()
        self.name = redact(url)
        self._open_block = open_block
        self._pos = start
        self._end = end
        self._block_size = max(1, block_size)
        self._in_flight = max(1, in_flight)
        self._next = start  # first byte not yet requested
        self._pending: deque[tuple[int, Future]] = deque()
        self._current: _Block | None = None
        self._offset = 0  # read position inside the current block
        self._stop = threading.Event()
        self._etag: str | None = None
        self._total: int | None = None
        self._hasher = hashlib.sha256() if expected_sha256 and start == 0 else None
        self._expected_sha256 = expected_sha256.lower() if expected_sha256 else None
        self._error: BaseException | None = None
        self._fill()

    def _fill(self) -> None:
        while len(self._pending) < self._in_flight and self._next < self._end:
            length = min(self._block_size, self._end - self._next)
            future = READERS.submit(self._fetch, self._next, length, self._stop)
            self._pending.append((self._next, future))
            self._next += length

    def _fetch(self, offset: int, length: int, stop: threading.Event) -> _Block:
        block = _Block(length)
        if stop.is_set():
            block.error = make_error(self.name, "stream closed")
            return block
        view = memoryview(block.data)
        try:
            stream = self._open_block(offset, length)
            try:
                while block.got < length and not stop.is_set():
                    n = stream.readinto(view[block.got : block.got + _READ])
                    if not n:
                        break
                    block.got += n
                raw = getattr(stream, "raw", stream)
                block.etag, block.total = getattr(raw, "_etag", None), getattr(raw, "_total", None)
            finally:
                stream.close()
            ended = block.total is not None and offset + block.got >= block.total  # a range past the end
            if block.got < length and not stop.is_set() and not ended:
                raise make_error(self.name, f"block at byte {offset} ended after {block.got} of {length} bytes")
        except BaseException as exc:
            block.error = exc
        return block

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
        if not len(view):
            return 0
        if self._current is None:
            if not self._pending:
                return self._finish()
            _, future = self._pending.popleft()
            self._current, self._offset = future.result(), 0
            self._check(self._current)
            self._fill()
        block = self._current
        n = min(len(view), block.got - self._offset)
        if n <= 0:  # the block is used up short of its size: an error, or the object's end
            self._current = None
            if block.error is not None:
                self._error = block.error
                raise block.error
            self._stop.set()
            self._pending.clear()
            return self._finish()
        view[:n] = block.data[self._offset : self._offset + n]
        if self._hasher is not None:
            self._hasher.update(view[:n])
        self._offset += n
        self._pos += n
        if self._offset == len(block.data):
            self._current = None
        return n

    def _check(self, block: _Block) -> None:
        """Every block must come from one version of the object."""
        if block.etag:
            if self._etag and block.etag != self._etag:
                self._stop.set()
                self._error = versions.changed(self.name, self._etag, block.etag)
                raise self._error
            self._etag = block.etag
        if block.total is not None:
            if self._total is not None and block.total != self._total:
                self._stop.set()
                self._error = make_error(self.name, f"object size changed from {self._total} to {block.total}")
                raise self._error
            self._total = block.total

    def _finish(self) -> int:
        if self._hasher is not None:
            digest, self._hasher = self._hasher.hexdigest(), None
            if digest != self._expected_sha256:
                self._error = make_error(
                    self.name, f"sha256 {digest} does not match the expected {self._expected_sha256}"
                )
                raise self._error
        return 0

    def close(self) -> None:
        if not self.closed:
            self._stop.set()
            for _, future in self._pending:
                future.cancel()
            self._pending.clear()
            self._current = None
        super().close()
