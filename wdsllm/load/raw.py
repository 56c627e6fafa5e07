"""Raw text as a loader source: the inputs ``wdsllm pack`` reads, tokenized in the DataLoader workers.

A raw source is a :class:`RawSource`: a source whose units are ranges of input, each a
row group range, a record batch range, or a byte range cut at line boundaries (whole files only
for what must be read from its start: compressed streams, tars). Units come from the pack's own
division of work (``inputs.tasks.assign_tasks`` with one task per ``unit_bytes`` of input), so
three huge files still feed 64 workers. Everything after reading is the packed-dataset code:
the plan deals units (or, with counts, documents of units) to ranks then workers from (seed,
epoch), the blockwise shuffle, the batchers, collation, ``state_dict``.

What an index gives a packed dataset, the **count sidecar** gives raw text (``wdsllm count``,
:mod:`.rawcount`): documents and tokens per unit and every document's length. With it a raw
source plans, counts, equalises ranks and resumes exactly as a packed dataset does (a resume
seeks to its unit and parses, without tokenizing, the documents before its position in it).
Without it units are dealt whole, a resume re-reads the worker's share up to its position by
parsing only (the state marks it in documents and pieces: ``marks``), and a
multi-rank run must pass ``steps_per_epoch`` (refused otherwise: ranks could not stay in step).

A document's identity is ``(input file, line or row)``: its item id is ``file << 32 | line``
(``block.split_id`` gives them back; ``RawSource.inputs[file]`` names the file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import format as fmt
from .. import storage
from ..errors import ConfigError, MixtureError
from ..inputs.sources import DEFAULT_MAX_DOC_BYTES, InputFile, ParseOptions, Part, expand_inputs
from ..inputs.tasks import assign_tasks
from ..inputs.tokenizer import LoadedTokenizer, load_tokenizer, resolve_specials
from ..inputs.where import parse_where
from .block import Block
from .plan import Slice
from .rawcount import load_counts
from .rawread import read_unit
from .rawtext import RawCounts, RawText
from .read import ReadOptions
from .sources.lengths import CountedLengths
from .sources.protocol import OneDataset, Opening

log = logging.getLogger(__name__)

#: input bytes per unit of work by default: small enough that a few files feed many workers
DEFAULT_UNIT_BYTES = 16 << 20


@dataclass
class RawSource(OneDataset):
    """Units of raw input as a source (see the module's docstring), and their reader."""

    urls: Sequence[str]  # each unit's name (``unit_name``)
    inputs: list[InputFile] = field(default_factory=list)
    units: list[Part] = field(default_factory=list)
    text: RawText | None = None
    sidecar: RawCounts | None = None  # the count sidecar (``wdsllm count``), when given
    unit_bytes: int = DEFAULT_UNIT_BYTES
    side_cache: Any = field(default=None, repr=False)
    _lengths: CountedLengths | None = field(default=None, repr=False)

    #: raw text has no index: its counts, when known, come from the count sidecar
    index = None
    #: raw text is documents
    mode = "docs"
    #: units are files the reader parses; the stream opens none of them
    opens_units = False

    @property
    def items_per_shard(self) -> np.ndarray | None:
        return None if self.sidecar is None else self.sidecar.documents

    @property
    def tokens_per_shard(self) -> np.ndarray | None:
        return None if self.sidecar is None else self.sidecar.tokens

    def lengths(self) -> CountedLengths | None:
        """The count sidecar's lengths; None without one."""
        if self.sidecar is None:
            return None
        if self._lengths is None:
            self._lengths = CountedLengths(self.sidecar.lengths, self.sidecar.documents, self.sidecar.starts[:-1])
        return self._lengths

    def fingerprint(self) -> str:
        """``units_fingerprint`` and each input's version (local: size and mtime_ns; remote: the
        ETag or generation its store lists): a state saved over other text is refused, even a
        file rewritten at the same size between the save and the resume."""
        h = hashlib.sha256(self.units_fingerprint().encode())
        for inp in self.inputs:
            h.update(f"{inp.identity}|".encode())
        return h.hexdigest()[:16]

    def units_fingerprint(self, resolved: bool = False) -> str:
        """The units (files, sizes, ranges) and what decides their tokens: a sidecar made for
        other inputs or another tokenizer is refused (its inputs' versions it checks itself).
        ``resolved``: local files named by their resolved paths (a count sidecar's, from version
        3, so that a relative and an absolute path to a file agree); the loader's state keeps
        the paths as given, as states saved before did."""
        h = hashlib.sha256()
        h.update(json.dumps(self.text.identity(), sort_keys=True).encode())
        for inp, path in zip(self.inputs, self.input_paths(resolved)):
            h.update(f"{path}|{inp.kind}|{inp.compression}|{inp.size}|".encode())
        for u in self.units:
            h.update(f"{u.input.index}:{u.unit}:{u.start}:{u.stop}|".encode())
        return h.hexdigest()[:16]

    def input_paths(self, resolved: bool = True) -> list[str]:
        """Each input's path: a local file's resolved (absolute, links followed) when ``resolved``."""
        return [_resolved(i.path) if resolved else i.path for i in self.inputs]

    def tokenizer_json(self) -> str:
        """The tokenizer the text is tokenized with."""
        return self.text.tokenizer_json

    def reads_remote(self) -> bool:
        return any(storage.is_remote(u) for u in self.urls)

    def describe_for_mixture(self, name: str) -> fmt.Index:
        """The source as an index describes it (``describe_raw``): a mixture plans its quotas,
        repeats and equal batches from its count sidecar."""
        if self.sidecar is None:
            raise MixtureError(
                f"mixture source {name!r} is raw text without a count sidecar: a mixture plans its quotas, "
                "repeats and equal batches from counts; run `wdsllm count` over its inputs and pass counts="
            )
        files = [u.input.index for u in self.units]
        if files and max(files) >= len(self.units):
            # ids are file << 32 | line, moved by the source's first unit: a file number must stay in its range
            raise MixtureError(
                f"mixture source {name!r} has more input files than units of work ({len(self.inputs)} "
                f"files, {len(self.units)} units: empty files?): leave the empty files out"
            )
        return describe_raw(self)

    # -- the plan: one dataset's ---------------------------------------------------------------
    def bind(self, cfg: Any, world: int) -> None:
        """A multi-rank run needs counts (equal batches as with an index) or steps_per_epoch:
        otherwise a rank that runs dry first would leave the others waiting in a collective."""
        if self.sidecar is None and cfg.keeps_equal_batches(world) and not cfg.steps_per_epoch:
            raise ConfigError(
                "raw text without a count sidecar cannot keep ranks in step: run `wdsllm count` and pass counts=, "
                "or pass steps_per_epoch="
            )

    def components(self) -> list[RawSource]:
        return [self]

    # -- reading (``UnitReader``) ----------------------------------------------------------------
    def reader(self, unit: int) -> tuple[RawSource, int]:
        return self, unit

    def opening(self, sl: Slice, skip: int, options: ReadOptions, whole: bool = False) -> None:
        """Nothing is opened by the stream: the reader parses the unit's files itself."""
        return None

    def read(
        self,
        sl: Slice,
        *,
        skip: int,
        options: ReadOptions,
        opened: Opening | None = None,
        stream: Any = None,
        stats: Any = None,
        held: dict | None = None,
    ) -> Iterator[Block]:
        """The slice's documents, tokenized (``rawread.read_unit``)."""
        return read_unit(self, sl.shard, sl.start, sl.stop, sl.stride, skip, stats)


def _resolved(path: str) -> str:
    return os.path.realpath(storage.local_path(path)) if storage.scheme_of(path) == "file" else path


def unit_name(part: Part) -> str:
    """How a unit is named in messages and ``skipped_shards``."""
    where = "" if part.whole else f"#{part.unit}={part.start}-{part.stop}"
    return part.input.display + where


def make_units(inputs: list[InputFile], unit_bytes: int, opts: ParseOptions) -> list[Part]:
    """The inputs cut into units of about ``unit_bytes``: the pack's division of work between
    tasks (``assign_tasks``), with one task per ``unit_bytes``; each task's part of each file is a unit."""
    total = sum(i.size for i in inputs)
    tasks = max(1, math.ceil(total / max(1, unit_bytes)))
    return [
        part for parts in assign_tasks(inputs, tasks, opts) for part in parts if part.whole or part.stop > part.start
    ]


def open_raw(
    source: Any,
    *,
    tokenizer: Any,
    text_field: str = "text",
    split: str = "line",
    where: str | None = None,
    bos: bool | None = None,
    eos: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    input_format: str | None = None,
    unit_bytes: int | None = None,
    counts: str | None = None,
    on_error: str = "raise",
) -> RawSource:
    """A raw source: input files or patterns (what ``wdsllm pack`` reads), tokenized with
    ``tokenizer`` (a tokenizer.json path, a directory, a hub name, or a loaded one) by pack's BOS/EOS rules."""
    patterns = [source] if isinstance(source, str) else [str(s) for s in source]
    inputs = expand_inputs(patterns, input_format)
    if any(i.path == "-" for i in inputs):
        raise ConfigError("stdin cannot be a loader source: workers read units of files")
    if isinstance(tokenizer, LoadedTokenizer):  # one already loaded (a mixture's: its packed sources' own)
        tok = tokenizer
    else:
        tok = load_tokenizer(str(tokenizer), bos_token=bos_token, eos_token=eos_token)
    _, bos_id, eos_id = resolve_specials(tok, bos, eos, tok.source)
    opts = ParseOptions(
        split=split, text_field=text_field, on_error=on_error, where=parse_where(where), max_doc_bytes=max_doc_bytes
    )
    text = RawText(
        tokenizer_json=tok.json_text,
        tokenizer_source=tok.source,
        tokenizer_sha256=tok.sha256,
        vocab_size=tok.vocab_size,
        dtype=np.dtype(tok.dtype).name,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=tok.pad_id if tok.pad_id is not None else eos_id,
        parse=opts,
        where_text=where,
    )
    unit_bytes = int(unit_bytes or DEFAULT_UNIT_BYTES)
    units = make_units(inputs, unit_bytes, opts)
    source = RawSource(urls=[unit_name(u) for u in units], inputs=inputs, units=units, text=text, unit_bytes=unit_bytes)
    if counts is not None:
        source.sidecar = load_counts(counts, source)
    log.info("raw source: %d input(s) in %d unit(s)%s", len(inputs), len(units), " with counts" if counts else "")
    return source


#: the options of ``wdsllm.loader`` and ``wdsllm.dataset`` that make a source raw text, and their defaults
RAW_OPTIONS = {
    "tokenizer": None,
    "text_field": "text",
    "counts": None,
    "where": None,
    "split": "line",
    "bos": None,
    "eos": True,
    "input_format": None,
    "unit_bytes": None,
    "max_doc_bytes": DEFAULT_MAX_DOC_BYTES,
}


def describe_raw(source: RawSource) -> fmt.Index:
    """The raw source as an index would describe it: one "shard" per unit (documents, tokens, input
    bytes), its tokenizer and BOS/EOS rules, the longest document. Nothing is written."""
    text, counts = source.text, source.sidecar
    columns = np.zeros((len(source.units), len(fmt.SHARD_COLUMNS)), np.int64)
    columns[:, fmt.SHARD_COLUMNS.index("documents")] = counts.documents
    columns[:, fmt.SHARD_COLUMNS.index("tokens")] = counts.tokens
    columns[:, fmt.SHARD_COLUMNS.index("bytes")] = [u.size for u in source.units]
    tokenizer = fmt.TokenizerInfo(
        source=text.tokenizer_source,
        sha256=text.tokenizer_sha256,
        vocab_size=text.vocab_size,
        bos_id=text.bos_id,
        eos_id=text.eos_id,
        pad_id=text.pad_id,
    )
    return fmt.Index(
        mode="docs",  # raw text is documents
        dtype=text.dtype,
        seq_len=None,
        tokenizer=tokenizer,
        shards=fmt.ShardTable(columns, names=list(source.urls)),
        doc_lengths={"max": int(counts.lengths.max()) if len(counts.lengths) else 0},
        options={"bos": text.bos_id is not None, "eos": text.eos_id is not None, "raw": True},
        inputs=[],
        skipped={},
    )
