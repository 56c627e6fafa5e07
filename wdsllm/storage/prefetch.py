"""Read-ahead and prefetch: the next shard's latency overlaps the current shard's consumption."""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, BinaryIO, Union

from .backends import CHUNK_SIZE, is_remote
from .parking import PARKING, WarmKey
from .resumable import STREAM_BUFFER, open_stream
from .sharing import SpoolShare
from .spool import Spool, SpooledRange, open_spool_block

log = logging.getLogger(__name__)


_EOF = object()
#: The largest remote read held whole in memory by a :class:`Spool` (``WDSLLM_SPOOL_MAX``, bytes);
#: larger ones stream through a :class:`ReadAhead`.
SPOOL_MAX = int(os.environ.get("WDSLLM_SPOOL_MAX") or 1 << 30)


class ReadAhead(io.RawIOBase):
    """A stream read ahead by a background thread into a bounded queue of chunks.

    ``opener()`` runs in the thread, so opening (and a cache download) overlaps with whatever the
    consumer does meanwhile. At most ``max_chunks`` chunks of ``chunk_size`` bytes wait in memory.
    Errors, opening errors included, are raised by the consumer's next read. Closing stops the
    thread at its next chunk boundary and closes the source.
    """

    def __init__(
        self, opener: Callable[[], BinaryIO], *, name: str = "", chunk_size: int = CHUNK_SIZE, max_chunks: int = 4
    ) -> None:
        super().__init__()
        self.name = name
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_chunks))
        self._stop = threading.Event()
        self._chunk: memoryview = memoryview(b"")
        self._eof = False
        self._error: BaseException | None = None
        self._pos = 0
        # The thread gets the queue and the event, not self: a consumer that drops the stream
        # without closing it lets it be collected, and __del__ -> close() stops the thread.
        self._thread = threading.Thread(
            target=ReadAhead._run,
            args=(opener, chunk_size, self._queue, self._stop),
            name=f"readahead {name}",
            daemon=True,
        )
        self._thread.start()

    @staticmethod
    def _put(q: queue.Queue, stop: threading.Event, item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    @staticmethod
    def _run(opener: Callable[[], BinaryIO], chunk_size: int, q: queue.Queue, stop: threading.Event) -> None:
        try:
            src = opener()
        except BaseException as exc:  # handed to the consumer, who decides
            ReadAhead._put(q, stop, exc)
            return
        # readinto1 hands over what each read got: bytes that arrived before an error reach the
        # consumer ahead of the error (read(n) would drop them with it, and with on_error="skip"
        # that is documents lost that were already downloaded).
        fill = getattr(src, "readinto1", None) or src.readinto
        try:
            while not stop.is_set():
                buf = bytearray(chunk_size)
                view = memoryview(buf)
                got, error = 0, None
                try:
                    while got < chunk_size:
                        n = fill(view[got:])
                        if not n:
                            break
                        got += n
                except BaseException as exc:
                    error = exc
                if got and not ReadAhead._put(q, stop, view[:got]):
                    return
                if error is not None:
                    ReadAhead._put(q, stop, error)
                    return
                if got < chunk_size:
                    ReadAhead._put(q, stop, _EOF)
                    return
        finally:
            try:
                src.close()
            except Exception:  # the consumer already has every byte, or the error that matters
                log.debug("error while closing a read-ahead source", exc_info=True)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed stream")
        if not len(self._chunk):
            if self._error is not None:
                raise self._error  # again: reading on after an error must not look like an end
            if self._eof:
                return 0
            item = self._queue.get()
            if item is _EOF:
                self._eof = True
                return 0
            if isinstance(item, BaseException):
                self._error = item
                raise item
            self._chunk = memoryview(item)
        view = memoryview(b).cast("B")
        n = min(len(view), len(self._chunk))
        view[:n] = self._chunk[:n]
        self._chunk = self._chunk[n:]
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._stop.set()
            while True:  # unblock a thread waiting to put
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._chunk = memoryview(b"")
        super().close()


class _Failed(io.RawIOBase):
    """An object that could not be opened: its error comes out of its first read."""

    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__()
        self.name, self.error = name, error

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        raise self.error


OpenSpec = Union[str, "tuple[str, dict[str, Any]]"]
"""What a prefetcher opens: a URL, or a URL with ``open_stream`` keyword arguments."""


def _url_and_kwargs(item: OpenSpec) -> tuple[str, dict[str, Any]]:
    return (item, {}) if isinstance(item, str) else item


def _byte_range(kwargs: dict[str, Any]) -> tuple[int, int | None]:
    """(first byte, end or None when unknown) of what ``open_stream(**kwargs)`` reads."""
    offset, length = kwargs.get("offset", 0), kwargs.get("length")
    return offset, offset + length if length is not None else kwargs.get("expected_size")


def _open_now(url: str, kwargs: dict[str, Any]) -> BinaryIO:
    """A stream opened here, its error raised where it is read, not while another one is."""
    try:
        return open_stream(url, **kwargs)
    except Exception as exc:
        return _Failed(url, exc)


def _open_read_ahead(url: str, kwargs: dict[str, Any]) -> BinaryIO:
    return open_stream(url, **kwargs)


@dataclass(frozen=True)
class PrefetchOptions:
    """How far ahead a :class:`Prefetcher` opens, and how.

    ``depth``: remote objects started behind the current one. ``chunk_size``, ``max_chunks``: a
    :class:`ReadAhead`'s bound. ``spool``: remote objects of known size read whole into a
    :class:`Spool`. ``ahead_bytes``, ``max_depth``: more objects of known size started while
    those behind the current one hold at most that many bytes (small shards are read faster than
    one request's latency). ``offload``: spools filled by the fetch process where one can run.
    """

    depth: int = 1
    chunk_size: int = CHUNK_SIZE
    max_chunks: int = 4
    spool: bool = False
    ahead_bytes: int = 0
    max_depth: int = 8
    offload: bool = False

    @property
    def started(self) -> int:
        """Objects started at once whatever their size: the current one and ``depth`` behind it."""
        return max(self.depth, 0) + 1

    @property
    def most(self) -> int:
        """The most objects started and not yet handed out, warmed ones included."""
        return self.started + self.max_depth

    def spooled(self, url: str, kwargs: dict[str, Any]) -> bool:
        """Whether ``url`` is read whole into a spool (remote, of known size, no cache)."""
        if not self.spool or not is_remote(url) or self.depth <= 0 or kwargs.get("cache") is not None:
            return False
        offset, end = _byte_range(kwargs)
        return end is not None and end - offset <= SPOOL_MAX

    def open(self, item: OpenSpec, owner: WarmKey) -> BinaryIO:
        """``item``'s stream, started: a spool (one parked for ``owner``, or filled by the fetch
        process, or by this process), a read-ahead, or a plain stream for local objects."""
        url, kwargs = _url_and_kwargs(item)
        if not is_remote(url) or self.depth <= 0:
            return _open_now(url, kwargs)
        if not self.spooled(url, kwargs):
            ahead = ReadAhead(
                partial(_open_read_ahead, url, kwargs),
                name=url,
                chunk_size=self.chunk_size,
                max_chunks=self.max_chunks,
            )
            return io.BufferedReader(ahead, buffer_size=STREAM_BUFFER)
        adopted = PARKING.adopt(owner, url, kwargs)
        if adopted is not None:
            return adopted
        offset, end = _byte_range(kwargs)
        if self.offload:
            from .offload import offloaded_spool

            offloaded = offloaded_spool(url, kwargs, offset, end)
            if offloaded is not None:
                return offloaded  # type: ignore[return-value]
        return Spool(partial(open_spool_block, url, kwargs), offset, end, name=url)  # type: ignore[return-value,arg-type]


def size_ahead(item: OpenSpec) -> int | None:
    """The bytes a remote object holds while it waits its turn (None: unknown, or local)."""
    url, kwargs = _url_and_kwargs(item)
    if not is_remote(url):
        return None  # opened when its turn comes: nothing to hide
    offset, end = _byte_range(kwargs)
    return None if end is None else end - offset


@dataclass
class _Started:
    """A stream started ahead of its turn, with what it was opened for and the bytes it holds."""

    stream: BinaryIO
    size: int | None
    url: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)


class Prefetcher(Iterator[BinaryIO]):
    """Streams of the given objects in order, remote ones started ahead (:func:`prefetch_iter`).

    A yielded stream belongs to the consumer until it asks for the next one; then it is closed.
    :meth:`close` (also when the prefetcher is collected) closes every stream it started and
    parks the warmed ones for ``owner``.
    """

    def __init__(
        self,
        items: Iterable[OpenSpec],
        options: PrefetchOptions,
        owner: WarmKey | None = None,
        shared: Collection[str] = (),
    ) -> None:
        from .helpers import use

        self.options = options
        #: objects read whole by several of the items: one spool, a view each, held to the end
        self._shared = frozenset(shared)
        self._shares: dict[str, SpoolShare] = {}
        self.owner = WarmKey() if owner is None else owner
        use(self.owner.loader)
        self._items = iter(items)
        self._held: list[OpenSpec] = []  # the next item, taken to learn its size but not started
        self._pending: collections.deque[_Started] = collections.deque()
        self._current: BinaryIO | None = None
        self._to_warm: list[OpenSpec] = []  # the next pass's first items, not started yet
        self._warmed: list[_Started] = []
        self._pass: int | None = None  # the parking's number of this pass, once it began
        self._closed = False
        self.all_started = False  # every item has started

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> BinaryIO:
        if self._closed:
            raise StopIteration
        if self._pass is None:
            self._pass = PARKING.begin()
        if self._current is not None:
            current, self._current = self._current, None
            current.close()
        self._fill()
        self._warm()
        if not self._pending:
            self.close()
            raise StopIteration
        self._current = self._pending.popleft().stream
        return self._current

    def warm(self, items: Iterable[OpenSpec]) -> None:
        """Once every item of this pass has started, start these (what the next pass will likely
        read first) within the same bytes ahead, and park them for the owner when this pass ends:
        the owner's next pass adopts a parked spool when it opens the same object with the same
        arguments. Only spooled objects are warmed, from the first on, up to the first that is not.
        At most :attr:`PrefetchOptions.most` items are taken, here and now; an error taking them
        stops the warming, not this pass."""
        try:
            taken = list(itertools.islice(items, self.options.most))
        except Exception as exc:
            log.debug("not warming the next pass: %s", exc)
            taken = []
        for n, item in enumerate(taken):
            if not self.options.spooled(*_url_and_kwargs(item)) or size_ahead(item) is None:
                taken = taken[:n]  # the next pass opens it, and what follows it, when its turn comes
                break
        self._to_warm = []
        for item in taken:  # an object that several items read whole is started once
            if item not in self._to_warm:
                self._to_warm.append(item)
        if self._pass is not None:
            self._warm()

    def _fits(self, size: int | None) -> bool:
        """Whether one more object of ``size`` may start: ``started`` in all are started at once,
        more while those behind the current one hold at most ``ahead_bytes``."""
        if len(self._pending) + len(self._warmed) < self.options.started:
            return True
        behind = [s.size for s in list(self._pending)[1:]] + [w.size for w in self._warmed]
        if size is None or None in behind:
            return False
        return sum(behind) + size <= self.options.ahead_bytes  # type: ignore[arg-type]

    def _fill(self) -> None:
        """The one to yield now, ``depth`` started behind it, and more while they fit."""
        while len(self._pending) < self.options.most:
            item = self._held.pop() if self._held else next(self._items, _EOF)
            if item is _EOF:
                self.all_started = True
                return
            url = _url_and_kwargs(item)[0]  # type: ignore[arg-type]
            size = 0 if url in self._shares else size_ahead(item)  # type: ignore[arg-type]
            if not self._fits(size):
                self._held.append(item)  # type: ignore[arg-type]
                return
            self._pending.append(_Started(self._open(item), size))  # type: ignore[arg-type]

    def _open(self, item: OpenSpec) -> BinaryIO:
        """``item``'s stream: a view of its object's shared spool where several items read it."""
        url, kwargs = _url_and_kwargs(item)
        if url not in self._shared:
            return self.options.open(item, self.owner)
        share = self._shares.get(url)
        if share is None:
            spool = self.options.open(item, self.owner)
            if not isinstance(spool, SpooledRange):  # not spooled, or an error to raise where it is read
                return spool
            share = self._shares[url] = SpoolShare(spool, kwargs)
        return share.view()  # type: ignore[return-value]

    def _warm(self) -> None:
        """After the last item started: the next pass's first items, while they fit. A guess:
        what fails here stops the warming, not this pass; the next pass meets it again if real."""
        while self.all_started and self._to_warm and len(self._pending) + len(self._warmed) < self.options.most:
            item = self._to_warm[0]
            share = self._shares.get(_url_and_kwargs(item)[0])
            if share is not None and share.kwargs == _url_and_kwargs(item)[1]:
                share.kept = True  # parked for the next pass when this one ends: nothing to download
                self._to_warm.pop(0)
                continue
            size = size_ahead(item)
            if not self._fits(size):
                return
            url, kwargs = _url_and_kwargs(item)
            try:
                stream = self.options.open(item, self.owner)
            except Exception as exc:
                log.debug("not starting the next pass's first objects: %s", exc)
                self._to_warm = []
                return
            self._to_warm.pop(0)
            self._warmed.append(_Started(stream, size, url, kwargs))

    def close(self) -> None:
        """Close every stream started and not handed over; park the warmed ones."""
        if self._closed:
            return
        self._closed = True
        if self._current is not None:
            self._current.close()
            self._current = None
        for started in self._pending:
            started.stream.close()
        self._pending.clear()
        shares, self._shares = self._shares, {}
        if self._pass is None:
            for share in shares.values():
                share.close()
            return
        PARKING.end(self.owner, self._pass)
        for url, share in shares.items():
            if share.kept:
                PARKING.park(self.owner, url, share.kwargs, share.hand_over())
            else:
                share.close()
        for warmed in self._warmed:
            PARKING.park(self.owner, warmed.url, warmed.kwargs, warmed.stream)
        self._warmed = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit, modules may be gone already
            self.close()


def prefetch_iter(
    urls_and_kwargs: Iterable[OpenSpec],
    depth: int = 1,
    *,
    chunk_size: int = CHUNK_SIZE,
    max_chunks: int = 4,
    spool: bool = False,
    ahead_bytes: int = 0,
    max_depth: int = 8,
    offload: bool = False,
    then: Iterable[OpenSpec] = (),
    owner: WarmKey | None = None,
    shared: Collection[str] = (),
) -> Prefetcher:
    """Streams of the given objects in order, each remote one started ``depth`` shards early.

    Items are URLs or ``(url, open_stream keyword arguments)``. Remote objects are read through
    :class:`ReadAhead`, so while the consumer reads one shard the next ``depth`` are being opened
    (downloaded into the cache, when one is given) and read ahead by at most
    ``max_chunks * chunk_size`` bytes each. Local files and pipes open at once and need no thread.
    With ``spool``, a remote object whose size is known (``expected_size`` or ``length``) is read
    whole into a :class:`Spool` instead, which a reader can use in place like a mapped shard.
    ``ahead_bytes``, ``max_depth``, ``offload``: :class:`PrefetchOptions`. ``then``: the next
    pass's first objects, warmed for ``owner`` (:meth:`Prefetcher.warm`). ``shared``: objects
    that several items read whole: each is spooled once, each item gets a view of that spool
    (:mod:`~wdsllm.storage.sharing`), and the spool is held until the prefetcher closes.
    """
    options = PrefetchOptions(depth, chunk_size, max_chunks, spool, ahead_bytes, max_depth, offload)
    prefetcher = Prefetcher(urls_and_kwargs, options, owner, shared)
    if then:
        prefetcher.warm(then)
    return prefetcher
