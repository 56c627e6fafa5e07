"""Shards as tar files: a small USTAR reader that yields decoded groups with their byte offsets, and
the writer that makes them.

``tarfile`` costs tens of microseconds per member and cannot skip a member without reading it
from a stream; this reader parses the 512-byte headers itself, seeks over unwanted members when
the stream is seekable, and reports the byte offset of every sample so that errors can name it.
It reads any USTAR/GNU tar that holds regular files; wdsllm writes only USTAR.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import stat
import tarfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import ShardError
from . import group as fmt

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
TAR_MTIME = 0  # fixed so that identical input gives byte-identical shards
TAR_USER = "wdsllm"
TAR_MODE = 0o444


@dataclass
class RawSample:
    key: str
    offset: int  # byte offset of the sample's first member header in the shard
    members: dict  # suffix -> bytes (suffixes not wanted are absent)
    meta: dict


#: A sample's JSON member is parsed only up to this size (provenance of the largest groups is
#: well under a megabyte); a larger one is a malformed shard, not something to allocate for.
MAX_META_BYTES = 64 << 20


def _octal(field: bytes, where: str, offset: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for large sizes: every byte counts, zeros too
        value = int.from_bytes(field, "big") & ~(0x80 << (8 * (len(field) - 1)))
        if field[0] & 0x40:
            raise ShardError(f"{where}: negative base-256 number in the tar header at byte {offset}")
        return value
    field = field.rstrip(b"\0 ").lstrip(b" ")
    if not field:
        return 0
    try:
        return int(field, 8)
    except ValueError:
        raise ShardError(f"{where}: bad number in the tar header at byte {offset}") from None


#: Reads from a stream are at most this large, so that a size claimed by a header is never
#: allocated before the bytes are there (a mapped reader returns views and needs no bound).
_READ_PIECE = 16 << 20


def _read_exact(stream: BinaryIO, n: int, where: str, offset: int) -> bytes:
    data = stream.read(n if n <= _READ_PIECE or isinstance(stream, MappedReader) else _READ_PIECE)
    if len(data) != n:
        if not isinstance(data, bytes):
            data = bytes(data or b"")
        # BufferedReader may return short reads only at EOF; loop for raw streams.
        parts = [data]
        got = len(data)
        while got < n:
            more = stream.read(min(n - got, _READ_PIECE))
            if not more:
                raise ShardError(
                    f"{where}: truncated at byte {offset + got} (wanted {n} bytes of a member at {offset})"
                )
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def _seekable(stream) -> bool:
    try:
        return bool(stream.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def _skip(stream: BinaryIO, n: int, seekable: bool, where: str, offset: int) -> None:
    if n <= 0:
        return
    if seekable:
        stream.seek(n, 1)
        return
    while n > 0:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            raise ShardError(f"{where}: truncated at byte {offset} while skipping")
        n -= len(chunk)
        offset += len(chunk)


class MappedReader:
    """Reading a buffer in place (a mapped local shard, or one group's bytes): large reads are
    zero-copy views of it.

    Token members then need no copy at all, and every group of a mapped shard lies in one buffer
    (``mm``), so the loader can permute and batch items across groups by index alone.
    """

    SMALL = 4096  # reads up to this size return bytes (headers, JSON), larger ones memoryviews

    def __init__(self, mm: Any, offset: int = 0):
        self.mm = mm
        self.view = memoryview(mm).cast("B") if not isinstance(mm, mmap.mmap) else memoryview(mm)
        self.pos = offset

    def read(self, n: int = -1) -> bytes | memoryview:
        end = len(self.view) if n < 0 else min(len(self.view), self.pos + n)
        start, self.pos = self.pos, end
        return bytes(self.view[start:end]) if end - start <= self.SMALL else self.view[start:end]

    def remaining(self) -> int:
        return len(self.view) - self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else (self.pos + offset if whence == 1 else len(self.view) + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.view = None  # the mmap itself lives as long as arrays that view it


class MapCache:
    """The mappings of the last few local shards read, kept for the next read of the same file.

    A fresh mapping starts with no page-table entries, and every page of the shard is faulted in
    again on its first touch: re-reading a page-cached shard each epoch costs a fifth of what
    building packed batches from it costs. A mapping is reused only for the same file (device,
    inode, size, mtime): a replaced file gets a new one, and a file rewritten in place is seen
    as it is now (a shared mapping shows the page cache, not a snapshot). At most ``shards`` mappings
    of at most ``max_bytes`` in all are kept, the least recently used dropped first. They are
    read-only views of the page cache, which the kernel can reclaim under memory pressure (the
    space of a file deleted meanwhile is freed when its mapping is dropped).
    """

    def __init__(self, shards: int = 4, max_bytes: int = 2 << 30):
        self.shards = shards
        self.max_bytes = max_bytes
        self.maps: OrderedDict[tuple, mmap.mmap] = OrderedDict()
        self.lock = threading.Lock()
        #: the file each live mapping shows, and its identity when mapped (see ``changed_file``)
        self.origins: weakref.WeakKeyDictionary[mmap.mmap, tuple[str, tuple]] = weakref.WeakKeyDictionary()

    def get(self, fileno: int, st: os.stat_result, path: str | None = None) -> mmap.mmap:
        mm = self.find(st)
        if mm is not None:
            return mm
        key = _identity(st)
        mm = mmap.mmap(fileno, 0, access=mmap.ACCESS_READ)
        if path is not None:
            with self.lock:
                self.origins[mm] = (path, key)
        if st.st_size > self.max_bytes or self.shards < 1:
            return mm
        with self.lock:
            self.maps[key] = mm
            while len(self.maps) > self.shards or sum(len(m) for m in self.maps.values()) > self.max_bytes:
                self.maps.popitem(last=False)  # unmapped once no array views it any more
        return mm

    def find(self, st: os.stat_result) -> mmap.mmap | None:
        """The mapping kept of the file ``st`` describes, if one is (found by a stat: no open)."""
        key = _identity(st)
        with self.lock:
            mm = self.maps.get(key)
            if mm is not None:
                self.maps.move_to_end(key)
            return mm


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


map_cache = MapCache()


def mapped(stream: Any, path: str | None = None) -> MappedReader | None:
    """A MappedReader over a local regular file's stream (at its position), else None. ``path``:
    the file's path, so that ``changed_file`` can tell when it is rewritten while mapped."""
    try:
        fileno = stream.fileno()
        st = os.fstat(fileno)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        return MappedReader(map_cache.get(fileno, st, path), stream.tell())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def mapped_again(path: str, size: int | None) -> MappedReader | None:
    """A MappedReader over a local regular file of ``size`` bytes that ``map_cache`` keeps mapped,
    found by a stat; None where it is not (the caller opens it, with every check an open makes).
    An epoch's blocks read a few-shard dataset a block at a time: one stat each, not an open."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        return None
    mm = map_cache.find(st)
    return None if mm is None else MappedReader(mm, 0)


def _origin(tokens: Any) -> tuple[str, tuple] | None:
    """(path, identity when mapped) of the mapped file that ``tokens`` views; None if none."""
    base = tokens
    while getattr(base, "base", None) is not None and not isinstance(base, memoryview):
        base = base.base
    mm = base.obj if isinstance(base, memoryview) else None
    return map_cache.origins.get(mm) if isinstance(mm, mmap.mmap) else None


def views_mapped_file(tokens: Any) -> bool:
    """Whether ``tokens`` view a mapped local file (its pages are the page cache's, not this
    process's memory)."""
    return _origin(tokens) is not None


def changed_file(tokens: Any) -> str | None:
    """The path of the mapped file that ``tokens`` views, if that file changed since it was mapped
    (rewritten in place: a shared mapping then shows the new bytes); None if it did not, or if
    ``tokens`` is not a view of a mapped file. A stat, a few microseconds: cheap once per batch."""
    origin = _origin(tokens)
    if origin is None:
        return None
    path, key = origin
    try:
        return None if _identity(os.stat(path)) == key else path
    except OSError:
        return path


def iter_members(
    stream: BinaryIO,
    where: str,
    base_offset: int = 0,
    verify_checksums: bool = False,
    *,
    end: int | None = None,
    eof_ok: bool = False,
) -> Iterator[tuple[str, int, int]]:
    """(name, header offset, size) of each regular file; the caller reads or skips its data.

    The caller must consume exactly ``size`` bytes (read or skip) before resuming. ``end`` is the
    offset where the bytes end (the shard's size), when known: a member claiming more than is
    there is an error at once, before anything is allocated for it (a reader over a buffer knows
    its end itself). ``eof_ok``: the bytes may end after any member (one group's bytes), not only
    at the end-of-archive blocks.
    """
    offset = base_offset
    seekable = _seekable(stream)
    if end is None and isinstance(stream, MappedReader):
        end = base_offset + stream.remaining()
    while True:
        header = stream.read(BLOCK)
        if not header:
            if eof_ok:
                return
            raise ShardError(f"{where}: truncated at byte {offset}: missing the end-of-archive blocks")
        if len(header) < BLOCK:
            header += _read_exact(stream, BLOCK - len(header), where, offset + len(header))
        if header == _ZERO_BLOCK:
            return
        if verify_checksums:
            stored = _octal(header[148:156], where, offset)
            computed = sum(header[:148]) + 8 * 32 + sum(header[156:])
            if stored != computed:
                raise ShardError(f"{where}: bad tar header checksum at byte {offset}")
        name = header[:100].split(b"\0", 1)[0]
        prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
        if prefix:
            name = prefix + b"/" + name
        size = _octal(header[124:136], where, offset)
        typeflag = header[156:157]
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        if end is not None and offset + BLOCK + size > end:
            raise ShardError(
                f"{where}: the tar header at byte {offset} claims a member of {size:,} bytes; "
                f"only {max(0, end - offset - BLOCK):,} follow it"
            )
        if typeflag in (b"0", b"\0", b"7"):
            yield name.decode("utf-8", "replace"), offset, size
            offset += BLOCK + padded
            pad = padded - size
            if pad:
                _skip(stream, pad, seekable, where, offset - pad)
        else:  # directories, links, pax/GNU headers: skip the payload
            _read_exact(stream, padded, where, offset + BLOCK) if padded else None
            offset += BLOCK + padded


def parse_meta(data: bytes | memoryview, where: str, key: str, offset: int) -> dict:
    """A sample's JSON member as a dict; malformed, too large or too deeply nested JSON is a
    ShardError naming the sample and its offset (never quoting the content)."""
    if len(data) > MAX_META_BYTES:
        raise ShardError(f"{where}: sample {key} at byte {offset}: its JSON member is {len(data):,} bytes")
    try:
        meta = json.loads(bytes(data))  # a mapped read of a large member is a memoryview
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else f"not JSON ({type(exc).__name__})"
        raise ShardError(f"{where}: sample {key} at byte {offset}: bad JSON metadata: {reason}") from None
    if not isinstance(meta, dict):
        raise ShardError(f"{where}: sample {key} at byte {offset}: the JSON metadata is not an object")
    return meta


def iter_samples(
    stream: BinaryIO,
    where: str,
    *,
    wanted: Callable[[dict], bool] | None = None,
    base_offset: int = 0,
    verify_checksums: bool = False,
    end: int | None = None,
    eof_ok: bool = False,
) -> Iterator[RawSample]:
    """Samples (members grouped by key) with their offsets.

    ``wanted(meta) -> bool`` is called with the sample's JSON metadata, which wdsllm writes as
    the first member; members of an unwanted sample are skipped without being read (seeked over
    when the stream allows it).
    """
    seekable = _seekable(stream)
    current: RawSample | None = None
    skipping_key = None
    members = iter_members(stream, where, base_offset, verify_checksums, end=end, eof_ok=eof_ok)
    for name, offset, size in members:
        slash = name.rfind("/")
        dot = name.find(".", slash + 1)
        if dot < 0:
            _skip(stream, size, seekable, where, offset + BLOCK)
            continue
        key, suffix = name[:dot], name[dot + 1 :]
        if key == skipping_key:
            _skip(stream, size, seekable, where, offset + BLOCK)
            continue
        if current is None or key != current.key:
            if current is not None:
                yield current
            current = RawSample(key, offset, {}, {})
            skipping_key = None
        data = _read_exact(stream, size, where, offset + BLOCK)
        if suffix == fmt.META:
            current.meta = parse_meta(data, where, key, offset)
            if wanted is not None and not wanted(current.meta):
                skipping_key, current = key, None
                continue
        current.members[suffix] = data
    if current is not None:
        yield current


def decode_sample(raw: RawSample, where: str) -> fmt.Group:
    """The sample as a Group; a format error names the shard and the byte offset."""
    sample = dict(raw.members)
    sample["__key__"] = raw.key
    return fmt.decode_group(sample, f"{where} @{raw.offset}", meta=raw.meta)


def iter_groups(stream: BinaryIO, where: str, **kw) -> Iterator[tuple[int, fmt.Group]]:
    """(offset, Group) for each sample of a wdsllm shard."""
    for raw in iter_samples(stream, where, **kw):
        yield raw.offset, decode_sample(raw, where)


def group_items(meta: dict, where: str = "") -> int:
    """Items (documents, or rows in packed mode) a group holds, from its metadata alone."""
    value = meta.get("rows", meta.get("documents"))
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ShardError(f"{where}: a sample's JSON metadata has no valid document or row count")
    return value


# ----------------------------------------------------------------------------------------------
# Writing


def member_bytes(sample: dict[str, Any]) -> int:
    """Bytes a sample adds to a tar: a 512-byte header per member plus padded payloads."""
    total = 0
    for k, v in sample.items():
        if not k.startswith("__"):
            total += 512 + (len(v) + 511) // 512 * 512
    return total


TAR_RECORD = 20 * 512  # tarfile pads a closed archive to whole records of this size


def tar_file_bytes(member_bytes: int) -> int:
    """The size of a closed tar holding ``member_bytes``: two zero end blocks, then record padding."""
    return -(-(member_bytes + 1024) // TAR_RECORD) * TAR_RECORD


def sample_bytes(sample: dict[str, Any]) -> bytes:
    """The bytes a sample adds to a tar, exactly as ``tarfile`` (USTAR) and
    ``webdataset.TarWriter(encoder=False, mtime=0, user=group="wdsllm", mode=0o444)`` write them:
    for each member in sorted suffix order, a header, the payload and its padding."""
    key = sample["__key__"]
    parts = []
    for suffix in sorted(sample):
        if suffix.startswith("_"):
            continue
        data = sample[suffix]
        info = tarfile.TarInfo(f"{key}.{suffix}")
        info.size = len(data)
        info.mtime = TAR_MTIME
        info.mode = TAR_MODE
        info.uname = info.gname = TAR_USER
        parts.append(info.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape"))
        parts.append(bytes(data))
        if len(data) % BLOCK:
            parts.append(bytes(BLOCK - len(data) % BLOCK))
    return b"".join(parts)


class SampleTarWriter:
    """Writes webdataset samples exactly as ``webdataset.TarWriter(encoder=False, mtime=0,
    user=group="wdsllm", mode=0o444)`` does (members in sorted suffix order, same headers, same
    bytes; a test holds the two equal), without importing webdataset: that imports torch, which
    costs a packing process 1.7 s of CPU and 200 MiB of memory for nothing. ``write`` returns the
    sample's bytes, so that the packer can checksum each group as written.
    """

    def __init__(self, fileobj: BinaryIO) -> None:
        self._file = fileobj
        self._written = 0

    def write(self, sample: dict[str, Any]) -> bytes:
        data = sample_bytes(sample)
        self._file.write(data)
        self._written += len(data)
        return data

    def close(self) -> None:
        """The end-of-archive blocks and the padding to whole records, as tarfile writes them."""
        self._file.write(bytes(tar_file_bytes(self._written) - self._written))
