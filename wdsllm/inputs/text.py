"""Text inputs (`.txt`, `.jsonl`; plain, `.gz`, `.zst`, `.bz2`, `.xz`): chunks that end on document
boundaries, parsed into documents in the tokenizer workers.

The packing process reads and decompresses; a chunk ends after a line (jsonl and ``--split
line``), after a blank line (``--split paragraph``) or at the end of the file (``--split file``),
so no document spans two chunks. An uncompressed file divides between tasks by byte ranges: a
part holds the lines that *start* in its range, and a part that starts inside a file counts the
newlines before it, so that line numbers (the provenance) are those of the whole file.

**Records and --max-doc-bytes.** A record is what the limit is measured on, in bytes of the
input: a line without its newline (line split, jsonl), a paragraph with the blank line that ends it
(paragraph split), the whole file (file split). A longer record is never held whole: the reader
streams past it to the next boundary and hands on a ``too_long`` skip, and a chunk longer than the
limit (which might hold a long record that did fit in one read) has its records measured one by
one. Both measure the same bytes, so the decision never depends on the chunking.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from .sources import (
    OPEN_READS,
    STDIN,
    ParsedChunk,
    ParseOptions,
    Part,
    Skip,
    Units,
    add_text,
    close_input,
    is_read_error,
    json_field,
    lone_surrogate,
    not_text,
    open_decompressed,
    settle,
    tell,
    too_long,
)

_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")  # a blank line and the newline before it (fast: starts with a literal)
_EVERY_BLANK_LINE = re.compile(rb"(?:^|(?<=\n))[ \t\r\f\v]*\n")  # each blank line, consecutive ones too
_FIRST_LINE_BLANK = re.compile(rb"[ \t\r\f\v]*\n")
_WS = b" \t\r\f\v"
_BOM = b"\xef\xbb\xbf"
_COUNT_BLOCK = 8 << 20


@dataclass
class TextChunk:
    """A piece of one text input that ends at a document boundary."""

    file_index: int
    first_line: int  # 1-based line number of the chunk's first byte
    data: bytes
    raw_offset: int = 0  # compressed bytes of the part consumed so far, for progress
    skips: list[Skip] = field(default_factory=list)  # found by the reader (too long, unreadable)
    kind: str = "jsonl"  # "jsonl" or "txt"

    @property
    def text_bytes(self) -> int:
        return len(self.data)

    def parse(self, opts: ParseOptions, display: str) -> ParsedChunk:
        return parse_chunk(self, opts, display)


class TextReader:
    """`.txt` and `.jsonl` inputs."""

    def units(self, inp, opts: ParseOptions) -> Units | None:
        if inp.compression or inp.path == STDIN or (inp.kind == "txt" and opts.split != "line"):
            return None  # a compressed stream cannot be entered in the middle; paragraphs cross lines
        return Units("bytes")

    def chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[TextChunk]:
        return OPEN_READS.track(read_chunks(part, opts.split, chunk_bytes, start_line, opts.max_doc_bytes))


# ----------------------------------------------------------------------------------------------
# Reading (in the packing process).


class _Source:
    """The decompressed stream of a part: from the first line that starts at or after the part's
    start to the end of the last line that starts before its stop."""

    def __init__(self, stream: BinaryIO, part: Part):
        self.stream = stream
        self.end = None if part.whole else part.stop
        self.pos = 0
        self.done = False
        self.carry = b""
        self.first_line = 1
        if not part.whole and part.start > 0:
            self.first_line = self._enter(part.start)

    def _enter(self, start: int) -> int:
        """Count the newlines before ``start - 1``, then go past the first newline at or after it."""
        newlines = 0
        while self.pos < start - 1:
            block = self.stream.read(min(start - 1 - self.pos, _COUNT_BLOCK))
            if not block:
                self.done = True
                return newlines + 1
            newlines += int(np.count_nonzero(np.frombuffer(block, np.uint8) == 10))  # 3x bytes.count
            self.pos += len(block)
        while True:
            block = self.stream.read(1 << 16)
            if not block:
                self.done = True
                return newlines + 1
            j = block.find(b"\n")
            if j >= 0:
                self.pos += j + 1
                self.carry = block[j + 1 :]
                self.done = self.end is not None and self.pos >= self.end
                return newlines + 2
            self.pos += len(block)

    def read(self, n: int) -> bytes:
        if self.done:
            return b""
        if self.carry:
            block, self.carry = self.carry, b""
        else:
            block = self.stream.read(n)
        if not block:
            self.done = True
            return b""
        if self.end is not None and self.pos + len(block) >= self.end:
            j = block.find(b"\n", max(0, self.end - 1 - self.pos))
            if j >= 0:  # the line that holds the part's last byte ends here
                block = block[: j + 1]
                self.done = True
        self.pos += len(block)
        return block


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
        if last is None:  # data starts at a line start: a blank first line ends a record too
            m = _FIRST_LINE_BLANK.match(data)
            return m.end() if m else 0
        return last.end()
    return data.rfind(b"\n") + 1


class _Skipper:
    """Streams past the rest of a too-long record, keeping only its size and newline count."""

    def __init__(self, split: str, seen: bytes):
        self.split = split
        self.size = len(seen)
        self.newlines = seen.count(b"\n")
        tail = seen[seen.rfind(b"\n") + 1 :]
        self.blank = not tail.strip(_WS)  # the current line so far is blank (paragraph split)

    def feed(self, block: bytes) -> bytes | None:
        """The bytes after the record's end, or None while the record goes on."""
        if self.split == "file":
            self.size += len(block)
            return None
        if self.split == "line":
            j = block.find(b"\n")
            if j < 0:
                self.size += len(block)
                return None
            self.size += j
            self.newlines += 1
            return block[j + 1 :]
        pos = 0
        while True:  # paragraph: up to the end of the next blank line
            j = block.find(b"\n", pos)
            if j < 0:
                self.blank = self.blank and not block[pos:].strip(_WS)
                self.size += len(block)
                return None
            self.newlines += 1
            if self.blank and not block[pos:j].strip(_WS):
                self.size += j + 1
                return block[j + 1 :]
            self.blank = True
            pos = j + 1


_READ_BLOCK = 1 << 20  # what is asked of the (decompressing) stream at a time, whatever chunk_bytes is


def _blocks(src: _Source, chunk_bytes: int) -> Iterator[bytes | BaseException]:
    """The part's bytes in pieces of at most chunk_bytes, then the read error that ended it, if any.

    The stream is always asked for the same amounts, so a damaged stream fails at the same place,
    and what was read before it is the same, whatever ``chunk_bytes`` is."""
    while True:
        try:
            block = src.read(_READ_BLOCK)
        except Exception as exc:
            if not is_read_error(exc):
                raise
            yield exc
            return
        if not block:
            return
        for i in range(0, len(block), chunk_bytes):
            yield block[i : i + chunk_bytes]


def read_chunks(
    part: Part, split: str, chunk_bytes: int = 1 << 20, start_line: int = 1, max_doc_bytes: int | None = None
) -> Iterator[TextChunk]:
    """Decompressed chunks of ~chunk_bytes that end on document boundaries, from start_line on."""
    inp = part.input
    split = "line" if inp.kind == "jsonl" else split
    chunk_bytes = max(16, chunk_bytes)
    stream, raw = open_decompressed(inp)
    try:
        src = _Source(stream, part)
        cutter = _ChunkCutter(inp, split, start_line, max_doc_bytes or 0, raw, part, src.first_line)
        yield from cutter.chunks(_blocks(src, chunk_bytes))
    finally:
        close_input(inp, stream, raw if raw is not stream else None)


class _ChunkCutter:
    """Cuts a stream's blocks into chunks that end on document boundaries, streaming past a
    record longer than ``limit`` bytes (one skip) instead of holding it."""

    def __init__(self, inp, split: str, start_line: int, limit: int, raw, part: Part, first_line: int) -> None:
        self.inp = inp
        self.split = split
        self.start_line = start_line
        self.limit = limit
        self.raw = raw
        self.base = part.start if part.unit == "bytes" else 0  # progress is counted within the part
        self.first_block = part.start == 0
        self.line = first_line
        self.pending = b""
        self.skipper: _Skipper | None = None
        self.flagged = 0  # the line where the record being skipped starts

    def _offset(self) -> int:
        return tell(self.raw) - self.base

    def chunks(self, blocks: Iterator[bytes | BaseException]) -> Iterator[TextChunk]:
        while True:
            block = next(blocks, b"")
            error = block if isinstance(block, BaseException) else None
            if error is not None:
                block = b""
            if self.first_block:
                self.first_block = False
                if block.startswith(_BOM):  # editors on Windows write one; json.loads refuses it
                    block = block[len(_BOM) :]
            final = not block
            if self.skipper is not None:
                block = yield from self._past_skipped(block, error, final)
                if final:
                    break
                if not block:
                    continue
            yield from self._cut(block, error, final)
            if final:
                break

    def _past_skipped(self, block: bytes, error: BaseException | None, final: bool) -> Iterator[TextChunk]:
        """Feed ``block`` to the skipper; returns the bytes after the skipped record once it ends
        (None while it goes on)."""
        inp, skipper = self.inp, self.skipper
        rest = skipper.feed(block)
        if rest is None and not final:
            return None
        if error is None:
            skip = too_long(inp.index, self.flagged, skipper.size, self.limit)
            yield TextChunk(inp.index, self.flagged, b"", self._offset(), [skip], inp.kind)
        self.line = self.flagged + skipper.newlines
        self.skipper = None
        if final and error is not None:
            yield _unreadable(inp, self.flagged, error, self._offset())
        return rest

    def _cut(self, block: bytes, error: BaseException | None, final: bool) -> Iterator[TextChunk]:
        """The chunk of whole records that ``block`` completes; the rest stays pending."""
        inp, limit = self.inp, self.limit
        data = self.pending + block if self.pending else block
        cut = _cut(data, self.split, final and error is None)  # a damaged stream's last record is lost
        if cut == 0 and not final:
            if limit and len(data) > limit:  # one record, already too long: stream past it
                self.skipper, self.flagged, self.pending = _Skipper(self.split, data), self.line, b""
            else:
                self.pending = data
            return
        piece, self.pending = data[:cut], data[cut:]
        if piece:
            piece, self.line = _skip_to(piece, self.line, self.start_line)
            if piece:
                chunk = TextChunk(inp.index, self.line, piece, self._offset(), kind=inp.kind)
                if limit and len(piece) > limit:
                    _drop_long_records(chunk, self.split, limit)
                yield chunk
                self.line += piece.count(b"\n")
        if final and error is not None:
            yield _unreadable(inp, self.line, error, self._offset())


def _unreadable(inp, line: int, exc: BaseException, raw_offset: int) -> TextChunk:
    """The rest of a damaged stream, from ``line`` on: one skip (what came before is kept)."""
    skip = Skip(inp.index, line, "unreadable", str(exc), f"cannot decompress after line {line - 1}: {exc}")
    return TextChunk(inp.index, line, b"", raw_offset, [skip], inp.kind)


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


def _records(data: bytes, split: str) -> Iterator[tuple[int, int, int]]:
    """(start, end, size) of each record of a chunk; [start, end) is what a skip blanks out."""
    if split == "file":
        yield 0, len(data), len(data)
        return
    if split == "line":
        start = 0
        while start < len(data):
            j = data.find(b"\n", start)
            end = len(data) if j < 0 else j
            yield start, end, end - start
            start = end + 1
        return
    start = 0
    for m in _EVERY_BLANK_LINE.finditer(data):
        yield start, m.end(), m.end() - start
        start = m.end()
    if start < len(data):
        yield start, len(data), len(data) - start


def _drop_long_records(chunk: TextChunk, split: str, limit: int) -> None:
    """Blank out (keeping the newlines, so line numbers hold) every record over the limit."""
    data = chunk.data
    kept, pos, line = [], 0, chunk.first_line
    for start, end, size in _records(data, split):
        line += data.count(b"\n", pos, start)
        if size > limit:
            chunk.skips.append(too_long(chunk.file_index, line, size, limit))
            kept.append(data[pos:start])
            kept.append(b"\n" * data.count(b"\n", start, end))
            line += data.count(b"\n", start, end)
            pos = end
        else:
            line += data.count(b"\n", start, end)
            kept.append(data[pos:end])
            pos = end
    kept.append(data[pos:])
    chunk.data = b"".join(kept)


# ----------------------------------------------------------------------------------------------
# Parsing (in the workers).


def _decode_lines(chunk: TextChunk, out: ParsedChunk) -> list[tuple[int, str]]:
    """(line number, text) per line; undecodable lines become skips."""
    try:
        text = chunk.data.decode("utf-8")
        return list(enumerate(text.split("\n"), chunk.first_line))
    except UnicodeDecodeError:
        pass
    numbered = []
    for number, raw in enumerate(chunk.data.split(b"\n"), chunk.first_line):
        try:
            numbered.append((number, raw.decode("utf-8")))
        except UnicodeDecodeError as exc:
            message = f"invalid UTF-8 at byte {exc.start} of the line"
            out.skips.append(Skip(chunk.file_index, number, "decode_error", str(exc.reason), message))
    return numbered


def parse_chunk(chunk: TextChunk, opts: ParseOptions, display: str) -> ParsedChunk:
    """Documents of a chunk with their line numbers; bad input raises or is skipped and counted."""
    out = ParsedChunk(skips=list(chunk.skips))
    taken = {s.line for s in chunk.skips}  # records the reader already skipped (blanked out)
    numbered = _decode_lines(chunk, out)
    if numbered and numbered[-1][1] == "":
        numbered.pop()  # the text after the final newline
    if taken:
        numbered = [(n, t) for n, t in numbered if n not in taken]
    file_index = chunk.file_index
    if chunk.kind == "jsonl":
        text_field = opts.text_field
        path = text_field.split(".")
        where = opts.where
        loads = json.loads
        for number, line in numbered:
            if not line.strip():
                out.tally("empty", number)
                continue
            try:
                obj = loads(line)
            except ValueError as exc:
                out.skips.append(Skip(file_index, number, "invalid_json", str(exc), f"invalid JSON: {exc}"))
                continue
            if where is not None and not where.keeps(obj):
                out.tally("filtered", number)
                continue
            text = json_field(obj, path)
            if not isinstance(text, str):
                problem = not_text(text)
                message = f"text field {text_field!r} is {problem}"
                out.skips.append(Skip(file_index, number, "missing_field", f"{text_field!r} {problem}", message))
                continue
            bad = lone_surrogate(file_index, number, text, text_field)
            if bad is not None:
                out.skips.append(bad)
                continue
            add_text(out, number, text)
        return settle(out, opts, display, "line")
    split = opts.split
    if split == "line":
        for number, line in numbered:
            add_text(out, number, line[:-1] if line.endswith("\r") else line)
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
                add_text(out, start, "\n".join(para))
                para = []
        if para:
            add_text(out, start, "\n".join(para))
    elif chunk.first_line not in taken:  # whole file (unless the reader skipped it)
        text = "\n".join(line for _, line in numbered)
        if chunk.data.endswith(b"\n"):
            text += "\n"
        add_text(out, chunk.first_line, text.replace("\r\n", "\n"))
    return settle(out, opts, display, "line")
