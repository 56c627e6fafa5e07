"""Input files: expanding patterns, reading them in chunks, and parsing chunks into documents.

Reading (decompression, cutting at line or paragraph boundaries) happens in the packing process;
parsing (JSON, text fields, decoding) happens in the tokenizer workers together with encoding, so
that it runs in parallel. Every document keeps its provenance: input file index and 1-based line.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import json
import logging
import lzma
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import braceexpand

from ..errors import SourceError

log = logging.getLogger(__name__)

COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst", ".bz2": "bz2", ".xz": "xz"}
KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".txt": "txt", ".text": "txt"}
SPLITS = ("line", "paragraph", "file")
STDIN = "-"
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class InputFile:
    index: int  # position in the full expanded input list; provenance refers to it
    path: str  # as expanded ("-" for stdin)
    kind: str  # "txt" or "jsonl"
    compression: str | None
    size: int  # bytes on disk (compressed), 0 for stdin

    @property
    def display(self) -> str:
        return "<stdin>" if self.path == STDIN else self.path


def _kind_and_compression(path: str, input_format: str | None) -> tuple[str | None, str | None]:
    name = path.lower()
    compression = None
    for suffix, comp in COMPRESSIONS.items():
        if name.endswith(suffix):
            compression = comp
            name = name[: -len(suffix)]
            break
    kind = input_format
    if kind is None:
        for suffix, k in KINDS.items():
            if name.endswith(suffix):
                kind = k
                break
    return kind, compression


def expand_inputs(patterns: list[str], input_format: str | None = None) -> list[InputFile]:
    """Files, directories (recursively), globs and brace patterns, in the order given.

    Within one pattern the matches are sorted, so the document order (and so the output) does not
    depend on the file system's listing order.
    """
    paths: list[str] = []
    for pattern in patterns:
        if pattern == STDIN:
            paths.append(STDIN)
            continue
        found: list[str] = []
        for expanded in braceexpand.braceexpand(pattern):
            if os.path.isdir(expanded):
                for root, dirs, files in os.walk(expanded):
                    dirs.sort()
                    for f in sorted(files):
                        full = os.path.join(root, f)
                        if f.startswith(".") or _kind_and_compression(full, input_format)[0] is None:
                            continue
                        found.append(full)
            elif glob.has_magic(expanded):
                found.extend(sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p)))
            elif os.path.isfile(expanded):
                found.append(expanded)
            else:
                raise SourceError(f"input not found: {expanded}")
        if not found:
            raise SourceError(f"no input files match {pattern!r}")
        paths.extend(found)
    seen: set[str] = set()
    inputs: list[InputFile] = []
    for path in paths:
        key = path if path == STDIN else os.path.realpath(path)
        if key in seen:
            log.warning("input %s is named more than once; reading it once", path)
            continue
        seen.add(key)
        if path == STDIN:
            if input_format is None:
                raise SourceError("reading stdin needs --input-format txt or jsonl")
            inputs.append(InputFile(len(inputs), STDIN, input_format, None, 0))
            continue
        kind, compression = _kind_and_compression(path, input_format)
        if kind is None:
            raise SourceError(
                f"{path}: unknown input type; name it .txt or .jsonl (optionally compressed), or pass --input-format"
            )
        inputs.append(InputFile(len(inputs), path, kind, compression, os.path.getsize(path)))
    if sum(p == STDIN for p in paths) > 1:
        raise SourceError("stdin ('-') can be read only once")
    return inputs


def _open_with_raw(inp: InputFile) -> tuple[BinaryIO, BinaryIO | None]:
    """The decompressed stream and the raw file under it (whose position tells the progress)."""
    if inp.path == STDIN:
        return sys.stdin.buffer, None
    raw = open(inp.path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    try:
        if inp.compression == "gz":
            return gzip.GzipFile(fileobj=raw, mode="rb"), raw
        if inp.compression == "bz2":
            return bz2.BZ2File(raw, "rb"), raw
        if inp.compression == "xz":
            return lzma.LZMAFile(raw, "rb"), raw
        if inp.compression == "zst":
            import zstandard

            return zstandard.ZstdDecompressor().stream_reader(raw, closefd=False), raw
    except BaseException:
        raw.close()
        raise
    return raw, raw


@dataclass
class RawChunk:
    """A piece of one input that ends at a document boundary."""

    file_index: int
    first_line: int  # 1-based line number of the chunk's first byte
    data: bytes
    raw_offset: int = 0  # compressed bytes consumed so far, for progress


def _cut(data: bytes, split: str, final: bool) -> int:
    """Where a chunk may end: after the last newline, blank line, or nowhere (whole file)."""
    if final:
        return len(data)
    if split == "file":
        return 0
    if split == "paragraph":
        last = None
        # Search only the tail first: blank lines are frequent in paragraph text.
        tail_start = max(0, len(data) - 65536)
        for m in _BLANK_LINE.finditer(data, tail_start):
            last = m
        if last is None and tail_start:
            for m in _BLANK_LINE.finditer(data):
                last = m
        return last.end() if last else 0
    return data.rfind(b"\n") + 1


def read_chunks(inp: InputFile, split: str, chunk_bytes: int = 1 << 20, start_line: int = 1) -> Iterator[RawChunk]:
    """Decompressed chunks of ~chunk_bytes that end on document boundaries, from start_line on."""
    split = "line" if inp.kind == "jsonl" else split
    chunk_bytes = max(16, chunk_bytes)
    stream, raw = _open_with_raw(inp)
    line = 1
    pending = b""
    first = True
    try:
        while True:
            try:
                block = stream.read(chunk_bytes)
            except (OSError, EOFError, lzma.LZMAError, ValueError) as exc:
                where = line + pending.count(b"\n")
                raise SourceError(f"{inp.display}: cannot decompress after line {where}: {exc}") from exc
            except Exception as exc:  # zstandard raises its own ZstdError
                if type(exc).__name__ != "ZstdError":
                    raise
                where = line + pending.count(b"\n")
                raise SourceError(f"{inp.display}: cannot decompress after line {where}: {exc}") from exc
            if first:
                first = False
                if block.startswith(_BOM):  # editors on Windows write one; json.loads refuses it
                    block = block[len(_BOM) :]
            final = not block
            data = pending + block if pending else block
            cut = _cut(data, split, final)
            if cut == 0 and not final:
                pending = data
                continue
            piece, pending = data[:cut], data[cut:]
            if piece:
                piece, line = _skip_to(piece, line, start_line)
                if piece:
                    yield RawChunk(inp.index, line, piece, _tell(raw))
                    line += piece.count(b"\n")
            if final:
                break
    finally:
        if inp.path != STDIN:
            stream.close()
            if raw is not None:
                raw.close()


def _skip_to(piece: bytes, line: int, start_line: int) -> tuple[bytes, int]:
    """Drop the whole lines of ``piece`` (which starts at ``line``) before ``start_line`` (--resume)."""
    if line >= start_line:
        return piece, line
    lines_in_piece = piece.count(b"\n")
    if line + lines_in_piece < start_line:
        return b"", line + lines_in_piece
    pos = 0
    for _ in range(start_line - line):
        pos = piece.index(b"\n", pos) + 1
    return piece[pos:], start_line


def _tell(raw) -> int:
    try:
        return raw.tell() if raw is not None else 0
    except (OSError, ValueError, AttributeError):
        return 0


# ----------------------------------------------------------------------------------------------
# Parsing (runs in worker processes).


@dataclass
class Skip:
    file_index: int
    line: int
    reason: str  # "invalid_json", "missing_field", "decode_error", "empty"
    detail: str = ""


@dataclass
class ParsedChunk:
    texts: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)


_MISSING = object()


def _field(obj, path: list[str]):
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


def _decode_lines(chunk: RawChunk, display: str, on_error: str, skips: list[Skip]) -> list[tuple[int, str]]:
    """(line number, text) per line; undecodable lines raise or are skipped."""
    try:
        text = chunk.data.decode("utf-8")
        return list(enumerate(text.split("\n"), chunk.first_line))
    except UnicodeDecodeError:
        pass
    out = []
    for number, raw in enumerate(chunk.data.split(b"\n"), chunk.first_line):
        try:
            out.append((number, raw.decode("utf-8")))
        except UnicodeDecodeError as exc:
            if on_error != "skip":
                raise SourceError(f"{display}:{number}: invalid UTF-8 at byte {exc.start} of the line") from None
            skips.append(Skip(chunk.file_index, number, "decode_error", str(exc.reason)))
    return out


def parse_chunk(chunk: RawChunk, *, kind: str, split: str, text_field: str, on_error: str, display: str) -> ParsedChunk:
    """Documents of a chunk with their line numbers; bad input raises or is skipped and counted."""
    out = ParsedChunk()
    numbered = _decode_lines(chunk, display, on_error, out.skips)
    if numbered and numbered[-1][1] == "":
        numbered.pop()  # the text after the final newline
    if kind == "jsonl":
        path = text_field.split(".")
        loads = json.loads
        for number, line in numbered:
            if not line.strip():
                out.skips.append(Skip(chunk.file_index, number, "empty", "blank line"))
                continue
            try:
                obj = loads(line)
            except ValueError as exc:
                if on_error != "skip":
                    raise SourceError(f"{display}:{number}: invalid JSON: {exc}") from None
                out.skips.append(Skip(chunk.file_index, number, "invalid_json", str(exc)))
                continue
            text = _field(obj, path)
            if not isinstance(text, str):
                problem = (
                    "missing"
                    if text is _MISSING
                    else f"not a string ({'null' if text is None else type(text).__name__})"
                )
                if on_error != "skip":
                    raise SourceError(f"{display}:{number}: text field {text_field!r} is {problem}")
                out.skips.append(Skip(chunk.file_index, number, "missing_field", f"{text_field!r} {problem}"))
                continue
            _add(out, chunk.file_index, number, text)
        return _in_line_order(out)
    if split == "line":
        for number, line in numbered:
            _add(out, chunk.file_index, number, line[:-1] if line.endswith("\r") else line)
    elif split == "paragraph":
        para: list[str] = []
        start = 0
        for number, line in numbered:
            line = line[:-1] if line.endswith("\r") else line
            if line.strip():
                if not para:
                    start = number
                para.append(line)
            elif para:
                _add(out, chunk.file_index, start, "\n".join(para))
                para = []
        if para:
            _add(out, chunk.file_index, start, "\n".join(para))
    else:  # whole file
        text = "\n".join(line for _, line in numbered)
        if chunk.data.endswith(b"\n"):
            text += "\n"
        _add(out, chunk.file_index, chunk.first_line, text.replace("\r\n", "\n"))
    return _in_line_order(out)


def _in_line_order(out: ParsedChunk) -> ParsedChunk:
    """Decode errors are found before the other skips; the index lists skips in input order
    whatever the chunking, so sort them (stable: one line never has two skips)."""
    out.skips.sort(key=lambda s: s.line)
    return out


def _add(out: ParsedChunk, file_index: int, line: int, text: str) -> None:
    if text.strip():
        out.texts.append(text)
        out.lines.append(line)
    else:
        out.skips.append(Skip(file_index, line, "empty"))
