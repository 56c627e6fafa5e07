"""A remote object's byte range downloaded into one mapping, read in place as it arrives.

Readers see a :class:`SpooledRange`; a :class:`Spool` is one filled by this process's block
reader threads. :mod:`.prefetch` schedules spools and :mod:`.offload` fills them in a fetch
process: both build on this module, which imports neither.
"""

from __future__ import annotations

import io
import logging
import mmap
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, BinaryIO

from . import versions
from .backends import CHUNK_SIZE
from .resumable import open_stream

log = logging.getLogger(__name__)

#: A spool's store is judged fast or slow once this many bytes have arrived after the first ones,
#: or this many seconds have passed: enough to see the rate, early enough to pace the rest.
PACE_BYTES = 4 << 20
PACE_SECONDS = 0.05


class SpooledRange(io.RawIOBase):
    """A remote object's bytes ``[offset, end)`` arriving in ``mm`` at their offsets in the object,
    read in place (as a mapped local shard is) once :meth:`wait` says they are there.

    What readers see of a :class:`Spool` (downloaded by this process's threads) and of an
    :class:`~wdsllm.storage.offload.OffloadedSpool` (downloaded by a fetch process into shared
    memory). As a stream it reads in order from ``offset``.
    """

    name: str
    offset: int
    end: int
    mm: mmap.mmap
    _pos: int

    def wait(self, upto: int) -> None:
        """Return once the bytes before ``upto`` (clipped to the end) have arrived, or raise the
        error that stopped them."""
        raise NotImplementedError

    def available(self) -> int:
        """Bytes arrived in order from ``offset``."""
        raise NotImplementedError

    @property
    def failed(self) -> bool:
        """Whether an error stopped part of the download."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed stream")
        view = memoryview(b).cast("B")
        if not len(view) or self._pos >= self.end:
            return 0
        self.wait(self._pos + 1)
        n = min(len(view), self.available() - self._pos)
        view[:n] = self.mm[self._pos : self._pos + n]
        self._pos += n
        return n


class Spool(SpooledRange):
    """A remote object's bytes ``[offset, end)`` downloaded into one anonymous mapping, so that a
    reader can use them in place as it uses a mapped local shard.

    The mapping is ``end`` bytes long and the bytes sit at their offsets in the object (pages
    before ``offset`` are never touched and cost nothing), so a reader views a group at its
    offset with no copy, and every group's tokens share one buffer. The range is fetched as blocks
    of ``block_size`` bytes (``open_range(offset, length)`` opens one: a resumable stream), each
    written straight to its place in the mapping. Blocks go through the process's
    :class:`~wdsllm.storage.parallel.BlockQueue` in order (one at a time from a fast store, several
    from a slow one: each store as its own spools measured it), at most ``in_flight`` of this
    spool's at once.
    :meth:`wait` blocks until the bytes up to a position have arrived, or raises the error that
    stopped them; bytes that arrived before an error stay usable. Every block must come from the
    same version of the object (ETag and size compared). ``block_size`` by default:
    ``SERIAL_BLOCK_SIZE`` once the queue found this store fast, else ``BLOCK_SIZE``. Closing stops
    the download; the mapping lives as long as arrays view it, and is then recycled for a later
    spool (:mod:`~wdsllm.storage.mappings`): a closed spool answers no more reads or waits.
    ``mm``: a mapping of at least ``end`` bytes to write into instead (the caller's: not
    recycled).
    """

    def __init__(
        self,
        open_range: Callable[[int, int], BinaryIO],
        offset: int,
        end: int,
        *,
        name: str = "",
        block_size: int | None = None,
        in_flight: int | None = None,
        mm: mmap.mmap | None = None,
    ) -> None:
        super().__init__()
        from . import mappings, parallel

        self.name = name
        self.offset, self.end = offset, end
        self._recycle = mm is None
        self.mm = mappings.take(end) if mm is None else mm
        self._queue = parallel.block_queue()
        self._store = parallel.store_of(name)
        if block_size is None:  # a fast store's blocks go one at a time: fewer, larger GETs
            fast = self._queue.pace_of(self._store).fast
            block_size = parallel.SERIAL_BLOCK_SIZE if fast else parallel.BLOCK_SIZE
        size = max(1, block_size)
        self._blocks = [(o, min(size, end - o)) for o in range(offset, end, size)]
        self._got = [0] * len(self._blocks)
        self._finished = [False] * len(self._blocks)
        self._errors: list[BaseException | None] = [None] * len(self._blocks)
        self._versions: list[tuple[str | None, int | None]] = [(None, None)] * len(self._blocks)
        self._first = 0  # the first block not yet complete
        self._version: tuple[str | None, int | None] = (None, None)
        self._open_range = open_range
        self._pos = offset
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._in_flight = max(1, in_flight or parallel.IN_FLIGHT)
        self._received = 0  # bytes since the first ones arrived
        self._flowing: float | None = None  # when the first bytes arrived
        self._paced = False
        self._next = len(self._blocks)  # every block is queued now, in order
        for i in range(len(self._blocks)):
            self._queue.put(self, self._store, partial(self._fetch, i), self._in_flight, self._blocks[i][1])

    def _pace(self, n: int) -> None:
        """``n`` more bytes arrived: once PACE_BYTES or PACE_SECONDS after the first ones tell, the queue learns
        whether this spool's store sends slower than SERIAL_RATE (the caller holds the condition). The
        first-byte wait does not count: blocks one at a time overlap it (each starts while the one
        before is half in), and larger blocks pay it less often; a slow connection needs several."""
        from . import parallel

        now = time.monotonic()
        if self._flowing is None:
            self._flowing = now
            return
        self._received += n
        elapsed = now - self._flowing
        if not self._paced and (self._received >= PACE_BYTES or elapsed >= PACE_SECONDS):
            self._paced = True
            slow = self._received < parallel.SERIAL_RATE * elapsed
            log.debug(
                "%s: %.0f MB/s: %s store",
                self.name,
                self._received / max(elapsed, 1e-6) / 1e6,
                "a slow" if slow else "a fast",
            )
            self._queue.measured(self._store, slow)

    def _fetch(self, i: int, ticket: Any) -> None:
        offset, length = self._blocks[i]
        error: BaseException | None = None
        try:
            view = memoryview(self.mm)[offset : offset + length]
            try:
                # the view holds the mapping; closed before it did, the mapping may be another spool's
                if not self._stop.is_set():
                    self._download(i, view, ticket)
            finally:
                view.release()
        except BaseException as exc:  # handed to the reader, who decides
            error = exc
        with self._cond:
            self._errors[i] = error
            self._finished[i] = True
            self._cond.notify_all()

    def _download(self, i: int, view: memoryview, ticket: Any) -> None:
        offset, length = self._blocks[i]
        src = self._open_range(offset, length)
        try:
            fill = getattr(src, "readinto1", None) or src.readinto
            got = 0
            while got < length and not self._stop.is_set():
                # small first reads, so the reader starts on the first group while the rest arrives;
                # then up to 4 MiB per read (each is one hop to the client's event loop)
                n = fill(view[got : min(length, got + min(4 * CHUNK_SIZE, max(CHUNK_SIZE // 4, got)))])
                if not n:
                    break
                got += n
                with self._cond:
                    self._got[i] = got
                    self._pace(n)
                    self._cond.notify_all()
                if got * 2 >= length:
                    ticket.half_in()  # the next block starts: its first-byte wait overlaps this tail
            raw = getattr(src, "raw", src)
            self._versions[i] = (getattr(raw, "_etag", None), getattr(raw, "_total", None))
        finally:
            src.close()

    def _filled(self) -> int:
        """Bytes arrived in order from ``offset`` (the caller holds the condition)."""
        while self._first < len(self._blocks) and self._finished[self._first] and not self._errors[self._first]:
            offset, length = self._blocks[self._first]
            if self._got[self._first] < length:
                break
            self._check(self._versions[self._first])
            self._first += 1
        if self._first == len(self._blocks):
            return self.end
        offset, _ = self._blocks[self._first]
        return offset + self._got[self._first]

    def _check(self, version: tuple[str | None, int | None]) -> None:
        from .retry import make_error

        etag, total = version
        known_etag, known_total = self._version
        if etag and known_etag and etag != known_etag:
            raise versions.changed(self.name, known_etag, etag)
        if total is not None and known_total is not None and total != known_total:
            raise make_error(self.name, f"object size changed from {known_total} to {total} during the read")
        self._version = (etag or known_etag, total if total is not None else known_total)

    def wait(self, upto: int) -> None:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed stream")
        upto = min(upto, self.end)
        with self._cond:
            while True:
                filled = self._filled()
                if filled >= upto:
                    return
                i = self._first
                if self._finished[i]:
                    if self._errors[i] is not None:
                        raise self._errors[i]
                    from .retry import make_error

                    raise make_error(self.name, f"the object ended at byte {filled}, expected {self.end}")
                if self._stop.is_set():
                    raise ValueError(f"{self.name}: read from a closed stream")
                self._cond.wait()

    def available(self) -> int:
        with self._cond:
            return self._filled()

    @property
    def failed(self) -> bool:
        with self._cond:
            return any(e is not None for e in self._errors)

    def join(self) -> None:
        """Return once no block download runs (after :meth:`close`: nothing writes into the
        mapping any more; a stalled read ends within its timeout)."""
        with self._cond:
            while not all(self._finished[: self._next]):
                self._cond.wait()

    def close(self) -> None:
        if not self.closed:
            from . import mappings

            self._stop.set()
            super().close()
            dropped = len(self._queue.drop(self))  # never started; the ones after them neither
            with self._cond:
                for i in range(len(self._blocks) - dropped, len(self._blocks)):
                    self._finished[i] = True
                self._cond.notify_all()  # a waiter sees the close
            if self._recycle:
                mappings.give(self.mm)  # reused once no array, reader or block download views it


def open_spool_block(url: str, kwargs: dict[str, Any], start: int, size: int) -> BinaryIO:
    """One block of a spool of ``url`` opened with ``kwargs``: one GET, resumed where it breaks
    (the spool schedules its blocks itself)."""
    return open_stream(url, **{**kwargs, "offset": start, "length": size, "one_request": True})
