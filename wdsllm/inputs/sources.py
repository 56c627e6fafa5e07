"""Inputs of a pack: patterns into files, the seam to the reader of each input kind, and what the
readers hand to the tokenizer workers.

**An input kind is one reader class** (:class:`Reader`), registered in :data:`READERS`: text
(`.txt`, `.jsonl`, plain or compressed) in :mod:`.text`, Parquet and Arrow in :mod:`.columns`,
raw-text WebDataset tars in :mod:`.tarinput`. A reader says how a file may be divided between the
tasks of a pack (its units) and turns its share of a file (a :class:`Part`) into chunks, in input
order. A chunk is the unit of parallel work: the packing process reads (I/O, decompression,
columnar decoding) and the tokenizer workers call ``chunk.parse`` (JSON, text fields, UTF-8,
``--where`` on JSON) and encode, so that reading stays off the tokenizer's critical path.

Every document keeps its provenance: the input's index and a 1-based position in it, the
"line" (a text line, a Parquet/Arrow row, a tar sample). Bad input becomes a :class:`Skip`
(listed in the index, or raised with ``--on-error raise``); empty and filtered documents are only
counted (tallies).
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import sys
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

import braceexpand

from ..errors import SourceError
from ..storage.urls import redact
from . import remote
from .decompress import DAMAGE, decompressing, is_damage

log = logging.getLogger(__name__)

COMPRESSIONS = {".gz": "gz", ".tgz": "gz", ".zst": "zst", ".zstd": "zst", ".bz2": "bz2", ".xz": "xz"}
KINDS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".txt": "txt",
    ".text": "txt",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".arrows": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".tar": "wds",
}
INPUT_FORMATS = ("txt", "jsonl", "parquet", "arrow", "wds")
#: Kinds read as a stream from the start (so also from stdin); the others need random access.
STREAMED = ("txt", "jsonl", "wds")
SPLITS = ("line", "paragraph", "file")
STDIN = "-"
DEFAULT_MAX_DOC_BYTES = 16 << 20
#: Skip reasons that are counted but never listed in the index, nor an error.
UNLISTED = ("empty", "filtered")


@dataclass(frozen=True)
class InputFile:
    index: int  # position in the full expanded input list; provenance refers to it
    path: str  # as expanded ("-" for stdin)
    kind: str  # one of INPUT_FORMATS
    compression: str | None
    size: int  # bytes on disk (compressed), 0 for stdin
    version: str = ""  # a remote object's version (ETag, generation, commit); local files: ""
    mtime_ns: int = 0  # a local file's modification time when it was listed (0: remote, stdin)

    @property
    def identity(self) -> str:
        """What tells this version of the input from a rewritten one: a remote object's version
        (as its store lists it), a local file's size and modification time."""
        if self.path == STDIN or "://" in self.path:
            return self.version
        return f"size={self.size} mtime_ns={self.mtime_ns}"

    @property
    def display(self) -> str:
        if self.path == STDIN:
            return "<stdin>"
        return redact(self.path) if "://" in self.path else self.path


def _kind_and_compression(path: str, input_format: str | None) -> tuple[str | None, str | None]:
    name = path.lower()
    compression = None
    for suffix, comp in COMPRESSIONS.items():
        if name.endswith(suffix):
            compression = comp
            name = name[: -len(suffix)] + (".tar" if suffix == ".tgz" else "")
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
    objects: dict[str, remote.ObjectInfo] = {}  # remote inputs: size and version from the store
    for pattern in patterns:
        if pattern == STDIN:
            paths.append(STDIN)
            continue
        if remote.is_remote_input(pattern):
            listed = remote.expand_remote(
                pattern, lambda url: _kind_and_compression(remote.name_of(url), input_format)[0] is not None
            )
            if not listed:
                raise SourceError(f"no input files match {redact(pattern)!r}")
            objects.update((o.url, o) for o in listed)
            paths.extend(o.url for o in listed)
            continue
        paths.extend(_expand_local(pattern, input_format))
    seen: set[str] = set()
    inputs: list[InputFile] = []
    for path in paths:
        key = path if path == STDIN or path in objects else os.path.realpath(path)
        if key in seen:
            log.warning("input %s is named more than once; reading it once", redact(path))
            continue
        seen.add(key)
        inputs.append(_input_file(len(inputs), path, input_format, objects))
    if sum(p == STDIN for p in paths) > 1:
        raise SourceError("stdin ('-') can be read only once")
    return inputs


def _expand_local(pattern: str, input_format: str | None) -> list[str]:
    """The local files a pattern names, sorted within each directory walk and glob."""
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
    return found


def _input_file(index: int, path: str, input_format: str | None, objects: dict[str, remote.ObjectInfo]) -> InputFile:
    """The input at ``path``: its kind, compression, size and version (a listed object's, or the file's)."""
    if path == STDIN:
        if input_format not in STREAMED:
            raise SourceError(f"reading stdin needs --input-format {', '.join(STREAMED)}")
        return InputFile(index, STDIN, input_format, None, 0)
    kind, compression = _kind_and_compression(remote.name_of(path), input_format)
    if kind is None:
        raise SourceError(
            f"{redact(path)}: unknown input type; name it .txt, .jsonl (optionally compressed), .parquet, "
            ".arrow or .tar, or pass --input-format"
        )
    if compression and kind not in STREAMED:
        raise SourceError(f"{redact(path)}: a compressed {kind} file cannot be read; {kind} files compress inside")
    if path in objects:
        obj = objects[path]
        return InputFile(index, path, kind, compression, obj.size, obj.version)
    st = os.stat(path)
    return InputFile(index, path, kind, compression, st.st_size, mtime_ns=st.st_mtime_ns)


# ----------------------------------------------------------------------------------------------
# Opening inputs: the one place that knows where bytes come from (local files, stdin, and every
# URL wdsllm.storage serves: streamed, retried and resumed where a body broke).


def open_input(path: str, size: int | None = None, version: str = "") -> BinaryIO:
    """A binary stream of the input's bytes from its start (``size``: a remote object's, if known;
    ``version``: the one listed, which every read of a remote object is pinned to)."""
    if path == STDIN:
        return sys.stdin.buffer
    if remote.is_remote_input(path):
        return remote.open_remote_stream(path, size, version)
    try:
        return open(path, "rb")
    except OSError as exc:
        raise SourceError(f"{path}: cannot open: {exc.strerror or exc}") from None


def open_seekable(path: str, size: int | None = None, version: str = "") -> BinaryIO:
    """A seekable binary file of the input, for readers that read ranges (Parquet's footer and
    column chunks, Arrow's record batches); a remote one reads each range with a ranged request,
    of the ``version`` listed."""
    if path == STDIN:
        raise SourceError("stdin cannot be read as Parquet or Arrow: they need random access")
    if remote.is_remote_input(path):
        if size is None:
            listed = remote.stat_object(path)
            size, version = listed.size, version or listed.version
        return remote.open_remote_seekable(path, size, version)
    return open_input(path)


def check_unchanged(inp: InputFile, f: BinaryIO) -> None:
    """Refuse a local input opened as ``f`` that is not the version listed (rewritten, even at the
    same size): its documents would differ from those planned, counted or resumed from."""
    if not inp.mtime_ns:
        return
    st = os.fstat(f.fileno())
    if st.st_size != inp.size or st.st_mtime_ns != inp.mtime_ns:
        raise SourceError(
            f"{inp.display}: changed since it was listed (size {inp.size} -> {st.st_size}, mtime_ns "
            f"{inp.mtime_ns} -> {st.st_mtime_ns}); its documents would not be the ones planned: start again "
            "(and run `wdsllm count` again if it has a count sidecar)"
        )


def open_decompressed(inp: InputFile) -> tuple[BinaryIO, BinaryIO]:
    """The decompressed stream and the raw one under it (whose position tells the progress); a
    truncated or damaged compressed stream raises a read error (:mod:`.decompress`), a local
    input rewritten since it was listed a :class:`SourceError`, a remote one replaced since it
    was listed a :class:`~wdsllm.errors.StorageError` (every read is pinned to its version)."""
    raw = open_input(inp.path, inp.size, inp.version)
    try:
        check_unchanged(inp, raw)
        return decompressing(raw, inp.compression), raw
    except BaseException:
        raw.close()
        raise


def close_input(inp: InputFile, *streams: BinaryIO | None) -> None:
    if inp.path == STDIN:
        return
    for s in streams:
        if s is not None:
            s.close()


def tell(raw: BinaryIO | None) -> int:
    try:
        return raw.tell() if raw is not None else 0
    except (OSError, ValueError, AttributeError):
        return 0


#: Exceptions that mean "the compressed stream (or the input under it) is damaged".
READ_ERRORS = DAMAGE


def is_read_error(exc: BaseException) -> bool:
    return is_damage(exc)


# ----------------------------------------------------------------------------------------------
# Shares of inputs between tasks.


@dataclass(frozen=True)
class Part:
    """A task's share of one input: all of it, or its units ``[start, stop)`` of kind ``unit``
    ("bytes": lines that start in that byte range; "row_groups"; "batches")."""

    input: InputFile
    unit: str | None = None  # None: the whole file
    start: int = 0
    stop: int = 0
    size: int = 0  # bytes of input it covers (progress)

    @property
    def whole(self) -> bool:
        return self.unit is None

    def to_json(self) -> dict | None:
        return None if self.whole else {"unit": self.unit, "start": self.start, "stop": self.stop}


# ----------------------------------------------------------------------------------------------
# What readers give the workers, and what the workers give back.


@dataclass
class Skip:
    """Bad input at a line (row, sample): listed in the index, or an error with --on-error raise."""

    file_index: int
    line: int  # 0: the whole file
    reason: str  # invalid_json, missing_field, decode_error, too_long, unreadable
    detail: str = ""
    message: str = ""  # the error's text, without the place
    count: int = 1  # documents it stands for (a missing column skips every row of the file)
    key: str | None = None  # a tar sample's key


@dataclass(frozen=True)
class ParseOptions:
    """What the workers need to turn a chunk into documents (set once per worker)."""

    split: str = "line"
    text_field: str = "text"
    on_error: str = "raise"
    where: Any = None  # a where.Where, or None
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES


@dataclass
class ParsedChunk:
    texts: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    tallies: dict[str, list[int]] = field(default_factory=dict)  # unlisted reason -> lines
    keys: list[str] | None = None  # tar inputs: the sample key of each text

    def tally(self, reason: str, line: int) -> None:
        self.tallies.setdefault(reason, []).append(line)


class Chunk(Protocol):
    """A piece of one input that holds whole documents; parsed in a worker."""

    file_index: int
    raw_offset: int  # input bytes consumed up to it, relative to the part (progress)

    @property
    def text_bytes(self) -> int: ...

    def parse(self, opts: ParseOptions, display: str) -> ParsedChunk: ...


@dataclass(frozen=True)
class Units:
    """How a file divides between tasks: ``name`` ("bytes", "row_groups", "batches") and the byte
    offset where each unit starts (None for "bytes": any line start is one)."""

    name: str
    starts: list[int] | None = None


class Reader(Protocol):
    """One input kind."""

    def units(self, inp: InputFile, opts: ParseOptions) -> Units | None:
        """How the file divides between tasks; None: whole files only."""
        ...

    def chunks(self, part: Part, opts: ParseOptions, chunk_bytes: int, start_line: int) -> Iterator[Chunk]:
        """The part's documents in chunks of about ``chunk_bytes``, from ``start_line`` on (--resume)."""
        ...


class _OpenReads:
    """Chunk iterators begun and not finished, closed at interpreter exit while the modules their
    ``finally`` blocks use still exist: a generator dropped half-read (a loader with
    ``num_workers=0`` left at exit) is otherwise finalized after module teardown, where its cleanup
    fails with "Exception ignored ... 'NoneType' object is not callable"."""

    def __init__(self) -> None:
        self.live: weakref.WeakSet = weakref.WeakSet()
        atexit.register(self.close_all)

    def track(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        self.live.add(chunks)
        return chunks

    def close_all(self) -> None:
        for chunks in list(self.live):
            try:
                chunks.close()
            except Exception as exc:  # at exit: say it, never raise
                log.debug("closing an input at exit: %s", exc)
        self.live.clear()


#: every reader's chunk iterators, tracked here (``Reader.chunks`` returns ``OPEN_READS.track(...)``)
OPEN_READS = _OpenReads()


# ----------------------------------------------------------------------------------------------
# Helpers shared by the parsers.


def place(display: str, unit: str, line: int, key: str | None = None) -> str:
    """Where a problem is, as messages say it: ``FILE:LINE``, ``FILE: row N``, ``FILE: sample N (KEY)``."""
    if line == 0:
        return display
    if unit == "line":
        return f"{display}:{line}"
    return f"{display}: {unit} {line}" + (f" ({key})" if key else "")


def settle(out: ParsedChunk, opts: ParseOptions, display: str, unit: str) -> ParsedChunk:
    """Skips in input order (whatever the chunking); with --on-error raise, the first one raises."""
    out.skips.sort(key=lambda s: s.line)
    if out.skips and opts.on_error != "skip":
        s = out.skips[0]
        raise SourceError(f"{place(display, unit, s.line, s.key)}: {s.message or s.reason}")
    return out


def too_long(file_index: int, line: int, size: int, limit: int, key: str | None = None) -> Skip:
    return Skip(
        file_index,
        line,
        "too_long",
        f"{size} bytes",
        f"document of {size} bytes is longer than --max-doc-bytes {limit}",
        key=key,
    )


def not_text(value: Any) -> str:
    return "missing" if value is _MISSING else f"not a string ({'null' if value is None else type(value).__name__})"


_MISSING = object()


def json_field(obj: Any, path: list[str]) -> Any:
    """The value at a dotted path of a JSON object (or any mapping), or :data:`_MISSING`."""
    for part in path:
        if not isinstance(obj, Mapping) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


def lone_surrogate(file_index: int, line: int, text: str, text_field: str, key: str | None = None) -> Skip | None:
    """A ``decode_error`` skip for text that is not Unicode a tokenizer takes: a lone surrogate,
    which a JSON escape (``"\\ud800"``) or a caller's string may hold; None for any other text."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        problem = f"a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}"
    return Skip(file_index, line, "decode_error", problem, f"text field {text_field!r} holds {problem}", key=key)


def add_text(out: ParsedChunk, line: int, text: str, key: str | None = None) -> None:
    """A document, unless it is only whitespace (then counted as empty)."""
    if text.strip():
        out.texts.append(text)
        out.lines.append(line)
        if out.keys is not None:
            out.keys.append(key)
    else:
        out.tally("empty", line)
