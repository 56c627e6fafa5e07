"""One part of a dataset packed from records: the call that every cluster engine's task makes.

``pack_part(records, part_id, out, options)`` packs an iterator of records (dicts holding the
text, and optionally where it came from) into ``out/part-NNNNN/``, a complete pack output of its
own that ``wdsllm merge`` joins with the others. The call is pure and committing:

- the part's name comes from ``part_id`` (a Ray write task's index, a datatrove rank), never from
  an attempt or a worker, so a retried or duplicated attempt writes the same directory;
- shards are written under temporary names and published whole; the part's ``index.json`` (its
  manifest) is written last: a part with a manifest is complete, one without is not;
- a part is tied to what it holds (:mod:`.rows`): its manifest records the count and digest of
  the records it was packed from, and a part whose manifest matches the options is returned as it
  is only when the attempt's records (read, not tokenized) are the same, in the same order;
- after every shard a journal record holds the shard's entry and the cursor (the number of
  records consumed, plus where the shaper stands inside the last document) with the digest of the
  records up to it, so an attempt that finds an interrupted part checks and skips the records
  already packed, without tokenizing them, and continues from there. The result is
  byte-identical to an uninterrupted part, provided the records come again in the same order (the
  engines replay a task's input as it was);
- a part found holding other records (a run split otherwise left it) is refused by name, never
  reused and never replaced: that run's other parts would hold some of these records again.

Provenance: with ``sources`` (the dataset's input names, in the order a ``wdsllm pack`` of them
would take), a record's ``source`` and ``line`` fields give its documents the same provenance as
that pack. Without it, a part is an input of its own (index ``part_id``), and a document's line
is its record's 1-based number in the part.

``pack_part_files(urls, part_id, out, options)`` is the same call over input files, read as
``wdsllm pack`` reads them; its cursor is a file and line, where a resumed attempt seeks to.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import numbers
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from .. import __version__, storage
from .. import format as fmt
from ..errors import OtherRowsError, PackError
from ..inputs.registry import reader_for
from ..inputs.sources import (
    STDIN,
    ParsedChunk,
    Skip,
    add_text,
    expand_inputs,
    json_field,
    lone_surrogate,
    not_text,
    settle,
    too_long,
)
from ..inputs.sources import Part as InputPart
from .job import (
    PackConfig,
    _input_entry,
    _make_shaper,
    _present_records,
    _remove_unrecorded,
    _resolve_specials,
    _validate,
    _version,
    token_dtype_for,
    write_index,
)
from .lock import STALE_AFTER, OutputLock
from .merge import MAX_PARTS
from .rows import HOLDS, JOURNAL_FIELD, RUN, RowsDigest, other_rows, record_refusal, refusal_of
from .shaping import EncodedChunk, GroupData, Position
from .tokenizer import Encoder, LoadedTokenizer, load_tokenizer
from .writer import JOURNAL_START, Counters, ShardSink, read_journal

log = logging.getLogger(__name__)

PART_DIR_PREFIX = "part-"
#: the most records in one chunk: records that hold no text (empty, skipped) still end a chunk
MAX_CHUNK_RECORDS = 65_536
#: a record's fields that say where it came from (with ``PartOptions.sources``)
SOURCE_FIELD = "source"
LINE_FIELD = "line"
#: how long an attempt waits for a part that another attempt holds: past a remote lock's staleness,
#: so that a retry on another node takes over the part of an attempt that died there
LOCK_WAIT_S = STALE_AFTER + 60.0
LOCK_POLL_S = 5.0
#: the largest part id: what provenance (int64 file indices, when a part is its own input) holds
MAX_PART_ID = (1 << 63) - 1


def part_name(part_id: int) -> str:
    return f"{PART_DIR_PREFIX}{part_id:05d}"


def part_url(out: str, part_id: int) -> str:
    return storage.join_url(out, part_name(part_id))


@dataclass(frozen=True)
class PartOptions:
    """How records become a part. Every option that shapes the output is a ``PackConfig`` field,
    declared there once (``inputs`` and ``output`` are unused here); these are the part's own."""

    pack: PackConfig
    #: the dataset's input names: records' ``source`` fields index it (None: each part is an input)
    sources: tuple[str, ...] | None = None
    #: the most tokens in a shard (a group of more is a shard of its own); ``pack.shard_size``
    #: bytes still caps it
    shard_tokens: int | None = None
    #: parts the dataset has, when the engine knows it up front (datatrove's world size): merge
    #: then names the missing ones
    parts: int | None = None
    #: the run that writes the part, as the engine names its runs (the Ray sink: the output's
    #: state when the run started): recorded in the part's index; merge refuses the parts of a
    #: run that a part of other rows refused (:mod:`.rows`). Not compared: a re-run reuses parts.
    run: str | None = None

    @classmethod
    def of(
        cls,
        tokenizer: str,
        *,
        sources: Iterable[str] | None = None,
        shard_tokens: int | None = None,
        parts: int | None = None,
        run: str | None = None,
        **pack_options: Any,
    ) -> PartOptions:
        """Options from ``wdsllm pack``'s keywords (``mode``, ``seq_len``, ``text_field``, ...)."""
        config = PackConfig(inputs=[], output="", tokenizer=str(tokenizer), **pack_options)
        return cls(config, tuple(sources) if sources is not None else None, shard_tokens, parts, run)

    def output_options(self, part_id: int) -> dict:
        """The options an index of this part holds: what shapes its bytes, and which part it is."""
        options = self.pack.output_options()
        for per_job in ("inputs", "num_tasks", "task_index"):
            options.pop(per_job, None)
        options["part_id"] = part_id
        options["parts"] = self.parts
        options["shard_tokens"] = self.shard_tokens
        options["sources_sha256"] = (
            hashlib.sha256("\n".join(self.sources).encode()).hexdigest() if self.sources is not None else None
        )
        if self.run is not None:  # absent otherwise: such a part's bytes are what they were before runs
            options[RUN] = self.run
        return options


@dataclass(frozen=True)
class PartManifest:
    """What a finished part holds: returned by every attempt that finds or writes it."""

    part_id: int
    url: str
    documents: int
    tokens: int
    shards: int
    skipped: int
    sources: dict = field(default_factory=dict)  # input path -> {"documents": n, "tokens": t}
    digest: str = ""  # sha256 over the shards' sha256s in order: equal digests, equal shards
    resumed_shards: int = 0  # shards an interrupted attempt had written, kept by this one

    @classmethod
    def of(cls, url: str, index: fmt.Index, resumed_shards: int = 0) -> PartManifest:
        shas = "".join(e.sha256 for e in index.shards)
        return cls(
            part_id=int(index.options["part_id"]),
            url=url,
            documents=index.documents,
            tokens=int(index.shards.column("tokens").sum()),
            shards=len(index.shards),
            skipped=int(index.skipped.get("total", 0)),
            sources={i["path"]: {"documents": i["documents"], "tokens": i.get("tokens", 0)} for i in index.inputs},
            digest=hashlib.sha256(shas.encode()).hexdigest(),
            resumed_shards=resumed_shards,
        )


# ----------------------------------------------------------------------------------------------
# The tokenizer, loaded once per process.


class TokenizerCache:
    """The tokenizers this process loaded, keyed by what names them: a Ray worker or a datatrove
    task packs many parts and must not read and parse a tokenizer for each."""

    def __init__(self) -> None:
        self._loaded: dict[tuple, LoadedTokenizer] = {}
        self._encoders: dict[tuple, Encoder] = {}
        self._lock = threading.Lock()

    def tokenizer(self, cfg: PackConfig) -> LoadedTokenizer:
        key = (cfg.tokenizer, cfg.bos_token, cfg.eos_token)
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = load_tokenizer(cfg.tokenizer, bos_token=cfg.bos_token, eos_token=cfg.eos_token)
            return self._loaded[key]

    def encoder(self, tok: LoadedTokenizer, dtype: np.dtype, bos_id: int | None, eos_id: int | None) -> Encoder:
        key = (tok.sha256, dtype.name, bos_id, eos_id)
        with self._lock:
            if key not in self._encoders:
                self._encoders[key] = Encoder(tok.json_text, dtype.name, bos_id, eos_id)
            return self._encoders[key]

    def reset(self) -> None:
        with self._lock:
            self._loaded.clear()
            self._encoders.clear()


TOKENIZERS = TokenizerCache()


# ----------------------------------------------------------------------------------------------
# Records to encoded chunks.


class PartInput(Protocol):
    """What a part is packed from, as encoded chunks in input order; the two kinds are records
    (:class:`RecordInput`) and input files (:class:`FileInput`)."""

    #: real provenance of the documents not written yet, when chunks carry record numbers instead
    origins: Origins | None

    def identity(self) -> list:
        """What besides the options says that an interrupted attempt packed the same input."""
        ...

    def display(self) -> dict[int, str]:
        """Input index (as chunks give it) -> the name skip records give."""
        ...

    def chunks(self, position: Position | None, encoder: Encoder) -> Iterator[EncodedChunk]:
        """Encoded chunks from ``position`` (an interrupted attempt's cursor) on."""
        ...

    def inputs(self, totals: Counters) -> list[dict]:
        """The part index's ``inputs``."""
        ...

    def holds(self) -> dict:
        """What the part holds (its index's ``holds``), once ``chunks`` has read the input to its end."""
        ...

    def check_holds(self, holds: Any) -> None:
        """Refuse a committed part that does not hold this input (``holds``: its index's)."""
        ...

    def note(self, position: Position | None) -> dict:
        """What a journal record holds beside its cursor, for a resumed attempt to check
        (``expect``); positions only grow, so what lies before ``position`` may be forgotten."""
        ...

    def expect(self, record: dict | None) -> None:
        """Have ``chunks`` check the input up to the cursor of ``record`` (an interrupted attempt's
        last journal record) against what the record noted."""
        ...


class RecordInput:
    """Records cut into chunks of about ``chunk_bytes`` of text, parsed as a JSON line is (text
    field, empty and over-long documents, bad records skipped or raised), and encoded.

    Documents are numbered by their record's 1-based position in the part (``ordinal``): the
    shaper and the journal see that number as the line of input ``part_id``, so the cursor is
    monotonic whatever the records' sources. ``origins`` remembers each kept record's real
    (source index, line) until its group is written.
    """

    def __init__(self, records: Iterable[Mapping[str, Any]], options: PartOptions, part_id: int, out: str) -> None:
        self.records = records
        self.options = options
        self.cfg = options.pack
        self.part_id = part_id
        self.name = part_name(part_id)
        self.out = out
        self.rows = RowsDigest()
        self.expected: dict | None = None  # the interrupted attempt's digest at its cursor
        self.sources = {name: i for i, name in enumerate(options.sources)} if options.sources is not None else None
        self.path = self.cfg.text_field.split(".")
        self.where = self.cfg.parse_options().where
        self.origins = Origins() if self.sources is not None else None
        if self.cfg.split != "line" or self.cfg.input_format is not None:
            raise PackError(
                f"{self.name}: split and input_format say how to read input files; a record's text is its "
                f"{self.cfg.text_field!r} field (pack input files with pack_part_files)"
            )

    def identity(self) -> list:
        return [JOURNAL_FIELD]  # journals note the records' digest (one of an older wdsllm is not resumed)

    def display(self) -> dict[int, str]:
        return {self.part_id: self.name}

    def holds(self) -> dict:
        return self.rows.holds()

    def check_holds(self, holds: Any) -> None:
        for record in self.records:  # read, never tokenized
            self.rows.add(record, keep=False)
        if holds != self.rows.holds():
            raise other_rows(part_url(self.out, self.part_id), self.out, holds, self.rows.holds())

    def note(self, position: Position | None) -> dict:
        if position is None:
            return {}
        return {JOURNAL_FIELD: {"records": position.line, "sha256": self.rows.through(position.line)}}

    def expect(self, record: dict | None) -> None:
        self.expected = record.get(JOURNAL_FIELD, {}) if record is not None else None

    def _check_resumed(self, ordinal: int) -> None:
        """The records up to the interrupted attempt's cursor are the ones it packed."""
        found = {"records": ordinal, "sha256": self.rows.through(ordinal)}
        if self.expected != found:
            url = part_url(self.out, self.part_id)
            noted = self.expected if self.expected else None
            raise other_rows(f"{url} (an interrupted attempt's shards)", self.out, noted, found)

    def inputs(self, totals: Counters) -> list[dict]:
        return _record_inputs(self.options, self.part_id, totals)

    def chunks(self, position: Position | None, encoder: Encoder) -> Iterator[EncodedChunk]:
        # the record the cursor stands in is fed again: the shaper skips what of it was written
        skip = position.line - 1 if position is not None else 0
        if skip:
            log.info("%s: skipping %d records already packed", self.name, skip)
        parsed, size, count, ordinal = ParsedChunk(), 0, 0, 0
        for ordinal, record in enumerate(self.records, start=1):
            self.rows.add(record, keep=ordinal > skip)
            if ordinal == skip + 1 and position is not None:
                self._check_resumed(ordinal)
            if ordinal <= skip:
                continue
            size += self._add(parsed, ordinal, record)
            count += 1
            if size >= self.cfg.chunk_bytes or count >= MAX_CHUNK_RECORDS:
                yield self._encode(parsed, encoder)
                parsed, size, count = ParsedChunk(), 0, 0
        if ordinal < skip:
            raise PackError(
                f"{self.name}: the records ended after {ordinal}, but an earlier attempt packed {skip}; the "
                "input of a part must be the same on every attempt"
            )
        if parsed.lines or parsed.skips or parsed.tallies:
            yield self._encode(parsed, encoder)

    def _add(self, out: ParsedChunk, ordinal: int, record: Mapping[str, Any]) -> int:
        if not isinstance(record, Mapping):  # what a JSON line that is not an object is
            problem = f"not a mapping of fields ({type(record).__name__} {record!r:.40})"
            out.skips.append(Skip(self.part_id, ordinal, "missing_field", problem, f"the record is {problem}"))
            return 0
        if self.where is not None and not self.where.keeps(record):  # before the text, as for a JSON line
            out.tally("filtered", ordinal)
            return 0
        text = json_field(record, self.path)
        if not isinstance(text, str):
            problem = not_text(text)
            detail = f"{self.cfg.text_field!r} {problem}{self._where(record)}"
            message = f"text field {self.cfg.text_field!r} is {problem}{self._where(record)}"
            out.skips.append(Skip(self.part_id, ordinal, "missing_field", detail, message))
            return 0
        bad = lone_surrogate(self.part_id, ordinal, text, self.cfg.text_field)
        if bad is not None:
            out.skips.append(replace(bad, message=bad.message + self._where(record)))
            return 0
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.cfg.max_doc_bytes:
            out.skips.append(too_long(self.part_id, ordinal, size, self.cfg.max_doc_bytes))
            return 0
        before = len(out.lines)
        add_text(out, ordinal, text)
        if self.origins is not None and len(out.lines) > before:
            self.origins.add(ordinal, self._origin(record, ordinal))
        return size

    def _origin(self, record: Mapping[str, Any], ordinal: int) -> tuple[int, int]:
        source, line = record.get(SOURCE_FIELD), record.get(LINE_FIELD)
        if source not in self.sources:
            raise PackError(f"{self.name}: record {ordinal} names source {source!r}, which is not in sources")
        if not isinstance(line, int) or isinstance(line, bool) or line < 0:
            raise PackError(f"{self.name}: record {ordinal} has no integer {LINE_FIELD!r} ({line!r})")
        return self.sources[source], line

    def _where(self, record: Mapping[str, Any]) -> str:
        source, line = record.get(SOURCE_FIELD), record.get(LINE_FIELD)
        return f" ({source}:{line})" if source is not None else ""

    def _encode(self, parsed: ParsedChunk, encoder: Encoder) -> EncodedChunk:
        settle(parsed, self.cfg.parse_options(), self.name, "record")
        return encode_parsed(self.part_id, parsed, encoder, text_bytes=sum(map(len, parsed.texts)))


class FileInput:
    """Input files (URLs, globs, directories: what ``wdsllm pack`` takes), read in the order of
    ``sources``, which must name every one of them: a document's provenance is then its file's
    place in ``sources`` and its line, as in a ``wdsllm pack`` of all of them."""

    def __init__(self, urls: Iterable[str], options: PartOptions, part_id: int, out: str) -> None:
        self.cfg = options.pack
        self.url, self.out = part_url(out, part_id), out
        if options.sources is None:
            raise PackError("packing input files into a part needs sources: every part's input names, in one order")
        where = {name: i for i, name in enumerate(options.sources)}
        found = expand_inputs([str(u) for u in urls], self.cfg.input_format)
        for inp in found:
            if inp.path == STDIN:
                raise PackError("a part cannot be packed from stdin: a retried attempt could not read it again")
            if inp.display not in where:
                raise PackError(f"{part_name(part_id)}: input {inp.display} is not in sources")
            if self.cfg.where and inp.kind == "txt":
                raise PackError(f"--where reads fields, and {inp.display} is plain text")
        self.files = sorted((replace(i, index=where[i.display]) for i in found), key=lambda i: i.index)
        self.origins = None

    def identity(self) -> list:
        return [(i.display, i.size, _version(i)) for i in self.files]

    def holds(self) -> dict:
        return {"files": json.loads(json.dumps(self.identity()))}

    def check_holds(self, holds: Any) -> None:
        if holds != self.holds():
            raise other_rows(self.url, self.out, holds, self.holds())

    def note(self, position: Position | None) -> dict:
        return {}  # the journal's fingerprint holds the files' identities

    def expect(self, record: dict | None) -> None:
        pass

    def display(self) -> dict[int, str]:
        return {i.index: i.display for i in self.files}

    def inputs(self, totals: Counters) -> list[dict]:
        entries = []
        for inp in self.files:
            entry = _input_entry(InputPart(inp, size=inp.size), totals)
            entry["tokens"] = totals.tokens_by_input.get(inp.index, 0)
            entry["part"] = {"unit": "bytes", "start": 0, "stop": inp.size}  # merge refuses a file in two parts
            entries.append(entry)
        return entries

    def chunks(self, position: Position | None, encoder: Encoder) -> Iterator[EncodedChunk]:
        opts = self.cfg.parse_options()
        if position is not None:
            log.info(
                "skipping to %s:%d, where the interrupted attempt stopped", self.display()[position.file], position.line
            )
        for inp in self.files:
            if position is not None and inp.index < position.file:
                continue
            start_line = position.line if position is not None and inp.index == position.file else 1
            for chunk in reader_for(inp.kind).chunks(
                InputPart(inp, size=inp.size), opts, self.cfg.chunk_bytes, start_line
            ):
                parsed = chunk.parse(opts, inp.display)
                yield encode_parsed(chunk.file_index, parsed, encoder, chunk.raw_offset, chunk.text_bytes)


def encode_parsed(
    file_index: int, parsed: ParsedChunk, encoder: Encoder, raw_offset: int = 0, text_bytes: int = 0
) -> EncodedChunk:
    """A parsed chunk's texts encoded, in this process (a part's task is the engine's unit of
    parallelism: it encodes what it reads)."""
    tokens, lengths = encoder.encode(parsed.texts)
    lines = np.asarray(parsed.lines, dtype=np.int64)
    keys = parsed.keys
    tallies = {reason: list(found) for reason, found in parsed.tallies.items()}
    if len(lengths) and not lengths.all():  # no BOS nor EOS, and text the tokenizer maps to nothing
        empty = lengths == 0
        tallies.setdefault("empty", []).extend(lines[empty].tolist())
        lines, lengths = lines[~empty], lengths[~empty]
        if keys is not None:
            keys = [k for k, e in zip(keys, empty.tolist()) if not e]
    return EncodedChunk(
        file_index=file_index,
        first_line=int(lines[0]) if len(lines) else 0,
        tokens=tokens,
        lengths=lengths,
        lines=lines,
        skips=parsed.skips,
        raw_offset=raw_offset,
        text_bytes=text_bytes,
        tallies={reason: np.asarray(sorted(found), np.int64) for reason, found in tallies.items() if found},
        keys=keys,
    )


class Origins:
    """Record ordinal -> (source index, line) of the kept records whose group is not written yet."""

    def __init__(self) -> None:
        self._ordinals: list[int] = []
        self._files: list[int] = []
        self._lines: list[int] = []

    def add(self, ordinal: int, origin: tuple[int, int]) -> None:
        self._ordinals.append(ordinal)
        self._files.append(origin[0])
        self._lines.append(origin[1])

    def translate(self, group: GroupData) -> GroupData:
        """The group with real provenance; origins up to its last document are dropped (a later
        group never starts a document before it)."""
        ordinals = np.asarray(self._ordinals, np.int64)
        at = np.searchsorted(ordinals, group.lines)
        if len(at) and (at.max() >= len(ordinals) or not np.array_equal(ordinals[at], group.lines)):
            raise PackError("internal: a group names a record whose origin was not kept")
        files = np.asarray(self._files, np.int64)[at]
        lines = np.asarray(self._lines, np.int64)[at]
        if len(at):
            keep = int(at.max())  # the last document may continue into the next group: keep its origin
            del self._ordinals[:keep], self._files[:keep], self._lines[:keep]
        return replace(group, files=files, lines=lines)


# ----------------------------------------------------------------------------------------------
# The part.


def pack_part(records: Iterable[Mapping[str, Any]], part_id: int, out: str, options: PartOptions) -> PartManifest:
    """Pack ``records`` into ``out/part-NNNNN/`` and return its manifest (see the module's doc).

    An attempt that finds the part committed with the same options reads ``records`` (without
    tokenizing them) and returns its manifest if they are the records it holds; one that finds an
    interrupted attempt's journal checks the records up to its cursor and continues after it; a
    part of other records is refused (:func:`.rows.other_rows`); anything else there (another
    pack's leftovers, a part of other options) is replaced.
    """
    return _pack_part(lambda part: RecordInput(records, options, part, out), part_id, out, options)


def pack_part_files(urls: Iterable[str], part_id: int, out: str, options: PartOptions) -> PartManifest:
    """``pack_part`` of input files (paths, URLs, globs, directories, as ``wdsllm pack`` takes them)
    instead of records: ``options.sources`` names every part's inputs in one order, and merge
    refuses a file packed into two parts. A resumed attempt seeks to the line where it stopped."""
    return _pack_part(lambda part: FileInput(urls, options, part, out), part_id, out, options)


def checked_part_id(part_id: Any, parts: int | None = None) -> int:
    """``part_id`` as an int, refused (before anything is written) unless it can name a part: an
    integer (not a bool) from 0 to MAX_PART_ID, and below ``parts`` where the dataset has so many."""
    if isinstance(part_id, bool) or not isinstance(part_id, numbers.Integral):
        raise PackError(f"part_id must be an integer, not {part_id!r:.40} ({type(part_id).__name__})")
    if not 0 <= part_id <= MAX_PART_ID:
        raise PackError(f"part_id must be from 0 to {MAX_PART_ID:,}, not {part_id:,}")
    if parts is not None and part_id >= parts:
        raise PackError(f"part_id {part_id:,} is not one of the dataset's {parts:,} parts (0 to {parts - 1:,})")
    return int(part_id)


def _pack_part(make_input: Callable[[int], PartInput], part_id: Any, out: str, options: PartOptions) -> PartManifest:
    parts = options.parts
    if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int) or not 0 < parts <= MAX_PARTS):
        raise PackError(f"parts must be an integer from 1 to {MAX_PARTS:,}, not {parts!r:.40}")
    part_id = checked_part_id(part_id, parts)
    cfg = options.pack
    _validate(cfg)
    if options.shard_tokens is not None and options.shard_tokens < 1:
        raise PackError("shard_tokens must be positive")
    if options.run is not None and not isinstance(options.run, str):
        raise PackError(f"run must be a string naming the run, not {options.run!r:.40}")
    _stop_if_refused(out, options.run, part_id)
    tok = TOKENIZERS.tokenizer(cfg)
    source = make_input(part_id)
    url = part_url(out, part_id)
    output = storage.Output(url)
    lock = OutputLock(output, "pack part")
    try:
        _acquire(lock, url)
        expected = _expected_options(options, part_id, tok)
        committed = _committed(output, expected, tok)
        if committed is not None:
            source.check_holds(committed.options.get(HOLDS))
            log.info("%s is already complete and holds this task's input; kept as it is", url)
            return PartManifest.of(url, committed)
        journal = _prepare(output, cfg.prefix, _fingerprint(expected, tok, source.identity()))
        source.expect(journal[-1] if journal else None)
        index = _pack_input(source, part_id, output, options, tok, journal, lock)
        if index.options != {**expected, HOLDS: source.holds()}:
            raise PackError(f"internal: {url} was written with options other than its fingerprint's")
        return PartManifest.of(url, index, resumed_shards=len(journal))
    except OtherRowsError as refused:
        if options.run is not None:
            record_refusal(out, options.run, part_name(part_id), refused)
        raise
    finally:
        lock.release()
        output.close()


def _stop_if_refused(out: str, run: str | None, part_id: int) -> None:
    """A task of a run that another of its tasks saw refused stops before writing: the run splits
    its input otherwise than the parts in ``out``, so what it would add is what merge refuses."""
    if run is None:
        return
    refused = refusal_of(out, run)
    if refused is not None:
        raise OtherRowsError(
            f"{part_url(out, part_id)}: not packed, as run {run!r} was refused at {refused['part']} "
            f"({refused['reason']})"
        )


def _acquire(lock: OutputLock, url: str) -> None:
    """The part's lock, waited for while another attempt holds it: a duplicate (speculative) attempt
    then finds the part that one committed, and a retry the part of an attempt that died on
    another node once its heartbeat is stale. Bounded: after ``LOCK_WAIT_S`` the refusal is raised."""
    deadline = time.monotonic() + LOCK_WAIT_S
    for attempt in itertools.count():
        try:
            lock.acquire()
            return
        except PackError as refused:
            if time.monotonic() >= deadline:
                raise PackError(f"{refused} (waited {LOCK_WAIT_S:.0f} s for it)") from None
            if attempt == 0:
                log.info("%s: %s; waiting up to %.0f s for it", url, refused, LOCK_WAIT_S)
            time.sleep(LOCK_POLL_S)


def _expected_options(options: PartOptions, part_id: int, tok: LoadedTokenizer) -> dict:
    use_bos, _, eos_id = _resolve_specials(options.pack, tok)
    expected = options.output_options(part_id)
    expected["bos"], expected["eos"] = use_bos, eos_id is not None
    return expected


def _fingerprint(expected: dict, tok: LoadedTokenizer, inputs: list) -> str:
    """What an interrupted attempt must share with this one to be continued (not the run: a re-run
    continues a part its crashed run left, the records the journal vouches for checked)."""
    shaping = {k: v for k, v in expected.items() if k != RUN}
    ident = {"options": shaping, "tokenizer": tok.sha256, "inputs": inputs}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _committed(output: storage.Output, expected: dict, tok: LoadedTokenizer) -> fmt.Index | None:
    """The part's index when it is complete and was packed with these options and tokenizer
    (whatever it holds: the input checks that)."""
    if output.get_bytes(fmt.INDEX_NAME) is None:
        return None
    index, _ = fmt.read_index(output.url)
    options = {k: v for k, v in index.options.items() if k not in _NOT_SHAPING}
    if options == {k: v for k, v in expected.items() if k not in _NOT_SHAPING} and index.tokenizer.sha256 == tok.sha256:
        if index.options.get("parts") != expected["parts"]:
            raise _other_split(output.url, index.options.get("parts"), expected["parts"])
        return index
    log.warning("%s holds a part packed with other options; replacing it", output.url)
    return None


#: index options that say which run and split a part belongs to, not how its bytes are shaped: a
#: part that differs only in them is another run's (reused: ``run``) or another split's (refused)
_NOT_SHAPING = (HOLDS, RUN, "parts")


def _other_split(url: str, found: Any, here: int | None) -> OtherRowsError:
    return OtherRowsError(
        f"{url} is one of {found if found is not None else 'an unknown number of'} parts; this task is one of "
        f"{here if here is not None else 'an unknown number'}: a run that split its input into another number of "
        "parts left it, and packing this task there would leave that run's other parts holding some of these rows, "
        "or missing others. Re-run with that run's number of parts, or remove every part-*/ of the output to pack "
        "them anew"
    )


def _prepare(output: storage.Output, prefix: str, fingerprint: str) -> list[dict]:
    """The journal of an interrupted attempt with the same options (its shards kept, anything after
    them removed); otherwise an empty directory with a new journal start."""
    started = output.get_bytes(JOURNAL_START)
    if started is not None and json.loads(started).get("fingerprint") == fingerprint:
        journal = _present_records(output, read_journal(output, lengths=False))
        _remove_unrecorded(output, prefix, len(journal))
        if journal:
            return journal
    if not output.is_empty():
        output.clear()
    start = {"fingerprint": fingerprint, "created_by": f"wdsllm {__version__}"}
    output.put_bytes(JOURNAL_START, json.dumps(start).encode())
    return []


def _pack_input(
    source: PartInput,
    part_id: int,
    output: storage.Output,
    options: PartOptions,
    tok: LoadedTokenizer,
    journal: list[dict],
    lock: OutputLock,
) -> fmt.Index:
    cfg = options.pack
    _, bos_id, eos_id = _resolve_specials(cfg, tok)
    dtype = token_dtype_for(cfg, tok)
    position = Position.from_json(journal[-1]["position"]) if journal and journal[-1]["position"] else None
    if journal:
        log.info("%s: resuming after %d shards", output.url, len(journal))
    sink = ShardSink(
        output,
        prefix=cfg.prefix,
        task=part_id,
        mode=cfg.mode,
        shard_size=cfg.shard_size,
        shard_samples=cfg.shard_samples,
        first_shard=len(journal),
        first_group=journal[-1]["next_group"] if journal else 0,
        inputs_display=source.display(),
        seq_len=cfg.seq_len,
        note=source.note,
    )
    sink.entries = [fmt.ShardEntry(**rec["entry"]) for rec in journal]
    if journal:
        sink.max_row_segments = journal[-1].get("max_row_segments", 0)
        sink.short_rows = journal[-1].get("short_rows", 0)
    shaper = _make_shaper(cfg, dtype, position)
    writer = GroupWriter(sink, source, options.shard_tokens, lock)
    try:
        for chunk in source.chunks(position, TOKENIZERS.encoder(tok, dtype, bos_id, eos_id)):
            sink.add_skips(chunk.skips, [(chunk.file_index, reason, lines) for reason, lines in chunk.tallies.items()])
            writer.write(shaper.feed(chunk))
        writer.write(shaper.finish())
        sink.finish_shard(final=True)
    except BaseException:
        sink.abort()
        raise
    written = {**_expected_options(options, part_id, tok), HOLDS: source.holds()}
    return write_index(output, options.pack, tok, written, source.inputs, sink)


class GroupWriter:
    """Hands groups to the sink with their real provenance, closing a shard before a group would
    take it past ``shard_tokens`` (the sink itself closes shards by bytes and items); the output
    lock's heartbeat beats with every shard, so that a live attempt's lock never looks abandoned.
    After each group the input hears its position (``note``): no later journal record's cursor
    lies before it."""

    def __init__(self, sink: ShardSink, source: PartInput, shard_tokens: int | None, lock: OutputLock) -> None:
        self.sink = sink
        self.source = source
        self.origins = source.origins
        self.shard_tokens = shard_tokens
        self.lock = lock
        self.open_tokens = 0  # tokens in the shard the sink has open

    def write(self, groups: list[GroupData]) -> None:
        for group in groups:
            size = len(group.tokens)
            if self.shard_tokens and self.open_tokens and self.open_tokens + size > self.shard_tokens:
                self.sink.finish_shard()
                self.open_tokens = 0
            shards = len(self.sink.entries)
            self.sink.write(self.origins.translate(group) if self.origins is not None else group)
            self.source.note(group.position)
            if len(self.sink.entries) != shards:
                self.open_tokens = size
                self.lock.refresh()
            else:
                self.open_tokens += size


def _record_inputs(options: PartOptions, part_id: int, totals: Counters) -> list[dict]:
    """The index's inputs: the sources this part holds documents of, or the part itself."""
    if options.sources is None:
        return [
            {
                "index": part_id,
                "path": part_name(part_id),
                "bytes": 0,
                "documents": totals.documents_by_input.get(part_id, 0),
                "tokens": totals.tokens_by_input.get(part_id, 0),
                "skipped": totals.skipped_by_input.get(part_id, 0),
            }
        ]
    return [
        {
            "index": i,
            "path": options.sources[i],
            "bytes": 0,
            "documents": totals.documents_by_input[i],
            "tokens": totals.tokens_by_input.get(i, 0),
            "skipped": 0,  # skipped records are counted by the part (``skipped``), named with their source
        }
        for i in sorted(totals.documents_by_input)
    ]
