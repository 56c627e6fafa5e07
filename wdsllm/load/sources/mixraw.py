"""Raw text as a source of a mixture: next to packed datasets, tokenized in the workers and planned
from its count sidecar (``wdsllm count``) as a packed source is planned from its index.

The raw source's tokenizer defaults to the packed sources' own (the tokenizer.json their index
names), and so do its BOS/EOS rules; whatever is given must agree with them
(``mixture._check_compatible`` refuses otherwise, naming both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import MixtureError, TokenizerError
from ...inputs.tokenizer import tokenizer_from_json
from ..raw import open_raw
from .mixture import MixturePart
from .protocol import Source


def open_raw_part(name: str, options: Mapping, others: list[Source], on_error: str = "raise") -> MixturePart:
    """A raw source of a mixture from its options (``{raw: patterns, ...}``), its tokenizer and
    BOS/EOS rules defaulting to those of the first packed source of ``others``."""
    opts = dict(options)
    patterns = opts.pop("raw")
    if opts.get("tokenizer") is None:
        opts["tokenizer"] = _packed_tokenizer(name, others)
    first = next((s.index for s in others if s.index is not None), None)
    if first is not None:  # the packed sources' BOS/EOS rules, unless given
        opts.setdefault("bos", bool(first.options.get("bos", False)))
        opts.setdefault("eos", bool(first.options.get("eos", True)))
    opts.setdefault("on_error", on_error)
    source = open_raw(patterns, **opts)
    return MixturePart(name, source, source.describe_for_mixture(name))


def _packed_tokenizer(name: str, others: list[Source]) -> Any:
    """The tokenizer the packed sources carry (their tokenizer.json, checked against the index)."""
    for source in others:
        if source.index is None:
            continue
        try:
            text = source.tokenizer_json()
        except TokenizerError:
            continue
        return tokenizer_from_json(text, source.index.tokenizer.source)
    raise MixtureError(
        f"mixture source {name!r} is raw text and names no tokenizer, and no packed source of the mixture carries "
        "one: give it a tokenizer"
    )
