"""Decompressing an input so that damage is never silent and never costs the text before it.

Every compressed input (`.gz`, `.bz2`, `.xz`, `.zst`) is read through a :class:`CheckedStream`:

- **Truncation is an error for every format.** gzip, bz2 and xz raise at a missing end of stream.
  zstandard's stream reader returns a quiet end of file when its input ends inside a frame, so a
  :class:`ZstdFrames` follows the frame and block headers as the compressed bytes pass (never the
  payloads: a few integer operations per block of up to 128 KiB) and says whether the input ended
  at a frame boundary.
- **What came before the damage is handed on first, all of it.** gzip, bz2 and xz are read by
  a :class:`StreamReader` over the standard library's incremental decompressors, which hands on
  every byte a decompressor gave before it ran out of input or failed (the file objects of
  ``gzip``, ``bz2`` and ``lzma`` drop what the failing read had decompressed), and an error is
  raised on the read after them: a document fully decompressed before the break is never lost.
  Where the format checks its data only at the end of a block or member (gzip's CRC per member,
  bz2's per 900 KB block, xz's and zstd's optional per-block/frame checks), the bytes decompressed
  just before a *changed* (not truncated) byte may already differ from the original:
  docs/reliability.md.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import Callable
from typing import BinaryIO, Protocol

from ..errors import DamagedInputError, SourceError
from ..storage.versions import VersionChangedError

#: decompressed bytes asked of a decompressor at a time
PIECE = 64 << 10
#: compressed bytes read from the input at a time
RAW_BLOCK = 64 << 10

#: exceptions by which a decompressor (or the bytes under it) says the stream is damaged
DAMAGE = (OSError, EOFError, lzma.LZMAError, zlib.error, ValueError)

_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = 0x184D2A50  # 0x184D2A50..0x184D2A5F
_ANY = 1 << 62  # bytes to pass over once the frames cannot be followed (zstandard itself refuses them)


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` says a compressed stream (or the input under it) is damaged; an object
    replaced while it is read is not damage: it is never skipped as unreadable."""
    if isinstance(exc, VersionChangedError):
        return False
    return isinstance(exc, DAMAGE) or type(exc).__name__ == "ZstdError"


class ZstdFrames:
    """Follows a zstd stream's frames by their headers (RFC 8878), to tell a stream that ends at a
    frame boundary from one cut inside a frame."""

    def __init__(self) -> None:
        self.state = "magic"
        self.want = 4  # header bytes the state needs
        self.head = bytearray()
        self.skip = 0  # payload bytes to pass over before the next header
        self.checksum = False
        self.offset = 0  # compressed bytes seen

    @property
    def complete(self) -> bool:
        """The bytes so far end at a frame boundary (or in bytes zstandard refuses by itself)."""
        return (self.state == "magic" and not self.head and not self.skip) or self.state == "lost"

    def feed(self, data: bytes) -> None:
        pos, n = 0, len(data)
        self.offset += n
        while pos < n:
            if self.skip:
                take = min(self.skip, n - pos)
                self.skip -= take
                pos += take
                continue
            take = min(self.want - len(self.head), n - pos)
            self.head += data[pos : pos + take]
            pos += take
            if len(self.head) == self.want:
                head = bytes(self.head)
                self.head.clear()
                self._header(head)

    def _header(self, head: bytes) -> None:
        value = int.from_bytes(head, "little")
        state = self.state
        if state == "magic":
            if value == _ZSTD_MAGIC:
                self.state, self.want = "descriptor", 1
            elif value & 0xFFFFFFF0 == _SKIPPABLE_MAGIC:
                self.state, self.want = "skippable", 4
            else:
                self.state, self.skip = "lost", _ANY
        elif state == "descriptor":
            fcs_flag, single = value >> 6, (value >> 5) & 1
            self.checksum = bool((value >> 2) & 1)
            size = (0 if single else 1) + (0, 1, 2, 4)[value & 3] + ((1 if single else 0), 2, 4, 8)[fcs_flag]
            self.state, self.want = ("header", size) if size else ("block", 3)
        elif state == "header":
            self.state, self.want = "block", 3
        elif state == "block":
            last, kind, size = value & 1, (value >> 1) & 3, value >> 3
            if kind == 3:
                self.state, self.skip = "lost", _ANY
                return
            self.skip = 1 if kind == 1 else size
            if last:
                self.state, self.want = ("checksum", 4) if self.checksum else ("magic", 4)
        elif state in ("checksum", "skippable"):
            if state == "skippable":
                self.skip = value
            self.state, self.want = "magic", 4


class _FramedSource:
    """The compressed bytes of a zstd input, followed by a :class:`ZstdFrames` as they are read."""

    def __init__(self, raw: BinaryIO, frames: ZstdFrames) -> None:
        self.raw = raw
        self.frames = frames

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.frames.feed(data)
        return data


class Decompressor(Protocol):
    """One compressed stream's incremental decompressor: ``bz2.BZ2Decompressor``,
    ``lzma.LZMADecompressor``, or :class:`GzipMember`."""

    @property
    def eof(self) -> bool: ...

    @property
    def unused_data(self) -> bytes: ...

    @property
    def needs_input(self) -> bool: ...

    def decompress(self, data: bytes, max_length: int = -1) -> bytes: ...


class GzipMember:
    """One gzip member, through zlib (which checks its header, CRC and size), with the interface of
    bz2's and lzma's decompressors: the input a bounded call left unread is kept here."""

    def __init__(self) -> None:
        self._zlib = zlib.decompressobj(wbits=31)
        self._tail = b""

    @property
    def eof(self) -> bool:
        return self._zlib.eof

    @property
    def unused_data(self) -> bytes:
        return self._zlib.unused_data

    @property
    def needs_input(self) -> bool:
        return not self._tail

    def decompress(self, data: bytes, max_length: int = -1) -> bytes:
        if self._tail:
            data = self._tail + data
        out = self._zlib.decompress(data, max(max_length, 0))
        self._tail = self._zlib.unconsumed_tail
        return out


class StreamReader:
    """The decompressed bytes of concatenated compressed streams, as the file objects of ``gzip``,
    ``bz2`` and ``lzma`` read them (gzip: ``zero_padding`` between and after members, any other
    byte starts a member; bz2 and xz: bytes after a stream that start none, as ``trailing_error``
    from their first decompression says, end the input), except that a read returns whatever the
    decompressor gave before its input ended or it failed: only a read that got nothing raises
    (``EOFError`` for a stream cut short)."""

    def __init__(
        self,
        raw: BinaryIO,
        factory: Callable[[], Decompressor],
        *,
        trailing_error: type[Exception] | None = None,
        zero_padding: bool = False,
    ) -> None:
        self._raw = raw
        self._factory = factory
        self._trailing_error = trailing_error
        self._padded = zero_padding
        self._decompressor: Decompressor | None = factory()
        self._pending = b""  # compressed bytes the last stream left over, for the next one
        self._following = False  # the current stream follows another and has not been fed yet
        self._started = False  # whether the input gave any byte

    def read(self, n: int = -1) -> bytes:
        want = n if n is not None and n > 0 else PIECE
        while self._decompressor is not None:
            if self._decompressor.eof:
                self._next_stream()
                continue
            data = self._input() if self._decompressor.needs_input else b""
            try:
                out = self._decompressor.decompress(data, want)
            except Exception as exc:
                trailing = self._trailing_error is not None and isinstance(exc, self._trailing_error)
                if not (trailing and self._following):
                    raise
                self._decompressor = None  # bytes after the last stream that start none
                break
            self._following = False
            if out:
                return out
            if not data and self._decompressor.needs_input:
                if self._started:
                    raise EOFError("compressed file ended before the end-of-stream marker was reached")
                self._decompressor = None  # an empty input: no stream at all, as the file objects read it
        return b""

    def _input(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        data = self._raw.read(RAW_BLOCK)
        self._started = self._started or bool(data)
        return data

    def _next_stream(self) -> None:
        """Start the stream after the one that ended, or end the input."""
        rest = self._decompressor.unused_data or self._input()
        if self._padded:
            while rest and not rest.strip(b"\x00"):
                rest = self._input()
            rest = rest.lstrip(b"\x00")
        if not rest:
            self._decompressor = None
            return
        self._pending = rest
        self._decompressor = self._factory()
        self._following = True

    def close(self) -> None:
        self._decompressor = None


class CheckedStream:
    """A decompressed stream whose damage raises :class:`DamagedInputError` after the bytes that
    came before it (see the module's docstring)."""

    def __init__(self, stream: BinaryIO, raw: BinaryIO, fmt: str, frames: ZstdFrames | None = None) -> None:
        self._stream = stream
        self._raw = raw
        self._format = fmt
        self._frames = frames
        self._error: DamagedInputError | None = None
        self._ended = False

    def read(self, n: int = -1) -> bytes:
        if self._error is not None:
            raise self._error
        if self._ended:
            return b""
        want = n if n is not None and n >= 0 else 1 << 62
        pieces: list[bytes] = []
        got = 0
        while got < want:
            try:
                piece = self._stream.read(min(PIECE, want - got))
            except Exception as exc:
                if not is_damage(exc):
                    raise
                self._error = self._damaged(exc)
                break
            if not piece:
                self._ended = True
                if self._frames is not None and not self._frames.complete:
                    self._error = self._damaged(None)
                break
            pieces.append(piece)
            got += len(piece)
        if not pieces and self._error is not None:
            raise self._error
        return b"".join(pieces)

    def _damaged(self, exc: BaseException | None) -> DamagedInputError:
        if exc is None:
            at = self._frames.offset if self._frames is not None else 0
            what = f"truncated: the {self._format} stream ends inside a frame at compressed byte {at}"
        else:
            what = f"damaged {self._format} stream near compressed byte {_tell(self._raw)}: {type(exc).__name__}: {exc}"
        return DamagedInputError(what)

    def close(self) -> None:
        self._stream.close()


def _tell(raw: BinaryIO) -> int:
    try:
        return raw.tell()
    except (OSError, ValueError, AttributeError):
        return 0


def decompressing(raw: BinaryIO, compression: str | None) -> BinaryIO:
    """``raw`` decompressed as ``compression`` says ("gz", "bz2", "xz", "zst"; None: as it is)."""
    if compression is None:
        return raw
    if compression == "gz":
        return CheckedStream(StreamReader(raw, GzipMember, zero_padding=True), raw, "gzip")
    if compression == "bz2":
        return CheckedStream(StreamReader(raw, bz2.BZ2Decompressor, trailing_error=OSError), raw, "bz2")
    if compression == "xz":
        return CheckedStream(StreamReader(raw, lzma.LZMADecompressor, trailing_error=lzma.LZMAError), raw, "xz")
    if compression == "zst":
        import zstandard

        frames = ZstdFrames()
        reader = zstandard.ZstdDecompressor().stream_reader(_FramedSource(raw, frames), closefd=False)
        return CheckedStream(reader, raw, "zstd", frames)
    raise SourceError(f"unknown compression {compression!r}")
