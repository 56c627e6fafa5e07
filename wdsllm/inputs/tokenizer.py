"""Tokenizers: loading one (file or hub name), its identity, and batch encoding with BOS/EOS.

Shared by the packer and the raw-text loader, so that both tokenize a document the same way.

wdsllm adds BOS and EOS itself and encodes with ``add_special_tokens=False``, so a special token
that the tokenizer's own post-processor would add can never appear twice.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..errors import TokenizerError
from ..format import TokenizerInfo, token_dtype

log = logging.getLogger(__name__)

EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "[CLS]", "<|endoftext|>")
PAD_NAMES = ("<pad>", "<|padding|>", "[PAD]", "<|pad|>")


@dataclass
class LoadedTokenizer:
    """A tokenizer plus what identifies it and the special ids that packing needs."""

    tokenizer: Tokenizer
    source: str
    json_text: str
    sha256: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    adds_bos: bool  # whether its post-processor prepends BOS (Llama does, GPT-2 does not)

    def info(self) -> TokenizerInfo:
        return TokenizerInfo(
            source=self.source,
            sha256=self.sha256,
            vocab_size=self.vocab_size,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
        )

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)


def _hub_cache_file(name: str) -> Path | None:
    """The cached tokenizer.json of hub model ``name`` at the revision ``refs/main`` names (not
    just any snapshot: a cache holds one per revision ever downloaded), looked up by
    ``huggingface_hub`` in the cache that HF_HUB_CACHE or HF_HOME point at when called."""
    from huggingface_hub import try_to_load_from_cache

    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub"
    )
    found = try_to_load_from_cache(name, "tokenizer.json", cache_dir=cache)
    return Path(found) if isinstance(found, str) else None


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE", "0") not in (
        "",
        "0",
    ):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _read_tokenizer_json(spec: str) -> tuple[str, str]:
    """Return (json text, how it was found) for a path, a directory, or a hub name."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        return path.read_text(encoding="utf-8"), "file"
    looks_like_path = spec.endswith(".json") or spec.startswith((".", "/", "~")) or spec.count("/") > 1
    if looks_like_path:
        raise TokenizerError(f"tokenizer file not found: {spec}")
    cached = _hub_cache_file(spec)
    if cached is not None:
        return cached.read_text(encoding="utf-8"), "hub cache"
    if not _hub_reachable():
        raise TokenizerError(
            f"cannot load tokenizer {spec!r}: it is not a file, not in the Hugging Face cache, and the Hub "
            "is not reachable (offline?). Pass the path of a tokenizer.json instead."
        )
    try:
        return Tokenizer.from_pretrained(spec).to_str(), "hub"
    except Exception as exc:  # the Rust side raises a bare Exception
        raise TokenizerError(f"cannot load tokenizer {spec!r} from the Hugging Face Hub: {exc}") from exc


def _token_id(tok: Tokenizer, text: str | None, names: tuple[str, ...], specials: set[str]) -> int | None:
    if text is not None:
        tid = tok.token_to_id(text)
        if tid is None:
            raise TokenizerError(f"token {text!r} is not in the tokenizer's vocabulary")
        return tid
    for name in names:
        if name in specials:
            return tok.token_to_id(name)
    return None


def load_tokenizer(spec: str, *, bos_token: str | None = None, eos_token: str | None = None) -> LoadedTokenizer:
    """Load a tokenizer.json path, a directory holding one, or a hub name (online or cached)."""
    text, how = _read_tokenizer_json(spec)
    tok = tokenizer_from_json(text, spec, bos_token=bos_token, eos_token=eos_token)
    log.info("tokenizer %s loaded from %s", spec, how)
    return tok


def tokenizer_from_json(
    text: str, source: str, *, bos_token: str | None = None, eos_token: str | None = None
) -> LoadedTokenizer:
    """A tokenizer from its JSON text (a dataset's own tokenizer.json, say); ``source`` names it."""
    spec = source
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:
        raise TokenizerError(f"{spec}: not a valid tokenizers JSON: {exc}") from exc
    body = json.loads(text)
    specials = {a["content"] for a in body.get("added_tokens", []) if a.get("special")}
    vocab_size = max(
        tok.get_vocab_size(with_added_tokens=True), max(tok.get_vocab(with_added_tokens=True).values()) + 1
    )

    with_specials = tok.encode("a", add_special_tokens=True).ids
    without = tok.encode("a", add_special_tokens=False).ids
    prefix = with_specials[: len(with_specials) - len(without)] if with_specials[-len(without) :] == without else []
    suffix = with_specials[len(without) :] if with_specials[: len(without)] == without else []
    adds_bos = bool(prefix)

    bos_id = prefix[0] if (prefix and bos_token is None) else _token_id(tok, bos_token, BOS_NAMES, specials)
    eos_id = suffix[-1] if (suffix and eos_token is None) else _token_id(tok, eos_token, EOS_NAMES, specials)
    pad_id = _token_id(tok, None, PAD_NAMES, specials)
    return LoadedTokenizer(
        tokenizer=tok,
        source=spec,
        json_text=text,
        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        vocab_size=vocab_size,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        adds_bos=adds_bos,
    )


class Encoder:
    """Encodes batches of texts to one concatenated id array plus lengths; runs in worker processes."""

    def __init__(self, json_text: str, dtype: str, bos_id: int | None, eos_id: int | None):
        self.tokenizer = Tokenizer.from_str(json_text)
        self.dtype = np.dtype(dtype)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self._fast = hasattr(self.tokenizer, "encode_batch_fast")

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of all texts concatenated (BOS/EOS included) and each text's length."""
        if not texts:
            return np.zeros(0, self.dtype), np.zeros(0, np.int64)
        encode = self.tokenizer.encode_batch_fast if self._fast else self.tokenizer.encode_batch
        ids = [e.ids for e in encode(texts, add_special_tokens=False)]
        body_lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        body = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(body_lengths.sum()))
        return add_specials(body, body_lengths, self.bos_id, self.eos_id)


def add_specials(
    body: np.ndarray, lengths: np.ndarray, bos_id: int | None, eos_id: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Insert BOS before and EOS after every document of a concatenated id array, vectorised."""
    extra = (bos_id is not None) + (eos_id is not None)
    if extra == 0 or len(lengths) == 0:
        return body, lengths
    n = len(lengths)
    out_lengths = lengths + extra
    ends = np.cumsum(out_lengths)
    starts = ends - out_lengths
    out = np.empty(int(ends[-1]) if n else 0, dtype=body.dtype)
    shift = np.repeat(starts + (bos_id is not None) - (np.cumsum(lengths) - lengths), lengths)
    out[np.arange(len(body)) + shift] = body
    if bos_id is not None:
        out[starts] = bos_id
    if eos_id is not None:
        out[ends - 1] = eos_id
    return out, out_lengths


def resolve_specials(
    tok: LoadedTokenizer, bos: bool | None, eos: bool, name: str, error: type[Exception] = TokenizerError
) -> tuple[bool, int | None, int | None]:
    """(use_bos, bos_id, eos_id) to add, from the options and what the tokenizer defines: BOS when
    asked, or (``bos=None``) when the tokenizer's own post-processor would add one; EOS when asked."""
    use_bos = tok.adds_bos if bos is None else bos
    if use_bos and tok.bos_id is None:
        raise error(f"tokenizer {name} has no BOS token; pass --bos-token TEXT or --no-bos")
    if eos and tok.eos_id is None:
        raise error(f"tokenizer {name} has no EOS token; pass --eos-token TEXT or --no-eos")
    return use_bos, (tok.bos_id if use_bos else None), (tok.eos_id if eos else None)
