"""Raw-text WebDataset tars as input: each sample's `.txt` member, or the ``--text-field`` of its
`.json` member, is one document.

Samples are consecutive members that share a key (webdataset's rule: the member's path up to the
first dot of its file name). The text is the sample's `.txt` (or `.text`) member when it has one,
else the ``--text-field`` of its `.json` member; ``--where`` reads the fields of the `.json`
member. A tar is read as a stream from its start (plain, or compressed as a whole with
`.gz`/`.zst`/...; from stdin too), so it is one unit of work. Provenance: the sample's number in
the tar (1-based) is the "line", and its key goes into the group's ``source_keys``.
"""

from __future__ import annotations

import functools
import posixpath
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..storage.versions import VersionChangedError
from .records import RecordChunk, empty_chunk
from .sources import (
    DEFAULT_MAX_DOC_BYTES,
    OPEN_READS,
    READ_ERRORS,
    InputFile,
    ParseOptions,
    Part,
    Skip,
    Units,
    close_input,
    open_decompressed,
    tell,
    too_long,
)

UNIT = "sample"
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
TEXT_SUFFIXES = ("txt", "text")
JSON_SUFFIX = "json"
_TAR_ERRORS = (tarfile.TarError, zlib.error, *READ_ERRORS)


#: member types whose payload is metadata that tarfile reads whole (GNU long names, PAX headers)
_META_TYPES = {
    tarfile.GNUTYPE_LONGNAME: "GNU long-name",
    tarfile.GNUTYPE_LONGLINK: "GNU long-link",
    tarfile.XHDTYPE: "PAX",
    tarfile.XGLTYPE: "PAX global",
    tarfile.SOLARIS_XHDTYPE: "Solaris extended",
}
#: bytes of earlier members kept for link members that name them (oldest dropped first)
LINK_TARGET_BYTES = 32 << 20


class _CheckedTarInfo(tarfile.TarInfo):
    """tarfile ends an archive quietly at a damaged or missing header; here only its end-of-archive
    (zero) block ends it, and anything else is an error: a truncated or corrupted tar must not
    lose its remaining samples unnoticed. A metadata header (long name, PAX) is read only when
    its claimed size is within ``header_limit``: tarfile reads such payloads whole."""

    header_limit = DEFAULT_MAX_DOC_BYTES

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.EOFHeaderError:
            raise
        except tarfile.EmptyHeaderError:
            raise tarfile.ReadError(f"it ends at byte {tar.offset} without its end-of-archive blocks") from None
        except tarfile.HeaderError as exc:
            raise tarfile.ReadError(f"{exc} at byte {tar.offset}") from None

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        kind = _META_TYPES.get(self.type)
        if kind is not None and self.size > self.header_limit:
            raise tarfile.ReadError(
                f"a {kind} header at byte {self.offset} claims {self.size} bytes, more than the "
                f"{self.header_limit} allowed (--max-doc-bytes)"
            )
        return super()._proc_member(tar)


@functools.lru_cache(maxsize=16)
def _tarinfo_class(header_limit: int) -> type[_CheckedTarInfo]:
    """A :class:`_CheckedTarInfo` bounded by ``header_limit`` (tarfile takes a class, not an instance)."""
    return type("_BoundedTarInfo", (_CheckedTarInfo,), {"header_limit": header_limit})


def split_name(name: str) -> tuple[str | None, str]:
    """(key, suffix) of a member name, as webdataset groups members into samples."""
    m = _KEY.match(name)
    return (m.group(1), m.group(2).lower()) if m else (None, "")


@dataclass
class _Sample:
    number: int
    key: str
    text: bytes | None = None
    meta: bytes | None = None
    text_too_long: int = 0
    meta_too_long: int = 0
    problems: list[str] = field(default_factory=list)  # members that could not be read (links), why


@dataclass
class _Builder:
    """Samples of one tar, gathered into chunks of about chunk_bytes."""

    inp: InputFile
    chunk_bytes: int
    where: object  # the --where, or None
    lines: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    is_json: list[bool] = field(default_factory=list)
    metas: list[bytes | None] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    filtered: list[int] = field(default_factory=list)
    size: int = 0
    number: int = 0  # the sample being read (where a damaged tar broke)

    @property
    def keep_meta(self) -> bool:
        return self.where is not None

    def add(self, s: _Sample, limit: int) -> None:
        meta_needed = (s.text is None and not s.text_too_long) or self.keep_meta
        if s.text_too_long or (meta_needed and s.meta_too_long):
            self.skips.append(too_long(self.inp.index, s.number, max(s.text_too_long, s.meta_too_long), limit, s.key))
            return
        if s.problems:  # a member of the sample could not be read: none of it is taken
            message = "; ".join(s.problems)
            self.skips.append(Skip(self.inp.index, s.number, "unreadable_member", message, message, key=s.key))
            return
        if s.text is None and s.meta is None:
            if self.where is not None and not self.where.keeps({}):  # no fields: as a JSON line {} would be
                self.filtered.append(s.number)
                return
            message = "the sample has no .txt and no .json member"
            self.skips.append(Skip(self.inp.index, s.number, "missing_field", message, message, key=s.key))
            return
        self.lines.append(s.number)
        self.keys.append(s.key)
        if s.text is not None:
            self.payloads.append(s.text)
            self.is_json.append(False)
            self.metas.append(s.meta if self.keep_meta else None)
        else:
            self.payloads.append(s.meta)
            self.is_json.append(True)
            self.metas.append(None)
        self.size += len(self.payloads[-1])

    @property
    def full(self) -> bool:
        return self.size >= self.chunk_bytes

    def take(self, raw_offset: int) -> RecordChunk | None:
        if not self.lines and not self.skips and not self.filtered:
            return None
        offsets = np.zeros(len(self.payloads) + 1, np.int64)
        np.cumsum([len(p) for p in self.payloads], out=offsets[1:])
        chunk = RecordChunk(
            self.inp.index,
            UNIT,
            np.asarray(self.lines, np.int64),
            b"".join(self.payloads),
            offsets,
            is_json=np.asarray(self.is_json, bool),
            metas=self.metas if self.keep_meta else None,
            keys=self.keys,
            skips=self.skips,
            tallies={"filtered": self.filtered} if self.filtered else {},
            raw_offset=raw_offset,
        )
        self.lines, self.payloads, self.is_json, self.metas, self.keys, self.skips = [], [], [], [], [], []
        self.filtered = []
        self.size = 0
        return chunk


class _Kept:
    """The bytes of earlier text and JSON members, by name, for the link members that name them:
    a tar read as a stream cannot go back. At most :data:`LINK_TARGET_BYTES`, oldest dropped first."""

    def __init__(self, budget: int = LINK_TARGET_BYTES) -> None:
        self.budget = budget
        self.members: dict[str, bytes] = {}
        self.size = 0

    def keep(self, name: str, data: bytes) -> None:
        if len(data) > self.budget:
            return
        old = self.members.pop(name, None)
        self.size += len(data) - (len(old) if old is not None else 0)
        self.members[name] = data
        while self.size > self.budget:
            self.size -= len(self.members.pop(next(iter(self.members))))


def _link_target(member: tarfile.TarInfo) -> str | None:
    """The archive name a link member points at, or None when it points outside the archive."""
    if member.islnk():
        target = member.linkname
    else:
        target = posixpath.join(posixpath.dirname(member.name), member.linkname)
    if posixpath.isabs(member.linkname):
        return None
    target = posixpath.normpath(target)
    return None if target.startswith("../") or target == ".." else target


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo, kept: _Kept) -> tuple[bytes | None, str]:
    """(the member's bytes, "") or (None, why it cannot be read): a link reads the earlier member it names."""
    if member.isfile():
        data = tar.extractfile(member).read()
        kept.keep(member.name, data)
        return data, ""
    if not (member.islnk() or member.issym()):
        return None, f"member {member.name!r} is not a regular file (tar type {member.type!r})"
    target = _link_target(member)
    if target is None:
        return None, f"link {member.name!r} points outside the tar ({member.linkname!r})"
    data = kept.members.get(target)
    if data is None:
        return None, f"link {member.name!r} names {target!r}, which is not an earlier text or JSON member kept"
    return data, ""


def _walk(tar: tarfile.TarFile, build: _Builder, start_line: int, limit: int, raw) -> Iterator[RecordChunk]:
    """The tar's samples into ``build``, yielding a chunk whenever it is full."""
    kept = _Kept()
    sample: _Sample | None = None
    number = 0
    for member in tar:
        if member.isdir():
            continue
        key, suffix = split_name(member.name)
        if key is None:
            continue
        if sample is None or key != sample.key:
            if sample is not None and sample.number >= start_line:
                build.add(sample, limit)
                if build.full:
                    yield build.take(tell(raw))
            number += 1
            sample = _Sample(number, key)
        build.number = number
        if suffix not in (*TEXT_SUFFIXES, JSON_SUFFIX):
            continue
        is_text = suffix in TEXT_SUFFIXES
        if member.size > limit:  # never read: tarfile streams past it
            if is_text:
                sample.text_too_long = member.size
            else:
                sample.meta_too_long = member.size
            continue
        data, problem = _member_bytes(tar, member, kept)
        if number < start_line:
            continue
        if problem:
            sample.problems.append(problem)
        elif is_text:
            sample.text = data
        else:
            sample.meta = data
    if sample is not None and sample.number >= start_line:
        build.add(sample, limit)


class TarReader:
    """WebDataset tars of raw text (`.txt` and/or `.json` members)."""

    def units(self, inp: InputFile, opts: ParseOptions) -> Units | None:
        return None  # a tar is a stream of members: read from its start

    def chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[RecordChunk]:
        return OPEN_READS.track(self._chunks(part, opts, chunk_bytes, start_line))

    def _chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[RecordChunk]:
        inp = part.input
        limit = opts.max_doc_bytes
        stream, raw = open_decompressed(inp)
        build = _Builder(inp, max(1, chunk_bytes), opts.where)
        try:
            try:
                tarinfo = _tarinfo_class(limit)
                tar = tarfile.open(fileobj=stream, mode="r|", tarinfo=tarinfo)  # noqa: SIM115 - a stream
                yield from _walk(tar, build, start_line, limit, raw)
            except _TAR_ERRORS as exc:
                if type(exc).__name__ == "SourceError" or isinstance(exc, VersionChangedError):
                    raise
                chunk = build.take(tell(raw))
                if chunk is not None:
                    yield chunk
                at = max(build.number, 1)  # the sample being read when it broke is lost with the rest
                message = f"not a readable tar from sample {at} on: {exc}"
                skip = Skip(inp.index, at, "unreadable", str(exc), message)
                yield empty_chunk(inp.index, UNIT, tell(raw), skips=[skip])
                return
            chunk = build.take(tell(raw))
            if chunk is not None:
                yield chunk
        finally:
            close_input(inp, stream, raw if raw is not stream else None)
