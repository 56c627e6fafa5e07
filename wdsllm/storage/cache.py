"""The shard cache: a size-bounded, verified local copy of remote shards, shared by a host's processes."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import logging
import os
import re
import threading
import time
from typing import Any, BinaryIO

from .backends import CHUNK_SIZE
from .counters import count, count_store
from .resumable import STREAM_BUFFER, open_stream
from .retry import RetryPolicy, make_error

log = logging.getLogger(__name__)


def _lock(path: str, mode: int) -> int:
    """An fd holding ``flock(mode)`` on ``path``; retried when the file was replaced meanwhile
    (the evictor unlinks lock files of entries it removes)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            st = os.fstat(fd)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            if current is not None and (current.st_ino, current.st_dev) == (st.st_ino, st.st_dev):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _try_lock(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    try:
        current = os.stat(path)
    except FileNotFoundError:
        current = None
    st = os.fstat(fd)
    if current is None or (current.st_ino, current.st_dev) != (st.st_ino, st.st_dev):
        os.close(fd)  # another evictor removed this entry meanwhile
        return None
    return fd


def _safe_basename(url: str) -> str:
    base = url.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)[:80] or "object"


class _CachedFile(io.RawIOBase):
    """A cache entry opened for reading; holds the entry's shared lock until closed."""

    def __init__(self, url: str, file: io.FileIO, lock_fd: int, offset: int, length: int | None) -> None:
        super().__init__()
        self.name = url
        self._file = file
        self._lock_fd: int | None = lock_fd
        size = os.fstat(file.fileno()).st_size
        self._end = size if length is None else min(size, offset + length)
        self._pos = offset
        file.seek(offset)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[: max(0, self._end - self._pos)]
        n = self._file.readinto(view) if len(view) else 0
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._file.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the shared lock
                self._lock_fd = None
        super().close()


class ShardCache:
    """A size-bounded local copy of remote shards, shared by the processes of one host.

    An entry exists only after a complete download that matched ``expected_sha256`` (else
    ``expected_size``, else the object's own length): the download goes to a ``.part`` file and
    is renamed into place when verified. Entries are keyed by URL and expected sha256, so a
    dataset rewritten in place with a new index is never served stale bytes.

    Each entry has a lock file. Readers hold it shared while they read, so any number of workers
    read one entry at once. A reader that finds the entry missing takes the lock exclusively and
    downloads; others wait for that lock and then read the finished file. Eviction removes
    least-recently-used entries (mtime, touched on every hit) until the total is under
    ``max_bytes``, skipping any entry it cannot lock exclusively, that is any being read. An
    entry larger than ``max_bytes`` is still served; the cache is over its limit until that entry
    is closed and a later open evicts it.
    """

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = os.path.abspath(directory)
        self.max_bytes = int(max_bytes)
        os.makedirs(self.directory, exist_ok=True)

    def _paths(self, url: str, expected_sha256: str | None) -> tuple[str, str, str]:
        key = hashlib.sha256(f"{url}\n{(expected_sha256 or '').lower()}".encode()).hexdigest()[:32]
        d = self.directory
        return (
            os.path.join(d, f"{key}-{_safe_basename(url)}"),
            os.path.join(d, f"{key}.lock"),
            # Unique per downloader: even a broken lock could not make two writers share a file.
            os.path.join(d, f"{key}.part.{os.getpid()}.{threading.get_ident()}"),
        )

    def path_for(self, url: str, expected_sha256: str | None = None) -> str:
        """Where the verified copy of ``url`` lives (it may not exist)."""
        return self._paths(url, expected_sha256)[0]

    def open(
        self,
        url: str,
        *,
        offset: int = 0,
        length: int | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> BinaryIO:
        """A stream of the verified local copy of ``url``, downloading it first when missing."""
        data, lock, part = self._paths(url, expected_sha256)
        fd = _lock(lock, fcntl.LOCK_SH)
        try:
            file = self._open_entry(url, data, expected_size, repair=False)
            if file is None:
                os.close(fd)
                fd = -1
                fd = _lock(lock, fcntl.LOCK_EX)
                file = self._open_entry(url, data, expected_size, repair=True)  # downloaded meanwhile?
                if file is None:
                    count("cache_misses")
                    count_store(url, "cache_misses")
                    self.evict(reserve=expected_size or 0)
                    self._download(url, data, part, expected_sha256, expected_size, retry)
                    file = open(data, "rb", buffering=0)  # noqa: SIM115 - owned by _CachedFile
                    self._touch(data)
                else:
                    count("cache_hits")
                    count_store(url, "cache_hits")
                # The file is open before the lock is downgraded, so even an eviction that slips
                # into the downgrade cannot take the bytes away from this reader.
                fcntl.flock(fd, fcntl.LOCK_SH)
            else:
                count("cache_hits")
                count_store(url, "cache_hits")
            # Also on hits: entries that were in use at the last eviction may be free now.
            self.evict()
            raw = _CachedFile(url, file, fd, offset, length)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return io.BufferedReader(raw, buffer_size=STREAM_BUFFER)

    @staticmethod
    def _touch(path: str) -> None:
        now = time.time_ns()  # explicit: file timestamps from the kernel clock are too coarse for LRU
        os.utime(path, ns=(now, now))

    def _open_entry(self, url: str, data: str, expected_size: int | None, repair: bool) -> io.FileIO | None:
        """The entry's file, or None when missing or of the wrong size (removed if ``repair``,
        which the caller may only ask while holding the entry's lock exclusively)."""
        try:
            file = open(data, "rb", buffering=0)  # noqa: SIM115
        except FileNotFoundError:
            return None
        size = os.fstat(file.fileno()).st_size
        if expected_size is not None and size != expected_size:
            file.close()
            if repair:
                log.warning("%s: cached copy is %d bytes, expected %d; downloading again", url, size, expected_size)
                os.unlink(data)
            return None
        self._touch(data)
        return file

    def _download(
        self, url: str, data: str, part: str, sha: str | None, size: int | None, retry: RetryPolicy | None
    ) -> None:
        hasher = hashlib.sha256()
        got = 0
        try:
            with open_stream(url, retry=retry, expected_size=size) as src, open(part, "wb") as out:
                buf = bytearray(CHUNK_SIZE)
                while n := src.readinto(buf):
                    chunk = memoryview(buf)[:n]
                    out.write(chunk)
                    hasher.update(chunk)
                    got += n
                out.flush()
                os.fsync(out.fileno())
            if sha and hasher.hexdigest() != sha.lower():
                raise make_error(
                    url, f"sha256 {hasher.hexdigest()} does not match the expected {sha.lower()}; not cached"
                )
            if size is not None and got != size:
                raise make_error(url, f"downloaded {got} bytes, expected {size}; not cached")
            os.replace(part, data)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            raise
        log.debug("%s: cached %d bytes", url, got)

    def entries(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime_ns) of the complete entries, least recently used first."""
        out = []
        for entry in os.scandir(self.directory):
            if len(entry.name) > 33 and entry.name[32] == "-":
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((entry.path, st.st_size, st.st_mtime_ns))
        out.sort(key=lambda e: (e[2], e[0]))
        return out

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, reserve: int = 0) -> None:
        """Remove LRU entries nobody reads until the total plus ``reserve`` fits ``max_bytes``;
        also remove ``.part`` files left by downloads that died."""
        for entry in os.scandir(self.directory):
            if entry.name[32:38] == ".part.":
                lock = os.path.join(self.directory, entry.name[:32] + ".lock")
                fd = _try_lock(lock)
                if fd is None and os.path.exists(lock):
                    continue  # its download is running
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
                finally:
                    if fd is not None:
                        os.close(fd)
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if total + reserve <= self.max_bytes:
                break
            lock = os.path.join(self.directory, os.path.basename(path)[:32] + ".lock")
            fd = _try_lock(lock)
            if fd is None:
                continue  # being read or downloaded right now
            try:
                os.unlink(path)
                total -= size
                os.unlink(lock)
                log.debug("evicted %s (%d bytes)", path, size)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
