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

import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .records import RecordChunk, empty_chunk
from .sources import (
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


class _CheckedTarInfo(tarfile.TarInfo):
    """tarfile ends an archive quietly at a damaged or missing header; here only its end-of-archive
    (zero) block ends it, and anything else is an error: a truncated or corrupted tar must not
    lose its remaining samples unnoticed."""

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

    @property
    def keep_meta(self) -> bool:
        return self.where is not None

    def add(self, s: _Sample, limit: int) -> None:
        meta_needed = (s.text is None and not s.text_too_long) or self.keep_meta
        if s.text_too_long or (meta_needed and s.meta_too_long):
            self.skips.append(too_long(self.inp.index, s.number, max(s.text_too_long, s.meta_too_long), limit, s.key))
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


class TarReader:
    """WebDataset tars of raw text (`.txt` and/or `.json` members)."""

    def units(self, inp: InputFile, opts: ParseOptions) -> Units | None:
        return None  # a tar is a stream of members: read from its start

    def chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[RecordChunk]:
        inp = part.input
        limit = opts.max_doc_bytes
        stream, raw = open_decompressed(inp)
        build = _Builder(inp, max(1, chunk_bytes), opts.where)
        sample: _Sample | None = None
        number = 0
        try:
            try:
                tar = tarfile.open(fileobj=stream, mode="r|", tarinfo=_CheckedTarInfo)  # noqa: SIM115 - a stream
                for member in tar:
                    if not member.isfile():
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
                    if number < start_line or suffix not in (*TEXT_SUFFIXES, JSON_SUFFIX):
                        continue
                    is_text = suffix in TEXT_SUFFIXES
                    if member.size > limit:  # never read: tarfile streams past it
                        if is_text:
                            sample.text_too_long = member.size
                        else:
                            sample.meta_too_long = member.size
                        continue
                    data = tar.extractfile(member).read()
                    if is_text:
                        sample.text = data
                    else:
                        sample.meta = data
            except _TAR_ERRORS as exc:
                if type(exc).__name__ == "SourceError":
                    raise
                chunk = build.take(tell(raw))
                if chunk is not None:
                    yield chunk
                at = max(number, 1)  # the sample being read when it broke is lost with the rest
                message = f"not a readable tar from sample {at} on: {exc}"
                skip = Skip(inp.index, at, "unreadable", str(exc), message)
                yield empty_chunk(inp.index, UNIT, tell(raw), skips=[skip])
                return
            if sample is not None and sample.number >= start_line:
                build.add(sample, limit)
            chunk = build.take(tell(raw))
            if chunk is not None:
                yield chunk
        finally:
            close_input(inp, stream, raw if raw is not stream else None)
