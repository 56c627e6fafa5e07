"""Raw text as a loader source: the inputs ``wdsllm pack`` reads, tokenized in the DataLoader workers.

A raw source is a :class:`RawCatalog`: a catalog whose "shards" are **units** of input, each a
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
Without it units are dealt whole, a resume re-reads the worker's share up to its position, and a
multi-rank run must pass ``steps_per_epoch`` (refused otherwise: ranks could not stay in step).

A document's identity is ``(input file, line or row)``: its item id is ``file << 32 | line``
(``block.split_id`` gives them back; ``RawCatalog.inputs[file]`` names the file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import format as fmt
from ..errors import ConfigError
from ..inputs.sources import DEFAULT_MAX_DOC_BYTES, InputFile, ParseOptions, Part, expand_inputs
from ..inputs.tasks import assign_tasks
from ..inputs.tokenizer import LoadedTokenizer, load_tokenizer, resolve_specials
from ..inputs.where import parse_where
from .block import Block
from .catalog import Catalog

log = logging.getLogger(__name__)

#: input bytes per unit of work by default: small enough that a few files feed many workers
DEFAULT_UNIT_BYTES = 16 << 20


class UnitReader(Protocol):
    """The seam between a raw source and the stream: a unit's selected documents as blocks.

    ``first``/``stop``/``stride`` select the unit's documents (ordinals among its parsed
    documents) as a plan slice does, and ``skip`` drops the first selected ones without
    tokenizing them (a resume). A mixture will hold a raw source through this and ``RawCatalog``.
    """

    def read_unit(
        self, unit: int, first: int, stop: int | None, stride: int, skip: int, stats: Any = None
    ) -> Iterator[Block]: ...


@dataclass(frozen=True)
class RawText:
    """How raw text becomes tokens: the tokenizer (by its JSON text), BOS/EOS, and the parse options."""

    tokenizer_json: str
    tokenizer_source: str
    tokenizer_sha256: str
    vocab_size: int
    dtype: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    parse: ParseOptions
    where_text: str | None = None

    def identity(self) -> dict:
        """What decides the tokens of every document (checked against a count sidecar)."""
        p = self.parse
        return {
            "tokenizer_sha256": self.tokenizer_sha256,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "text_field": p.text_field,
            "split": p.split,
            "where": self.where_text,
            "max_doc_bytes": p.max_doc_bytes,
        }


@dataclass(frozen=True)
class RawCounts:
    """The count sidecar's content: per unit documents and tokens, and every document's length
    (unit after unit, in reading order)."""

    fingerprint: str
    documents: np.ndarray  # int64 per unit
    tokens: np.ndarray  # int64 per unit
    lengths: np.ndarray  # uint32 per document
    skipped: int = 0  # bad documents skipped while counting (on_error="skip")

    def __post_init__(self) -> None:
        starts = np.zeros(len(self.documents) + 1, np.int64)
        np.cumsum(self.documents, out=starts[1:])
        object.__setattr__(self, "starts", starts)
        if int(starts[-1]) != len(self.lengths):
            raise fmt.FormatError(f"count sidecar lists {len(self.lengths)} lengths for {int(starts[-1])} documents")


class _Lengths:
    """The sidecar's lengths where the loader asks for lengths.npy (``catalog.lengths_file()``)."""

    def __init__(self, lengths: np.ndarray):
        self._a = lengths
        self.count = len(lengths)
        self.url = "count sidecar"

    def read(self, a: int, b: int, check: bool = True) -> np.ndarray:
        return self._a[a:b]

    def check_range(self, a: int, b: int) -> None:
        return None

    def range_sums(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The sum of lengths [a[i], b[i]) for every i (SideArray's, over the sidecar's array)."""
        if not hasattr(self, "_cumsum"):
            self._cumsum = np.concatenate([[0], np.cumsum(self._a, dtype=np.int64)])
        return self._cumsum[np.asarray(b, np.int64)] - self._cumsum[np.asarray(a, np.int64)]

    def array(self) -> np.ndarray:
        return self._a


@dataclass
class RawCatalog(Catalog):
    """Units of raw input as the loader's shards (see the module's docstring)."""

    inputs: list[InputFile] = field(default_factory=list)
    units: list[Part] = field(default_factory=list)
    text: RawText | None = None
    counts: RawCounts | None = None
    unit_bytes: int = DEFAULT_UNIT_BYTES

    @property
    def mode(self) -> str:
        return "docs"

    @property
    def shard_entries(self) -> Sequence | None:
        return None

    @property
    def items_per_shard(self) -> np.ndarray | None:
        return None if self.counts is None else self.counts.documents

    @property
    def docs_per_shard(self) -> np.ndarray | None:
        return self.items_per_shard

    @property
    def tokens_per_shard(self) -> np.ndarray | None:
        return None if self.counts is None else self.counts.tokens

    def lengths_file(self) -> _Lengths | None:
        if self.counts is None:
            return None
        if "lengths" not in self._sides:
            self._sides["lengths"] = _Lengths(self.counts.lengths)
        return self._sides["lengths"]

    def document_starts(self) -> np.ndarray:
        return self.counts.starts[:-1]

    def lengths_range(self, shard: int, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        n = int(self.counts.documents[shard])
        stop = n if stop is None else min(int(stop), n)
        base = int(self.counts.starts[shard])
        return base + max(0, int(start)), base + stop

    def shard_lengths(self, shard: int, start: int = 0, stop: int | None = None, *, check: bool = True):
        if self.counts is None:
            return None
        a, b = self.lengths_range(shard, start, stop)
        return self.counts.lengths[a:b].astype(np.int64)

    def check_lengths(self, ranges: list[tuple[int, int]]) -> None:
        return None

    def lengths(self) -> np.ndarray | None:
        return None if self.counts is None else self.counts.lengths

    def group_table(self, shard: int) -> None:
        return None

    def fingerprint(self) -> str:
        """The units (files, sizes, ranges) and what decides their tokens: a state or a sidecar
        made for other inputs or another tokenizer is refused."""
        h = hashlib.sha256()
        h.update(json.dumps(self.text.identity(), sort_keys=True).encode())
        for inp in self.inputs:
            h.update(f"{inp.path}|{inp.kind}|{inp.compression}|{inp.size}|".encode())
        for u in self.units:
            h.update(f"{u.input.index}:{u.unit}:{u.start}:{u.stop}|".encode())
        return h.hexdigest()[:16]

    def read_unit(
        self, unit: int, first: int, stop: int | None, stride: int, skip: int, stats: Any = None
    ) -> Iterator[Block]:
        from .rawread import read_unit

        return read_unit(self, unit, first, stop, stride, skip, stats)


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
) -> RawCatalog:
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
    catalog = RawCatalog(
        urls=[unit_name(u) for u in units], inputs=inputs, units=units, text=text, unit_bytes=unit_bytes
    )
    if counts is not None:
        from .rawcount import load_counts

        catalog.counts = load_counts(counts, catalog)
    log.info("raw source: %d input(s) in %d unit(s)%s", len(inputs), len(units), " with counts" if counts else "")
    return catalog


def check_world(catalog: Catalog, keeps_equal_batches: bool, steps_per_epoch: int | None) -> None:
    """A multi-rank raw run needs counts (equal batches as with an index) or steps_per_epoch:
    otherwise a rank that runs dry first would leave the others waiting in a collective."""
    if isinstance(catalog, RawCatalog) and catalog.counts is None and keeps_equal_batches and not steps_per_epoch:
        raise ConfigError(
            "raw text without a count sidecar cannot keep ranks in step: run `wdsllm count` and pass counts=, "
            "or pass steps_per_epoch="
        )


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


def take_raw_options(args: dict) -> Any:
    """Pop the raw-text options from a face's arguments; with ``tokenizer`` set, turn the source
    into a :class:`RawCatalog` (and default ``pad_id`` to the tokenizer's pad, else EOS)."""
    raw = {k: args.pop(k) for k in RAW_OPTIONS}
    if raw["tokenizer"] is None:
        given = [k for k, v in raw.items() if v != RAW_OPTIONS[k]]
        if given:
            raise ConfigError(f"{', '.join(given)} apply to raw text sources: pass tokenizer= as well")
        return args["source"]
    catalog = open_raw(args["source"], on_error=args.get("on_error", "raise"), **raw)
    if args.get("pad_id") is None:
        args["pad_id"] = catalog.text.pad_id
    return catalog
