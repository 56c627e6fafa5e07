"""Reading a unit of raw text in a DataLoader worker: parse, select, tokenize, as blocks.

The unit's chunks come from its input kind's reader (``inputs.registry.reader_for``), are parsed
here (JSON, text field, ``where``, UTF-8; bad input raises naming file and line, or is skipped and
counted), and only the documents this consumer takes are tokenized: documents of a unit that
another consumer reads, and those before a resume position, are parsed and passed over. The
tokenizer runs on one thread per worker (``TOKENIZERS_PARALLELISM=false``): workers are the
parallelism, as in a pack.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import xxhash

from ..errors import SourceError
from ..inputs.registry import reader_for
from ..inputs.sources import ParsedChunk
from ..inputs.tokenizer import Encoder
from ..observe import stages
from .block import ID_SHIFT, Block

log = logging.getLogger(__name__)

#: decompressed bytes per chunk a unit is parsed in
CHUNK_BYTES = 1 << 20

_encoders: dict[tuple, Encoder] = {}


def encoder_for(text: Any) -> Encoder:
    """One encoder per process and tokenizer (a forked worker makes its own: the Rust tokenizer's
    thread pool does not survive a fork)."""
    key = (os.getpid(), text.tokenizer_sha256, text.dtype, text.bos_id, text.eos_id)
    enc = _encoders.get(key)
    if enc is None:
        if multiprocessing.parent_process() is not None:
            # a worker process the loader started: one tokenizer thread per worker, and no fork
            # warning; the user's own process keeps its environment as it is
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        _encoders.clear()
        enc = _encoders[key] = Encoder(text.tokenizer_json, text.dtype, text.bos_id, text.eos_id)
    return enc


def parsed_chunks(catalog: Any, unit: int) -> Iterator[ParsedChunk]:
    """The unit's documents, a chunk at a time, in input order (bad input raised or listed)."""
    part = catalog.units[unit]
    opts = catalog.text.parse
    display = part.input.display
    for chunk in reader_for(part.input.kind).chunks(part, opts, CHUNK_BYTES, 1):
        yield chunk.parse(opts, display)


def _note_skips(parsed: ParsedChunk, display: str, stats: Any) -> None:
    for s in parsed.skips:
        log.warning("skipping %s:%d: %s", display, s.line, s.message or s.reason)
        if stats is not None:
            stats.skipped_docs += s.count


def read_unit(
    catalog: Any, unit: int, first: int, stop: int | None, stride: int, skip: int, stats: Any = None
) -> Generator[Block, None, int]:
    """Documents ``first, first+stride, ...`` (before ``stop``) of the unit, less the first
    ``skip`` of them, tokenized, one block per chunk. Ids are ``file << 32 | line``. Skipped
    documents are parsed, never tokenized. Returns how many of those documents it parsed (the
    skipped ones included): fewer than ``skip`` tells the stream to skip the rest in the next unit."""
    text = catalog.text
    part = catalog.units[unit]
    encoder = encoder_for(text)
    file_id = np.int64(part.input.index) << ID_SHIFT
    owns_skips = first == 0 and skip == 0  # bad input is counted once, by the consumer that reads the unit's start
    ordinal = 0  # the unit's document number of the chunk's first document
    passed = 0  # documents first, first+stride, ... parsed so far
    digest = TextsDigest()
    for parsed in parsed_chunks(catalog, unit):
        if owns_skips and parsed.skips:
            _note_skips(parsed, part.input.display, stats)
        n = len(parsed.texts)
        if n == 0:
            continue
        if catalog.sidecar is not None and catalog.sidecar.unit_digests is not None:
            digest.add(parsed.texts)
        j = np.arange(ordinal, ordinal + n)
        ordinal += n
        keep = j >= first
        if stop is not None:
            keep &= j < stop
        if stride > 1:
            keep &= (j - first) % stride == 0
        passed += int(keep.sum())
        if skip:
            keep &= (j - first) // stride >= skip
        picked = np.nonzero(keep)[0]
        if len(picked):
            texts = parsed.texts if len(picked) == n else [parsed.texts[i] for i in picked.tolist()]
            with stages.timed("tokenize"):
                tokens, lengths = encoder.encode(texts)
            lines = np.asarray(parsed.lines, np.int64)[picked]
            _check_counted(catalog, unit, j[picked], lengths, lines)
            starts = np.cumsum(lengths) - lengths
            yield Block(tokens, starts.astype(np.int64), lengths.astype(np.int64), file_id | lines)
        if stop is not None and ordinal >= stop:
            break
    counted = None if catalog.sidecar is None else int(catalog.sidecar.documents[unit])
    if stop is None or ordinal < stop or ordinal == counted:  # the unit was read to its end
        _check_count(catalog, unit, ordinal, digest)
    return passed


def _check_counted(catalog: Any, unit: int, ordinals: np.ndarray, lengths: np.ndarray, lines: np.ndarray) -> None:
    """Each document read has the tokens the count sidecar counted for it: an input that changed
    since `wdsllm count` (or a sidecar of other text) is named, never planned as if it had not."""
    counts = catalog.sidecar
    if counts is None:
        return
    n = int(counts.documents[unit])
    if int(ordinals[-1]) >= n:
        raise SourceError(f"{catalog.urls[unit]}: more documents than the {n} the count sidecar counted; {_AGAIN}")
    expected = counts.lengths[int(counts.starts[unit]) + ordinals]
    bad = np.nonzero(expected != lengths)[0]
    if len(bad):
        i = int(bad[0])
        raise SourceError(
            f"{catalog.urls[unit]}: the document at line {int(lines[i])} has {int(lengths[i])} tokens, the count "
            f"sidecar counted {int(expected[i])}; {_AGAIN}"
        )


def _check_count(catalog: Any, unit: int, documents: int, digest: TextsDigest) -> None:
    """A unit read to its end holds the documents the count sidecar counted, with their text."""
    counts = catalog.sidecar
    if counts is None:
        return
    if documents != int(counts.documents[unit]):
        counted = int(counts.documents[unit])
        raise SourceError(f"{catalog.urls[unit]}: {documents} documents, the count sidecar counted {counted}; {_AGAIN}")
    if counts.unit_digests is not None and digest.hexdigest() != counts.unit_digests[unit]:
        raise SourceError(
            f"{catalog.urls[unit]}: its documents' text differs from what `wdsllm count` read (xxh3 "
            f"{digest.hexdigest()}, counted {counts.unit_digests[unit]}): the input changed or was damaged in transit"
        )


class TextsDigest:
    """xxh3_64 of a unit's parsed documents in order (each text's length, then the texts), recorded
    by `wdsllm count` and compared when a unit is read to its end: raw text has no checksum of its own."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def add(self, texts: list[str]) -> None:
        self._h.update(np.fromiter((len(t) for t in texts), np.int64, len(texts)).tobytes())
        self._h.update("\x00".join(texts).encode("utf-8", "surrogatepass"))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


_AGAIN = "the input changed since `wdsllm count`: run it again"


def unit_lengths(catalog: Any, unit: int) -> tuple[np.ndarray, int, str]:
    """(every document's token length, bad documents skipped, the texts' digest) of a unit: what
    ``wdsllm count`` records."""
    encoder = encoder_for(catalog.text)
    parts, skipped = [], 0
    digest = TextsDigest()
    for parsed in parsed_chunks(catalog, unit):
        skipped += sum(s.count for s in parsed.skips)
        if parsed.texts:
            parts.append(encoder.encode(parsed.texts)[1])
            digest.add(parsed.texts)
    lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return lengths.astype(np.uint32), skipped, digest.hexdigest()
