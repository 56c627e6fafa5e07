"""Remote shards downloaded by a process of their own (the fetch process), into shared memory.

Receiving through the async clients costs the receiving process's GIL: every socket read goes
through the event loop, the HTTP parser and a copy. A loader that decodes in the training process
itself (``num_workers=0``) then decodes and receives in turns, never at once: on a fast store the
epoch takes the sum of both. Here the downloads run in a fetch process instead, with its own GIL,
and this process only waits for the bytes: a spool's memory is a memfd that both processes map,
and the fetch process reports over a Unix socket how far the bytes have arrived in order, as
:class:`~wdsllm.storage.spool.Spool` does between threads.

The fetch process is a new interpreter (``subprocess``: spawned, never a fork of this process,
which may hold CUDA contexts, NCCL threads and clients' event loops), started the first time a
spool is offloaded. It inherits the environment; every request carries the changes to the
environment since the last one (credentials, endpoints and proxies are read from it) and this
process's log level, and it downloads with the same :class:`~wdsllm.storage.spool.Spool`
(blocks in flight, resumable ranged GETs, version checks). Its errors come back as they were
raised there (a :class:`~wdsllm.errors.StorageError` naming the URL), its log records are handled
by this process's loggers, its counters added to this process's. The shared memory is recycled as
:mod:`~wdsllm.storage.mappings` recycles anonymous mappings: a memfd goes to a later spool once
the fetch process says it writes no more into it and nothing here views it. It exits when its
socket's other end closes: :func:`shutdown` (a loader's ``close()``, :func:`wdsllm.storage.reset`),
or the kernel closing it when this process dies. If it dies first, the spools it was filling fail
with a named error and later spools are downloaded in this process again.

Linux only (memfd, SCM_RIGHTS); elsewhere :func:`offloaded_spool` answers None and the caller
spools in process. ``WDSLLM_FETCH_PROCESS=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from functools import partial

from .backends import backend_for
from .counters import add_stores, count, stats, store_stats, stores_moved
from .mappings import KEEP, KEEP_BYTES
from .retry import make_error
from .spool import Spool, SpooledRange, open_spool_block
from .state import adopt, exported, own

log = logging.getLogger(__name__)

#: The largest message either side sends (one spool's request or report; never data).
_MAX_MESSAGE = 1 << 16

SUPPORTED = all(
    hasattr(mod, name) for mod, name in ((os, "memfd_create"), (socket, "send_fds"), (socket, "SOCK_SEQPACKET"))
)

#: The fetch process's program: this package from where this process imports it, then serve the
#: socket whose descriptor is the first argument.
_CHILD = (
    "import sys; sys.path[:0] = sys.argv[2:]; "
    "from wdsllm.storage.offload import serve_descriptor; serve_descriptor(int(sys.argv[1]))"
)


def enabled() -> bool:
    """Whether spools may be offloaded here (the platform allows it, ``WDSLLM_FETCH_PROCESS`` is
    not ``0``)."""
    return SUPPORTED and os.environ.get("WDSLLM_FETCH_PROCESS", "1").strip().lower() not in ("0", "false", "no")


class OffloadedSpool(SpooledRange):
    """A spool that the fetch process fills: this side maps the same memory and waits."""

    def __init__(self, fetcher: _FetchProcess, sid: int, memory: _Memory, offset: int, end: int, name: str) -> None:
        super().__init__()
        self.name, self.offset, self.end, self.mm = name, offset, end, memory.mm
        self._memory = memory
        self._pos = offset
        self._fetcher, self._sid = fetcher, sid
        self._filled = offset
        self._done = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def _arrived(self, filled: int, done: bool = False, error: BaseException | None = None) -> None:
        """The fetch process's report: bytes up to ``filled`` are there (and, when ``done``, no
        more will come; ``error`` is why, if any)."""
        with self._cond:
            self._filled = max(self._filled, min(filled, self.end))
            if done:
                self._done, self._error = True, error
            self._cond.notify_all()

    def wait(self, upto: int) -> None:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed stream")
        upto = min(upto, self.end)
        with self._cond:
            while self._filled < upto:
                if self._done:
                    if self._error is not None:
                        raise self._error
                    raise make_error(self.name, f"the object ended at byte {self._filled}, expected {self.end}")
                if self.closed:
                    raise ValueError(f"{self.name}: read from a closed stream")
                self._cond.wait()

    def available(self) -> int:
        with self._cond:
            return self._filled

    @property
    def failed(self) -> bool:
        with self._cond:
            return self._error is not None

    def close(self) -> None:
        if not self.closed:
            super().close()
            with self._cond:
                done = self._done
                self._cond.notify_all()
            if not done:
                self._fetcher.cancel(self._sid)
            self._fetcher.give(self._memory)  # reused once the fetch process is done with it and nothing views it


class _Memory:
    """A memfd that this process and the fetch process both map (``mid`` names it to both)."""

    def __init__(self, mid: int, size: int) -> None:
        self.mid = mid
        self.fd = os.memfd_create("wdsllm-spool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.shared = False  # the fetch process has been sent its fd
        self.written = False  # the fetch process may still write into it

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        # the mapping goes with the last array that views it


class _FetchProcess:
    """This process's side of the fetch process: requests out, reports in (one thread)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno()), *_package_path()],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid, self.sock = self.process.pid, ours
        self.environ = dict(os.environ)  # as the fetch process has it
        self.carried = b""  # the last snapshot of carried state sent
        self.spools: dict[int, OffloadedSpool] = {}
        self.writing: dict[int, _Memory] = {}  # by spool: memories the fetch process may write into
        self.idle: list[_Memory] = []  # given back by closed spools, oldest first
        # reentrant: a spool collected while it is held (its last reference dropped here) closes,
        # and closing gives its memory back under this lock
        self.lock = threading.RLock()
        self.ids = itertools.count()
        self.dead: str | None = None
        self.closing = False
        self._thread = threading.Thread(target=self._receive, name="wdsllm-fetch-reports", daemon=True)
        self._thread.start()
        log.debug("started the fetch process %d", self.pid)

    def _carry(self) -> None:
        """Send what this process found that the fetch process would have to find again
        (credentials, commits: :func:`~wdsllm.storage.state.exported`), when it changed."""
        snapshot = pickle.dumps(exported())
        if snapshot == self.carried or len(snapshot) > _MAX_MESSAGE // 2:
            return
        with self.lock:
            self.sock.send(pickle.dumps(("carry", 0, snapshot)))
            self.carried = snapshot

    def spool(self, url: str, kwargs: dict, offset: int, end: int) -> OffloadedSpool:
        self._carry()
        sid = next(self.ids)
        size = max(end, 1)
        environ = dict(os.environ)
        with self.lock:
            changed = {k: v for k, v in environ.items() if self.environ.get(k) != v}
            removed = [k for k in self.environ if k not in environ]
        # raises here when kwargs do not pickle: the caller spools in process, as for a huge one
        level = logging.getLogger("wdsllm").getEffectiveLevel()  # what the fetch process sends back
        job = pickle.dumps((url, kwargs, offset, end, changed, removed, level))
        if len(job) > _MAX_MESSAGE // 2:
            raise ValueError(f"a request of {len(job)} bytes")
        memory = self._take(size)
        spool = OffloadedSpool(self, sid, memory, offset, end, url)
        request = pickle.dumps(("fetch", sid, memory.mid, size, job))
        with self.lock:
            if self.dead:
                memory.discard()
                raise OSError(self.dead)
            self.environ = environ
            self.spools[sid] = spool
            self.writing[sid] = memory
            memory.written = True
            try:
                if memory.shared:
                    self.sock.send(request)
                else:
                    socket.send_fds(self.sock, [request], [memory.fd])
                    memory.shared = True
            except OSError:
                self.spools.pop(sid, None)
                self.writing.pop(sid, None)
                memory.discard()
                raise
        return spool

    def _take(self, size: int) -> _Memory:
        """An idle memory resized to ``size`` (the closest in size first), else a new one."""
        with self.lock:
            for memory in sorted(self.idle, key=lambda m: abs(len(m.mm) - size)):
                if memory.written:
                    continue
                try:
                    memory.mm.resize(size)  # BufferError while an array here views it
                except (BufferError, OSError, SystemError, ValueError):
                    continue
                self.idle.remove(memory)
                return memory
        return _Memory(next(self.ids), size)

    def give(self, memory: _Memory) -> None:
        """Keep ``memory`` for a later spool, within the bounds of :mod:`~wdsllm.storage.mappings`."""
        dropped = []
        with self.lock:
            if self.dead or len(memory.mm) > KEEP_BYTES:
                dropped.append(memory)
            else:
                self.idle.append(memory)
                while len(self.idle) > KEEP or sum(len(m.mm) for m in self.idle) > KEEP_BYTES:
                    dropped.append(self.idle.pop(0))
        for old in dropped:
            self._drop(old)

    def _drop(self, memory: _Memory) -> None:
        if memory.shared and not self.dead:
            with contextlib.suppress(OSError):
                self.sock.send(pickle.dumps(("drop", memory.mid)))
        memory.discard()

    def cancel(self, sid: int) -> None:
        with self.lock:
            if self.spools.pop(sid, None) is None or self.dead:
                return
        with contextlib.suppress(OSError):  # gone: nothing to stop
            self.sock.send(pickle.dumps(("cancel", sid)))

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            kind, sid, filled, delta, stores, error = pickle.loads(data)  # our own child's reports
            for name, n in delta.items():
                count(name, n)
            add_stores(stores)
            if kind == "log":  # a record logged there (a retry, a resume), handled here
                logger = logging.getLogger(error.name)
                if logger.isEnabledFor(error.levelno):
                    logger.handle(error)
                continue
            with self.lock:
                if kind == "free":
                    memory = self.writing.pop(sid, None)
                    if memory is not None:
                        memory.written = False
                    continue
                spool = self.spools.get(sid) if kind == "progress" else self.spools.pop(sid, None)
            if spool is not None:
                spool._arrived(filled, kind == "done", error)
            spool = None  # dropped outside the lock (a spool nothing else holds closes as it goes)
        how = f"exit status {self.process.wait()}"
        with self.lock:
            self.dead = f"the fetch process {self.pid} exited ({how})"
            orphans, self.spools = list(self.spools.values()), {}
            idle, self.idle = self.idle, []
        for memory in idle:
            memory.discard()
        for spool in orphans:
            spool._arrived(spool.offset, True, make_error(spool.name, f"{self.dead} while downloading it"))
        if not self.closing:
            log.warning("%s; remote shards are downloaded in this process from now on", self.dead)

    def close(self, timeout: float = 10.0) -> None:
        """Close our end: the fetch process stops its downloads and exits; wait for it."""
        self.closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the fetch process %d did not exit %.0f s after its socket closed; killed", self.pid, timeout)
            self.process.kill()
            self.process.wait()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def busy(self) -> bool:
        """Whether a spool of this process waits for it."""
        with self.lock:
            return bool(self.spools) and not self.dead

    def forget(self) -> None:
        """In a forked child: the parent's fetch process is not ours. The child's copy of the
        socket is closed (the parent's stays open); nothing is waited for."""
        self.sock.close()


def _package_path() -> list[str]:
    """Where this process imports from (wdsllm first), for the fetch process to import the same."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [package, *(p for p in sys.path if isinstance(p, str) and p)]


def offloadable(url: str) -> bool:
    """Whether the fetch process has ``url``'s backend: the ones this package registers (one that
    the user's code registered exists only in this process, which then spools it itself)."""
    return type(backend_for(url)).__module__.startswith(f"{__package__}.")


class FetchService:
    """This process's fetch process: started on first use, once; none after it could not start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fetcher: _FetchProcess | None = None
        self.unavailable: str | None = None  # why this process could not start one
        self._inherited: list[_FetchProcess] = []  # a forked child's copy of its parent's

    def get(self) -> _FetchProcess | None:
        with self._lock:
            if self.fetcher is None and self.unavailable is None:
                try:
                    self.fetcher = _FetchProcess()
                except OSError as exc:
                    log.warning("cannot start a fetch process (%s); downloading in this process", exc)
                    self.unavailable = str(exc)
            return self.fetcher

    def busy(self) -> bool:
        with self._lock:
            fetcher = self.fetcher
        return fetcher is not None and fetcher.busy()

    def stop(self) -> None:
        """Stop the fetch process, if one runs; a later spool starts another."""
        with self._lock:
            fetcher, self.fetcher = self.fetcher, None
        if fetcher is not None:
            fetcher.close()

    def reset(self) -> None:
        self.stop()
        self.unavailable = None

    def after_fork(self) -> None:
        """A forked child (a DataLoader worker) does not share its parent's fetch process: it
        starts its own if it offloads."""
        self._lock = threading.Lock()
        fetcher, self.fetcher = self.fetcher, None
        if fetcher is not None:
            fetcher.forget()
            self._inherited.append(fetcher)


SERVICE = own("fetch process", FetchService())


def offloaded_spool(url: str, kwargs: dict, offset: int, end: int) -> OffloadedSpool | None:
    """A spool of ``url``'s bytes ``[offset, end)`` (opened with ``open_stream(url, **kwargs)``
    per block) filled by the fetch process, which is started on first use; None where that cannot
    be (not Linux, turned off, a backend the user registered, ``kwargs`` that do not pickle, the
    fetch process gone): the caller spools in this process."""
    if not enabled() or not offloadable(url):
        return None
    fetcher = SERVICE.get()
    if fetcher is None or fetcher.dead:
        return None
    try:
        return fetcher.spool(url, kwargs, offset, end)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError, OSError) as exc:
        log.debug("%s spooled in this process: %s", url, exc)
        return None


def running_pid() -> int | None:
    """The fetch process's id while one runs for this process (tests, tools)."""
    fetcher = SERVICE.fetcher
    return None if fetcher is None or fetcher.dead else fetcher.pid


def shutdown() -> None:
    """Stop the fetch process, if one runs."""
    SERVICE.stop()


# ----------------------------------------------------------------------------------------------
# The fetch process


class _Reports:
    """The fetch process's side of the socket: reports sent whole from any thread, each with the
    storage counters that moved since the last one (the loader's process counts them)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.counted = stats()
        self.stores = store_stats()

    def send(self, kind: str, sid: int, filled: int, error: BaseException | logging.LogRecord | None = None) -> None:
        with self.lock:
            now = stats()
            delta = {k: v - self.counted[k] for k, v in now.items() if v != self.counted[k]}
            self.counted = now
            stores_now = store_stats()
            stores, self.stores = stores_moved(self.stores, stores_now), stores_now
            with contextlib.suppress(OSError):  # the parent is gone; the main loop sees it too
                self.sock.send(pickle.dumps((kind, sid, filled, delta, stores, error)))


class _ForwardLogs(logging.Handler):
    """The fetch process's ``wdsllm`` records, sent to the parent, whose handlers show them (or a
    test's log capture sees them) as if logged there."""

    def __init__(self, reports: _Reports) -> None:
        super().__init__()
        self.reports = reports

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record = copy.copy(record)
            record.msg, record.args = record.getMessage(), None
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
            self.reports.send("log", 0, 0, record)
        except Exception:
            self.handleError(record)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself, else a StorageError with its words."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:
        pass
    from ..errors import StorageError

    return StorageError(f"{type(exc).__name__}: {exc}")


def _report(reports: _Reports, sid: int, spool: Spool, spools: dict[int, Spool]) -> None:
    """Tell the parent how far ``spool``'s bytes have arrived in order, until they all have or an
    error stops them; then, once no download writes into its memory, that it is free."""
    filled, error = spool.offset, None
    try:
        while filled < spool.end:
            spool.wait(filled + 1)
            filled = spool.available()
            reports.send("progress", sid, filled)
    except BaseException as exc:  # the parent's reader raises it where it needs those bytes
        error = exc
        filled = spool.available()
    spools.pop(sid, None)
    reports.send("done", sid, filled, None if error is None else _portable(error))
    spool.close()
    spool.join()
    reports.send("free", sid, filled)


def _serve(sock: socket.socket) -> None:
    """The fetch process: a spool per request, until the parent closes its end."""
    reports = _Reports(sock)
    ours = logging.getLogger("wdsllm")
    ours.handlers, ours.propagate = [_ForwardLogs(reports)], False
    spools: dict[int, Spool] = {}
    memories: dict[int, mmap.mmap] = {}  # the parent's memories, by its names for them
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
        except OSError:
            break
        if not data:
            break
        kind, sid, *args = pickle.loads(data)
        if kind == "carry":
            adopt(pickle.loads(args[0]))
            continue
        if kind == "cancel":
            spool = spools.get(sid)
            if spool is not None:
                spool.close()  # its reporter says done, then free
            continue
        if kind == "drop":
            memories.pop(sid, None)  # a spool still writing holds its own reference
            continue
        mid, size, job = args
        url, kwargs, offset, end, changed, removed, level = pickle.loads(job)
        if ours.level != level:  # setLevel clears every logger's cache: only when it changed
            ours.setLevel(level)
        for key in removed:  # the parent's environment as it is now (credentials, proxies, endpoints)
            os.environ.pop(key, None)
        os.environ.update(changed)
        try:
            try:
                if fds:
                    memories[mid] = mmap.mmap(fds[0], size)
                mm = memories[mid]
                if len(mm) != size:
                    mm.resize(size)  # the parent resized the memfd; nothing here views it (it was free)
            finally:
                for fd in fds:
                    os.close(fd)
            spool = spools[sid] = Spool(partial(open_spool_block, url, kwargs), offset, end, name=url, mm=mm)
        except Exception as exc:  # the reader gets it; the memory was never written
            reports.send("done", sid, offset, _portable(exc))
            reports.send("free", sid, offset)
            continue
        threading.Thread(target=_report, args=(reports, sid, spool, spools), daemon=True).start()
    for spool in list(spools.values()):
        spool.close()


def serve_descriptor(fd: int) -> None:
    """The fetch process's main: serve the socket ``fd``, then exit at once (the downloads it
    closed need not end first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; its closing stops us
    code = 1
    try:
        _serve(socket.socket(fileno=fd))
        code = 0
    finally:
        os._exit(code)
