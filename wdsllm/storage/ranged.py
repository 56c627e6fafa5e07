"""A seekable, read-only file over a remote object, for readers that read ranges (Parquet's footer
and the column chunks of a row group, Arrow's record batches).

Each read is one ranged request of exactly the bytes asked for (a large one is several ranged GETs
in flight, as :func:`~wdsllm.storage.resumable.open_stream` reads any range), so a reader that
asks for two columns of one row group downloads those column chunks and nothing else. Every read
retries and resumes through the storage layer, and every read must come from the same version of
the object as the first, or, given one, as the version listed (:mod:`.versions`): a file replaced
in the middle of a pack or an epoch is an error, not a mix.
"""

from __future__ import annotations

import io
from typing import Any

from . import versions
from .resumable import open_stream
from .retry import RetryPolicy, make_error
from .urls import redact


class RangedFile(io.RawIOBase):
    """Bytes of ``url`` (``size`` bytes long) read at any offset, one ranged read per ``readinto``."""

    def __init__(self, url: str, size: int, retry: RetryPolicy | None = None, version: str | None = None) -> None:
        super().__init__()
        self.url = url
        self.name = redact(url)
        self.size = size
        self._retry = retry
        self._pos = 0
        self._etag: str | None = version or None  # every read asks for it, once it is known
        self.requested = 0  # bytes asked of the store (for tests and benchmarks)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.name}: seek to a negative offset")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed file")
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.size - self._pos))
        if not n:
            return 0
        stream = open_stream(
            self.url, offset=self._pos, length=n, retry=self._retry, expected_size=self.size, version=self._etag
        )
        try:
            got = 0
            while got < n:
                k = stream.readinto(view[got:n])
                if not k:
                    raise make_error(self.url, f"object ended at byte {self._pos + got} of {self.size}")
                got += k
            self._check_version(getattr(getattr(stream, "raw", stream), "_etag", None))
        finally:
            stream.close()
        self.requested += n
        self._pos += n
        return n

    def readall(self) -> bytes:
        return self.read(self.size - self._pos)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, self.size - self._pos)
        buf = bytearray(min(size, max(0, self.size - self._pos)))
        n = self.readinto(buf)
        return bytes(buf[:n])

    def _check_version(self, etag: str | None) -> None:
        if not etag:
            return
        if self._etag is None:
            self._etag = etag
        elif etag != self._etag:
            raise versions.changed(self.url, self._etag, etag)


def open_ranged(url: str, size: int, retry: RetryPolicy | None = None, version: str | None = None) -> RangedFile:
    """A seekable file over the remote object ``url`` of ``size`` bytes (from its listing); with
    ``version`` (the listing's), every read is of that version."""
    return RangedFile(url, size, retry, version)
