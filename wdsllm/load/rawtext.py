"""What raw text is to the loader: how it becomes tokens (``RawText``), and what its count sidecar
says of it (``RawCounts``). Records only: ``raw`` makes them, ``rawcount`` writes and reads them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import format as fmt
from ..inputs.sources import ParseOptions


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
    unit_digests: tuple[str, ...] | None = None  # per unit, xxh3 of its parsed texts (rawread.TextsDigest)

    def __post_init__(self) -> None:
        starts = np.zeros(len(self.documents) + 1, np.int64)
        np.cumsum(self.documents, out=starts[1:])
        object.__setattr__(self, "starts", starts)
        if int(starts[-1]) != len(self.lengths):
            raise fmt.FormatError(f"count sidecar lists {len(self.lengths)} lengths for {int(starts[-1])} documents")
