"""Side files as arrays that every process of a node shares: memory-mapped, read in ranges, each
range checked against the index once per process.

lengths.npy of a billion documents is 4 GB. Reading it whole, hashing it and widening it in every
rank and worker is what made start-up grow with the corpus, so a side file is opened here as a
read-only map (the page cache's pages: forked workers share them, nothing is copied) and read in
ranges: ``read(a, b)`` copies just those elements out (with ``pread``, so that a pass over the
whole file never becomes the process's resident memory), after checking the chunks of the file
that hold them against the index's chunk digests (format 4; a version without them checks the
whole file's sha256 once, streamed). A remote side file is read through the shard cache when
there is one (downloaded and checked once per node, then mapped), else into memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from ..errors import FormatError
from .index import CHUNK_BYTES, SideFile, chunk_digest

#: bytes read at a time by passes (whole-file checks, ``chunks``)
READ_BYTES = 1 << 24


class SideArray:
    """A 1-D .npy side file, checked against its index reference as it is read."""

    def __init__(
        self, url: str, ref: SideFile, *, path: str | None = None, data: bytes | None = None, check: bool = True
    ):
        """``path``: a local copy to map (``data``: the bytes, for a remote file read whole).
        ``check=False`` reads without checking against ``ref`` (``wdsllm verify``, which reports
        differences instead of raising)."""
        self.url = url
        self.ref = ref
        self.path = path
        self._data = data
        self._fd: int | None = None
        self._map: np.memmap | None = None
        self._identity: tuple | None = None
        size = self._size()
        self.size = size
        if size != ref.bytes and check:
            raise FormatError(f"{url}: {size} bytes, index.json says {ref.bytes}")
        self._checked = bytearray(len(ref.chunks)) if ref.chunks else bytearray(1)
        self._whole_checked = not check
        head = bytes(self._read_bytes(0, min(size, 12)))
        small = head[6:7] == b"\x01"  # .npy 1.0: a 2-byte header length, else 4 bytes
        hlen = int.from_bytes(head[8:10], "little") + 10 if small else int.from_bytes(head[8:12], "little") + 12
        self.dtype, self.count, self.offset = _npy_header(self._read_bytes(0, min(size, hlen)), url)
        if self.offset + self.count * self.dtype.itemsize != size and check:
            raise FormatError(f"{url}: .npy payload is {size - self.offset} bytes, header says {self.count} values")
        if ref.chunks:
            self._check_bytes(0, min(size, self.offset + 1))  # the header is in chunk 0

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, root: str, ref: SideFile, *, retry: Any = None, cache: Any = None, check: bool = True) -> SideArray:
        """The side file ``ref`` of the dataset at ``root``."""
        from .. import storage

        url = storage.join_url(root, ref.name)
        if storage.scheme_of(url) == "file" and not url.startswith("pipe:"):
            path = storage.local_path(url) if url.startswith("file://") else url
            if not os.path.isfile(path):
                raise storage.NotFoundError(f"{url}: no such file", url=url, reason="no such file")
            return cls(url, ref, path=path, check=check)
        if cache is not None and storage.is_remote(url):
            # the cache downloads it once per node, checked against the sha256, then it is mapped
            with storage.open_stream(
                url, retry=retry, cache=cache, expected_sha256=ref.sha256, expected_size=ref.bytes
            ):
                path = cache.path_for(url, ref.sha256)
            side = cls(url, ref, path=path)
            side._whole_checked = True
            return side
        data = ref.check(storage.read_bytes(url, retry=retry), url)
        side = cls(url, ref, data=data)
        side._whole_checked = True
        return side

    def _size(self) -> int:
        if self._data is not None:
            return len(self._data)
        # Opened now, not at the first read: the file read is the one described here, even when
        # its path is replaced or touched meanwhile (the shard cache touches entries it serves,
        # for LRU, from other processes). A forked worker inherits the descriptor.
        self._fd = os.open(self.path, os.O_RDONLY)
        st = os.fstat(self._fd)
        self._identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return st.st_size

    def _file(self) -> int:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDONLY)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._identity:
                os.close(fd)
                raise FormatError(f"{self.url} changed after it was opened; replace side files atomically")
            self._fd = fd
        return self._fd

    def __getstate__(self) -> dict:
        # a spawned worker maps the file again (and keeps what was checked when it is the same file)
        state = dict(self.__dict__)
        state["_fd"] = state["_map"] = None
        return state

    def __del__(self, _close: Any = os.close) -> None:
        # os.close bound now: at interpreter exit the module's globals may already be gone
        if getattr(self, "_fd", None) is not None:
            _close(self._fd)

    # -- reading ----------------------------------------------------------------------------
    def _read_bytes(self, a: int, b: int) -> bytes | memoryview:
        """Bytes [a, b) of the file: a view of in-memory data, else a fresh buffer (pread)."""
        if self._data is not None:
            return memoryview(self._data)[a:b]
        out = bytearray(b - a)
        if b > a and os.preadv(self._file(), [out], a) != b - a:
            raise FormatError(f"{self.url}: ends before byte {b} (truncated after it was opened)")
        return out

    def _check_bytes(self, a: int, b: int) -> None:
        """Check the chunks holding bytes [a, b) (each once per process)."""
        ref = self.ref
        if self._whole_checked or b <= a:
            return
        if not ref.chunks:
            self._check_whole()
            return
        size = ref.chunk_bytes
        for c in range(a // size, (b - 1) // size + 1):
            if not self._checked[c]:
                self._check_chunk(c, self._read_bytes(c * size, min(ref.bytes, (c + 1) * size)))

    def _check_chunk(self, c: int, data: bytes | memoryview) -> None:
        """Chunk ``c`` of the file, whose bytes are ``data``, against its digest in the index."""
        if chunk_digest(data) != self.ref.chunks[c]:
            lo = c * self.ref.chunk_bytes
            raise FormatError(
                f"{self.url}: bytes {lo}-{lo + len(data)} do not match their digest in index.json (the file was "
                "changed or corrupted); `wdsllm verify` checks the whole dataset"
            )
        self._checked[c] = 1

    def _check_whole(self) -> None:
        """A side file without chunk digests (format 1 and 2): its sha256, streamed, once."""
        h = hashlib.sha256()
        for a in range(0, self.ref.bytes, READ_BYTES):
            h.update(self._read_bytes(a, min(self.ref.bytes, a + READ_BYTES)))
        if h.hexdigest() != self.ref.sha256:
            raise FormatError(f"{self.url} does not match its checksum in index.json")
        self._whole_checked = True

    def read(self, a: int, b: int, *, check: bool = True) -> np.ndarray:
        """Elements [a, b) (clipped to the array), copied out and checked (``check=False``: the
        caller checks them later with ``check_range`` before it acts on them)."""
        a, b = max(0, int(a)), min(self.count, int(b))
        if b <= a:
            return np.zeros(0, self.dtype)
        size = self.dtype.itemsize
        lo, hi = self.offset + a * size, self.offset + b * size
        if check:
            self._check_bytes(lo, hi)
        data = self._read_bytes(lo, hi)
        return np.frombuffer(bytearray(data) if self._data is not None else data, self.dtype)

    def range_sums(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The int64 sum of elements [a[i], b[i]) for every i, read unchecked (the caller checks
        them with ``check_range`` before it acts on them): one read a range into one buffer."""
        sums = np.zeros(len(a), np.int64)
        size = self.dtype.itemsize
        if self._data is not None:
            values = np.frombuffer(self._data, self.dtype, self.count, self.offset)
            for i, (lo, hi) in enumerate(zip(np.asarray(a).tolist(), np.asarray(b).tolist())):
                sums[i] = values[lo:hi].sum(dtype=np.int64)
            return sums
        fd = self._file()
        widest = int(np.max(np.asarray(b) - np.asarray(a), initial=0))
        buffer = bytearray(widest * size)
        view = memoryview(buffer)
        ranges = [(lo, hi) for lo, hi in zip(np.asarray(a).tolist(), np.asarray(b).tolist())]
        if hasattr(os, "posix_fadvise"):
            # ranges scattered over a file of gigabytes, not yet in the page cache: ask for all of
            # them first, so the disk reads them in parallel rather than one wait per range
            for lo, hi in ranges:
                if hi > lo:
                    os.posix_fadvise(fd, self.offset + lo * size, (hi - lo) * size, os.POSIX_FADV_WILLNEED)
        for i, (lo, hi) in enumerate(ranges):
            if hi <= lo:
                continue
            got = os.preadv(fd, [view[: (hi - lo) * size]], self.offset + lo * size)
            if got != (hi - lo) * size:
                raise FormatError(f"{self.url}: ends before element {hi} (truncated after it was opened)")
            sums[i] = np.frombuffer(buffer, self.dtype, hi - lo).sum(dtype=np.int64)
        return sums

    def check_range(self, a: int, b: int) -> None:
        """Check elements [a, b) against the index (FormatError if they differ)."""
        a, b = max(0, int(a)), min(self.count, int(b))
        size = self.dtype.itemsize
        self._check_bytes(self.offset + a * size, self.offset + b * size)

    def chunks(self, a: int = 0, b: int | None = None, step: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(first element, elements) over [a, b) in pieces of ``step`` elements: a pass whose memory
        is one piece, whatever the file's size."""
        b = self.count if b is None else min(self.count, b)
        step = step or max(1, READ_BYTES // self.dtype.itemsize)
        for lo in range(a, b, step):
            yield lo, self.read(lo, min(b, lo + step))

    def scan(self, a: int = 0, b: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(first element, elements) over [a, b), checked, for a pass that only looks at them: the
        file is mapped whole chunks at a time (no copy: a pass over gigabytes costs the page
        cache's pages, one window of them at a time in the process's memory), each chunk checked
        from the bytes just mapped (once per process). A step's elements are valid until the next
        step."""
        a, b = max(0, int(a)), self.count if b is None else min(self.count, int(b))
        if b <= a:
            return
        size = self.dtype.itemsize
        lo, hi = self.offset + a * size, self.offset + b * size
        if self._data is not None or not self.ref.chunks:  # in memory, or checked whole at once
            self._check_bytes(lo, hi)
            for first in range(a, b, max(1, READ_BYTES // size)):
                last = min(b, first + max(1, READ_BYTES // size))
                yield first, self.read(first, last, check=False)
            return
        step = self.ref.chunk_bytes
        span = step * max(1, READ_BYTES // step)
        start, stop = lo // step * step, min(self.size, -(-hi // step) * step)  # the chunks holding [lo, hi)
        for at in range(start, hi, span):
            end = min(at + span, stop)
            got = self._window(at, end)
            for c in range(at // step, -(-end // step)):
                if not self._checked[c]:
                    self._check_chunk(c, got[c * step - at : min(end, (c + 1) * step) - at])
            first, last = max(lo, at), min(hi, end)
            yield (first - self.offset) // size, np.frombuffer(got[first - at : last - at], self.dtype)

    def _window(self, a: int, b: int) -> memoryview:
        """Bytes [a, b) of the file, mapped read-only (unmapped once nothing views them)."""
        fd = self._file()
        if os.fstat(fd).st_size < b:  # a map past the end would fault (SIGBUS) where it is read
            raise FormatError(f"{self.url}: ends before byte {b} (truncated after it was opened)")
        base = a - a % mmap.ALLOCATIONGRANULARITY
        return memoryview(mmap.mmap(fd, b - base, access=mmap.ACCESS_READ, offset=base))[a - base :]

    def digests(self) -> tuple[int, str, list[str]]:
        """(size, sha256, chunk digests) of the file as it is, in one pass of bounded memory."""
        h = hashlib.sha256()
        chunks = []
        step = self.ref.chunk_bytes
        for a in range(0, self.size, step):
            data = self._read_bytes(a, min(self.size, a + step))
            h.update(data)
            chunks.append(chunk_digest(data))
        return self.size, h.hexdigest(), chunks

    def check_all(self) -> None:
        """Check the whole file now (a pass over it, in pieces)."""
        for _ in self.chunks():
            pass

    def array(self) -> np.ndarray:
        """The whole array, read-only, as a memory map of the file (in-memory bytes for a remote
        file): every process of the node shares its pages. Checked whole on first use; readers
        that want only part of it use ``read``."""
        if not self._whole_checked and not all(self._checked):
            self.check_all()
        if self._data is not None:
            return np.frombuffer(self._data, self.dtype, self.count, self.offset)
        if self._map is None:
            if self.count == 0:
                return np.zeros(0, self.dtype)
            self._file()  # the file is still the one checked
            self._map = np.memmap(self.path, self.dtype, mode="r", offset=self.offset, shape=(self.count,))
        return self._map


class SideWriter:
    """A 1-D .npy side file written a piece at a time to a local file, hashed as it is written
    (the sha256 and the chunk digests a ``SideFile`` holds): a pack or merge of a billion
    documents writes lengths.npy without holding it. The number of values is given first (the
    .npy header holds it); ``finish`` refuses a file that did not get them all."""

    def __init__(self, path: str, name: str, dtype: Any, count: int):
        self.path, self.name, self.dtype, self.count = path, name, np.dtype(dtype), int(count)
        self.written = 0
        self._sha = hashlib.sha256()
        self._chunks: list[str] = []
        self._chunk = xxhash.xxh3_64()
        self._in_chunk = 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed by finish or abort
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.count,)}
        )
        self._put(header.getvalue())

    def _put(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._sha.update(data)
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHUNK_BYTES - self._in_chunk)
            self._chunk.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == CHUNK_BYTES:
                self._chunks.append(self._chunk.hexdigest())
                self._chunk, self._in_chunk = xxhash.xxh3_64(), 0

    def write(self, values: np.ndarray) -> None:
        """Append values (cast to the file's dtype; a value that does not fit is refused)."""
        values = np.asarray(values)
        out = np.ascontiguousarray(values, self.dtype)
        if len(out) and values.dtype != self.dtype and not np.array_equal(out, values):
            raise FormatError(f"{self.name}: a value does not fit {self.dtype}")
        if self.written + len(out) > self.count:
            raise FormatError(f"{self.name}: more than the {self.count} values its header announces")
        self._put(memoryview(out).cast("B"))
        self.written += len(out)

    def finish(self) -> SideFile:
        """Close the file; the reference an index stores for it."""
        if self.written != self.count:
            self.abort()
            raise FormatError(f"{self.name}: {self.written} values written, its header announces {self.count}")
        if self._in_chunk:
            self._chunks.append(self._chunk.hexdigest())
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        return SideFile(self.name, size, self._sha.hexdigest(), tuple(self._chunks))

    def abort(self) -> None:
        """Close and remove the unfinished file."""
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _npy_header(head: bytes | memoryview, where: str) -> tuple[np.dtype, int, int]:
    """(dtype, count, payload offset) of a 1-D numeric .npy's header."""
    view = bytes(head)
    if len(view) < 10 or view[:6] != b"\x93NUMPY":
        raise FormatError(f"{where}: not an .npy file")
    try:
        stream = io.BytesIO(view)
        version = np.lib.format.read_magic(stream)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _fortran, dtype = read_header(stream)
    except Exception as exc:  # numpy raises several types for a bad header
        raise FormatError(f"{where}: bad .npy header: {exc}") from exc
    if len(shape) != 1 or dtype.hasobject or dtype.kind not in "iuf":
        raise FormatError(f"{where}: expected a 1-D numeric array, got shape {shape} {dtype}")
    return dtype, int(shape[0]), stream.tell()
