"""A raw-text source of a mixture: raw text next to packed datasets, tokenized in the workers and
planned from its count sidecar (``wdsllm count``) as a packed source is planned from its index.

The sidecar gives what the plan asks of a source (documents and tokens per unit, every document's
length); ``describe_raw`` presents it as an index, so the mixture's compatibility checks and its
combined index treat raw and packed sources alike. The raw source's tokenizer defaults to the
packed sources' own (the tokenizer.json their index names), and so do its BOS/EOS rules; whatever
is given must agree with them (``mixcatalog._check_compatible`` refuses otherwise, naming both).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import format as fmt
from ..errors import MixtureError
from ..inputs.tokenizer import tokenizer_from_json
from .raw import RawCatalog, open_raw


@dataclass
class RawSource:
    """A raw-text source with its count sidecar as a mixture source (``mixcatalog.MixSource``)."""

    name: str
    catalog: RawCatalog

    def __post_init__(self) -> None:
        if self.catalog.counts is None:
            raise MixtureError(
                f"mixture source {self.name!r} is raw text without a count sidecar: a mixture plans its quotas, "
                "repeats and equal batches from counts; run `wdsllm count` over its inputs and pass counts="
            )
        files = [u.input.index for u in self.catalog.units]
        if files and max(files) >= len(self.catalog.units):
            # ids are file << 32 | line, moved by the source's first shard: a file number must stay in its range
            raise MixtureError(
                f"mixture source {self.name!r} has more input files than units of work ({len(self.catalog.inputs)} "
                f"files, {len(self.catalog.units)} units: empty files?): leave the empty files out"
            )
        self._index = describe_raw(self.catalog)

    def items_per_shard(self) -> np.ndarray:
        return self.catalog.counts.documents

    def tokens_per_shard(self) -> np.ndarray:
        return self.catalog.counts.tokens

    def item_lengths(self, shard: int) -> np.ndarray:
        return self.catalog.shard_lengths(shard)

    def reader(self) -> RawCatalog:
        return self.catalog

    def index(self) -> fmt.Index:
        return self._index


def describe_raw(catalog: RawCatalog) -> fmt.Index:
    """The raw source as an index would describe it: one "shard" per unit (documents, tokens, input
    bytes), its tokenizer and BOS/EOS rules, the longest document. Nothing is written."""
    text, counts = catalog.text, catalog.counts
    columns = np.zeros((len(catalog.units), len(fmt.SHARD_COLUMNS)), np.int64)
    columns[:, fmt.SHARD_COLUMNS.index("documents")] = counts.documents
    columns[:, fmt.SHARD_COLUMNS.index("tokens")] = counts.tokens
    columns[:, fmt.SHARD_COLUMNS.index("bytes")] = [u.size for u in catalog.units]
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
        shards=fmt.ShardTable(columns, names=list(catalog.urls)),
        doc_lengths={"max": int(counts.lengths.max()) if len(counts.lengths) else 0},
        options={"bos": text.bos_id is not None, "eos": text.eos_id is not None, "raw": True},
        inputs=[],
        skipped={},
    )


def is_raw_source(src: Any) -> bool:
    """Whether a mixture's source is raw text: an opened raw source, or its options (``{raw: ...}``)."""
    return isinstance(src, (RawCatalog, Mapping))


def open_raw_source(name: str, src: Any, packed: list[Any], on_error: str = "raise") -> RawSource:
    """A raw source of a mixture from its options, its tokenizer and BOS/EOS rules defaulting to
    those of the first packed source (``packed``: their catalogs)."""
    if isinstance(src, RawCatalog):
        return RawSource(name, src)
    opts = dict(src)
    patterns = opts.pop("raw")
    if opts.get("tokenizer") is None:
        opts["tokenizer"] = _packed_tokenizer(name, packed)
    first = next((c.index for c in packed if c.index is not None), None)
    if first is not None:  # the packed sources' BOS/EOS rules, unless given
        opts.setdefault("bos", bool(first.options.get("bos", False)))
        opts.setdefault("eos", bool(first.options.get("eos", True)))
    opts.setdefault("on_error", on_error)
    return RawSource(name, open_raw(patterns, **opts))


def _packed_tokenizer(name: str, packed: list[Any]) -> Any:
    """The tokenizer the packed sources carry (their tokenizer.json, checked against the index)."""
    for c in packed:
        if c.index is None or c.root is None:
            continue
        text = fmt.read_tokenizer_json(c.root, c.index, retry=c.retry)
        if text is not None:
            return tokenizer_from_json(text, c.index.tokenizer.source)
    raise MixtureError(
        f"mixture source {name!r} is raw text and names no tokenizer, and no packed source of the mixture carries "
        "one: give it a tokenizer"
    )
