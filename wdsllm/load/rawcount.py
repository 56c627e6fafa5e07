"""The count sidecar of a raw source (``wdsllm count``): documents and tokens per unit, and every
document's length, so that a raw source plans, counts and resumes as a packed dataset does.

The sidecar is one ``.npz`` (numpy arrays only, read without pickle): ``documents``, ``tokens``
(int64 per unit), ``lengths`` (uint32 per document, unit after unit) and ``meta`` (JSON: the
version, the source's fingerprint, the units' names). The fingerprint covers the input files
(paths and sizes), the units and what decides the tokens (tokenizer sha256, BOS/EOS, text field,
split, where, max_doc_bytes), so a sidecar of other inputs or settings is refused, never used.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from .. import storage
from ..errors import ConfigError
from .raw import RawCatalog, RawCounts
from .rawread import unit_lengths

log = logging.getLogger(__name__)

COUNTS_VERSION = 1

_catalog: dict = {}


def _init(catalog: RawCatalog) -> None:
    _catalog["c"] = catalog


def _count(unit: int) -> tuple[np.ndarray, int]:
    return unit_lengths(_catalog["c"], unit)


def count_raw(
    catalog: RawCatalog, processes: int = 1, on_unit: Callable[[int, int, int, int], None] | None = None
) -> RawCounts:
    """Tokenize every unit once and count (``processes`` spawned workers, one tokenizer thread each).

    ``on_unit(done, total, documents, tokens)`` is called after each unit, in unit order, with the
    running sums: the caller's progress report (the library only logs)."""
    units = range(len(catalog.units))
    results: list[tuple[np.ndarray, int]] = []
    if processes <= 1:
        _gather((unit_lengths(catalog, u) for u in units), len(units), results, on_unit)
    else:
        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(processes, mp_context=ctx, initializer=_init, initargs=(catalog,)) as pool:
            _gather(pool.map(_count, units), len(units), results, on_unit)
    lengths = [r[0] for r in results]
    documents = np.array([len(x) for x in lengths], np.int64)
    tokens = np.array([int(x.sum(dtype=np.int64)) for x in lengths], np.int64)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.uint32)
    return RawCounts(catalog.fingerprint(), documents, tokens, all_lengths, sum(r[1] for r in results))


def _gather(
    counted: Iterable[tuple[np.ndarray, int]],
    total: int,
    results: list[tuple[np.ndarray, int]],
    on_unit: Callable[[int, int, int, int], None] | None,
) -> None:
    documents = tokens = 0
    for result in counted:
        results.append(result)
        documents += len(result[0])
        tokens += int(result[0].sum(dtype=np.int64))
        log.debug("counted unit %d of %d", len(results), total)
        if on_unit is not None:
            on_unit(len(results), total, documents, tokens)


def save_counts(counts: RawCounts, catalog: RawCatalog, path: str) -> None:
    """Write the sidecar under a temporary name, then rename: never half-written under ``path``."""
    meta = {
        "version": COUNTS_VERSION,
        "fingerprint": counts.fingerprint,
        "units": list(catalog.urls),
        "skipped": counts.skipped,
        "identity": catalog.text.identity(),
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(
            f,
            documents=counts.documents,
            tokens=counts.tokens,
            lengths=counts.lengths,
            meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        )
    os.replace(tmp, path)


def load_counts(path: str, catalog: RawCatalog) -> RawCounts:
    """The sidecar at ``path`` (local or any storage URL), checked against the source."""
    data = storage.read_bytes(path)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            documents, tokens, lengths = z["documents"], z["tokens"], z["lengths"]
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"{storage.redact(path)}: not a wdsllm count sidecar ({exc})") from None
    if meta.get("version") != COUNTS_VERSION:
        raise ConfigError(f"{storage.redact(path)}: count sidecar version {meta.get('version')}, expected 1")
    if meta["fingerprint"] != catalog.fingerprint() or len(documents) != len(catalog.units):
        raise ConfigError(
            f"{storage.redact(path)} counts other inputs or settings (its tokens: {_describe(meta.get('identity'))}; "
            f"here: {_describe(catalog.text.identity())}, {len(catalog.units)} units against {len(documents)}): "
            "run `wdsllm count` again with the loader's inputs, tokenizer and options"
        )
    return RawCounts(meta["fingerprint"], documents.astype(np.int64), tokens.astype(np.int64), lengths, meta["skipped"])


def _describe(identity: Any) -> str:
    if not isinstance(identity, dict):
        return "unknown"
    return ", ".join(f"{k}={str(v)[:16]}" for k, v in sorted(identity.items()))
