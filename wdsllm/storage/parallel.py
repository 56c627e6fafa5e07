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
from typing import Any

from .retry import make_error
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
#: blocks then go one at a time anyway, and each GET costs a request on both ends (a 27 MB shard
#: read as 4 GETs of 8 MiB took 37 ms of moto's CPU per epoch and 44 ms of gcsfs's; as one, 12
#: and 22 ms). A block that breaks still resumes at the byte where it broke.
SERIAL_BLOCK_SIZE = int(os.environ.get("WDSLLM_SERIAL_BLOCK_SIZE") or 4 * BLOCK_SIZE)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def executor() -> ThreadPoolExecutor:
    """The process's pool of block readers (made on first use, again in a forked child)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=4 * IN_FLIGHT, thread_name_prefix="wdsllm-block")
        return _pool


class Ticket:
    """One queued block: ``run(ticket)`` downloads it, and calls :meth:`half_in` once half of it
    has arrived (the queue then starts the next block, so that its first-byte wait overlaps)."""

    __slots__ = ("busy", "owner", "queue", "run")

    def __init__(self, queue: BlockQueue, owner: Any, run: Callable[[Ticket], None]) -> None:
        self.queue, self.owner, self.run = queue, owner, run
        self.busy = False

    def half_in(self) -> None:
        self.queue._idle(self)


class BlockQueue:
    """The blocks of every spool of this process, started in the order they were queued.

    Spools are made in the order their shards are read, so a first-in-first-out queue gives the
    bytes the reader needs next the whole rate: blocks (and shards) downloading together share
    it, and with 7 small shards started at once the first one arrived at a seventh of it. Blocks
    start one at a time (a block half in counting as done) while the store is fast, and
    ``IN_FLIGHT`` at a time once a spool has found it slower than :data:`SERIAL_RATE`; at most
    ``limit`` of one owner's blocks run at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[Ticket, int]] = deque()
        self._busy = 0  # started and not yet half in
        self._running: dict[Any, int] = {}  # started and not finished, by owner
        self.want = 1
        self.fast = False  # the last spool measured: at least SERIAL_RATE

    def put(self, owner: Any, run: Callable[[Ticket], None], limit: int) -> None:
        with self._lock:
            self._pending.append((Ticket(self, owner, run), limit))
            self._start()

    def drop(self, owner: Any) -> list[Ticket]:
        """Remove ``owner``'s blocks that have not started (they never will)."""
        with self._lock:
            mine = [t for t, _ in self._pending if t.owner is owner]
            self._pending = deque((t, n) for t, n in self._pending if t.owner is not owner)
            self._start()
        return mine

    def pace(self, slow: bool) -> None:
        """A spool's measured rate: below SERIAL_RATE (``slow``) or not."""
        with self._lock:
            self.want = IN_FLIGHT if slow else 1
            self.fast = not slow
            self._start()

    def _start(self) -> None:
        """Start queued blocks in order while fewer than ``want`` are busy (the caller holds the lock)."""
        running = sum(self._running.values())
        while self._pending and self._busy < self.want and running < 2 * IN_FLIGHT:
            ticket, limit = self._pending[0]
            if self._running.get(ticket.owner, 0) >= limit:
                return  # in order: the next block waits for its spool's
            self._pending.popleft()
            ticket.busy = True
            self._busy += 1
            self._running[ticket.owner] = self._running.get(ticket.owner, 0) + 1
            running += 1
            executor().submit(self._run, ticket)

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
                self._busy -= 1
                self._start()


_queue: BlockQueue | None = None


def block_queue() -> BlockQueue:
    """The process's queue of spool blocks (made on first use, again in a forked child)."""
    global _queue
    with _pool_lock:
        if _queue is None:
            _queue = BlockQueue()
        return _queue


def _after_fork() -> None:
    """The parent's pool threads do not exist in a forked child: make a new pool on first use."""
    global _pool, _pool_lock, _queue
    _pool, _pool_lock, _queue = None, threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork)


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
            future = executor().submit(self._fetch, self._next, length, self._stop)
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
                self._error = make_error(
                    self.name, f"object changed during the read (ETag {self._etag} -> {block.etag})"
                )
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
