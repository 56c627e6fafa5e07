"""The count sidecar of a raw source (``wdsllm count``): documents and tokens per unit, and every
document's length, so that a raw source plans, counts and resumes as a packed dataset does.

The sidecar is one ``.npz`` (numpy arrays only, read without pickle): ``documents``, ``tokens``
(int64 per unit), ``lengths`` (uint32 per document, unit after unit) and ``meta`` (JSON: the
version, the source's ``units_fingerprint``, the units' names, from version 2 each input's
identity, each unit's ``unit_digests`` (xxh3 of its parsed texts, compared when a unit is read to
its end) and a sha256 ``digest`` of the meta and the arrays, from version 3 each input's resolved
``paths``). The fingerprint covers the input files (their paths, resolved from version 3 so that a
relative and an absolute path to one file agree, and sizes), the units and what decides the tokens
(tokenizer sha256, BOS/EOS, text field, split, where, max_doc_bytes), so a sidecar of other inputs
or settings is refused, naming what differs, never used; the identities (size and mtime locally,
the listed ETag/generation remotely) refuse inputs rewritten since they were counted, and the
digest a sidecar edited or damaged since it was written. Version 1 sidecars (no digest, no
identities) still load, with a warning, their counts checked to add up.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing as mp
import os
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from .. import storage
from ..errors import ConfigError, FormatError
from ..format.index import parse_json
from .rawread import unit_lengths
from .rawtext import RawCounts

if TYPE_CHECKING:
    from .raw import RawSource

log = logging.getLogger(__name__)

#: 2: a digest of its own (meta and arrays), and each input's version (size and mtime, or ETag/generation);
#: 3: the fingerprint names local inputs by their resolved paths, which ``paths`` lists
COUNTS_VERSION = 3
READABLE_COUNTS_VERSIONS = (1, 2, 3)
_ARRAYS = ("documents", "tokens", "lengths")
#: the meta of a sidecar: the units' names and the inputs' versions, never more than this
MAX_META_BYTES = 256 << 20

_catalog: dict = {}


def _init(catalog: RawSource) -> None:
    _catalog["c"] = catalog


def _count(unit: int) -> tuple[np.ndarray, int, str]:
    return unit_lengths(_catalog["c"], unit)


def count_raw(
    catalog: RawSource, processes: int = 1, on_unit: Callable[[int, int, int, int], None] | None = None
) -> RawCounts:
    """Tokenize every unit once and count (``processes`` spawned workers, one tokenizer thread each).

    ``on_unit(done, total, documents, tokens)`` is called after each unit, in unit order, with the
    running sums: the caller's progress report (the library only logs)."""
    units = range(len(catalog.units))
    results: list[tuple[np.ndarray, int, str]] = []
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
    digests = tuple(r[2] for r in results)
    fingerprint = catalog.units_fingerprint(resolved=COUNTS_VERSION >= 3)
    return RawCounts(fingerprint, documents, tokens, all_lengths, sum(r[1] for r in results), digests)


def _gather(
    counted: Iterable[tuple[np.ndarray, int, str]],
    total: int,
    results: list[tuple[np.ndarray, int, str]],
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


def save_counts(counts: RawCounts, catalog: RawSource, path: str) -> None:
    """Write the sidecar under a temporary name, then rename: never half-written under ``path``."""
    meta = {
        "version": COUNTS_VERSION,
        "fingerprint": counts.fingerprint,
        "units": list(catalog.urls),
        "skipped": counts.skipped,
        "identity": catalog.text.identity(),
        "paths": [storage.redact(path) for path in catalog.input_paths(resolved=True)],
        "inputs": [inp.identity for inp in catalog.inputs],
        "unit_digests": list(counts.unit_digests) if counts.unit_digests is not None else None,
    }
    arrays = {"documents": counts.documents, "tokens": counts.tokens, "lengths": counts.lengths}
    meta["digest"] = _digest(meta, arrays)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    os.replace(tmp, path)


def _digest(meta: dict, arrays: dict[str, np.ndarray]) -> str:
    """sha256 of the meta (less its digest) and of every array's dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True).encode())
    for name in _ARRAYS:
        a = np.ascontiguousarray(arrays[name])
        h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _read_sidecar(data: bytes, where: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of a sidecar's bytes; anything but a well-formed one is a named error."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            missing = [k for k in (*_ARRAYS, "meta") if k not in z.files]
            if missing:
                raise ConfigError(f"{where}: not a wdsllm count sidecar (no {missing[0]!r} array)")
            arrays = {k: z[k] for k in _ARRAYS}
            meta_bytes = z["meta"]
        meta = parse_json(meta_bytes.tobytes(), f"{where} (meta)", MAX_META_BYTES)
    except ConfigError:
        raise
    except (ValueError, KeyError, OSError, EOFError, NotImplementedError, zipfile.BadZipFile, FormatError) as exc:
        # NotImplementedError: a zip header naming a compression method zipfile lacks (a flipped bit)
        raise ConfigError(f"{where}: not a wdsllm count sidecar, or a damaged one ({str(exc)[:200]})") from None
    if not isinstance(meta, dict) or meta.get("version") not in READABLE_COUNTS_VERSIONS:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise ConfigError(
            f"{where}: count sidecar version {str(version)[:20]}, this wdsllm reads {list(READABLE_COUNTS_VERSIONS)}"
        )
    for name, a in arrays.items():
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise ConfigError(f"{where}: its {name} array is {a.dtype} of shape {a.shape}, not 1-D integers")
    return meta, arrays


def _check_sealed(meta: dict, arrays: dict[str, np.ndarray], where: str) -> None:
    """A version 2 sidecar matches its digest; a version 1 one (no digest) is said to be unchecked."""
    if meta["version"] < 2:
        log.warning(
            "%s: a version 1 count sidecar: neither its own content nor its inputs' versions can be checked; "
            "run `wdsllm count` again to have both checked",
            where,
        )
        return
    if meta.get("digest") != _digest(meta, arrays):
        raise ConfigError(f"{where}: the count sidecar does not match its digest: it was edited or damaged")


def _check_counts(meta: dict, arrays: dict[str, np.ndarray], where: str) -> None:
    """Counts that add up: non-negative, one length per document, each unit's tokens the sum of
    its lengths (so even an unsealed sidecar's edited count is caught)."""
    documents, tokens, lengths = arrays["documents"], arrays["tokens"], arrays["lengths"]
    if len(tokens) != len(documents) or (documents < 0).any() or (tokens < 0).any():
        raise ConfigError(f"{where}: documents and tokens per unit do not pair up, or are negative")
    if int(documents.sum(dtype=np.int64)) != len(lengths):
        raise ConfigError(f"{where}: it lists {len(lengths)} lengths for {int(documents.sum())} documents")
    ends = np.cumsum(documents, dtype=np.int64)
    running = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    sums = running[ends] - running[ends - documents]
    bad = np.nonzero(sums != tokens)[0]
    if len(bad):
        unit = int(bad[0])
        raise ConfigError(
            f"{where}: unit {unit} counts {int(tokens[unit])} tokens, its lengths add up to {int(sums[unit])}"
        )
    if not isinstance(meta.get("skipped", 0), int) or not isinstance(meta.get("fingerprint"), str):
        raise ConfigError(f"{where}: its meta is malformed (skipped, fingerprint)")


def _check_inputs(meta: dict, catalog: RawSource, where: str) -> None:
    """The inputs are the versions that were counted (a file rewritten at the same size is not)."""
    recorded = meta.get("inputs")
    if recorded is None:
        return  # version 1
    if not isinstance(recorded, list) or len(recorded) != len(catalog.inputs):
        count = len(recorded) if isinstance(recorded, list) else "no"
        raise ConfigError(f"{where}: it records {count} inputs, the source has {len(catalog.inputs)}")
    for inp, then in zip(catalog.inputs, recorded):
        now = inp.identity
        if then and now and then != now:
            raise ConfigError(
                f"{where}: {inp.display} changed since it was counted ({str(then)[:60]} -> {now[:60]}): "
                "run `wdsllm count` again"
            )


def load_counts(path: str, catalog: RawSource) -> RawCounts:
    """The sidecar at ``path`` (local or any storage URL), checked against the source: its own
    digest, counts that add up, the inputs' versions and the fingerprint."""
    where = storage.redact(path)
    meta, arrays = _read_sidecar(storage.read_bytes(path), where)
    _check_sealed(meta, arrays, where)
    _check_counts(meta, arrays, where)
    documents = arrays["documents"]
    resolved = meta["version"] >= 3  # earlier sidecars name their inputs by the paths they were given
    if meta["fingerprint"] != catalog.units_fingerprint(resolved) or len(documents) != len(catalog.units):
        raise ConfigError(
            f"{where} counts other inputs or settings: {_what_differs(meta, catalog, len(documents))}; run "
            "`wdsllm count` again with the loader's inputs, tokenizer and options"
        )
    _check_inputs(meta, catalog, where)
    digests = meta.get("unit_digests")
    if digests is not None and (
        not isinstance(digests, list) or len(digests) != len(documents) or not all(isinstance(d, str) for d in digests)
    ):
        raise ConfigError(f"{where}: its unit_digests are not one string per unit")
    return RawCounts(
        meta["fingerprint"],
        documents.astype(np.int64),
        arrays["tokens"].astype(np.int64),
        arrays["lengths"].astype(np.uint32),
        meta.get("skipped", 0),
        tuple(digests) if digests is not None else None,
    )


def _what_differs(meta: dict, catalog: RawSource, units: int) -> str:
    """The first thing a sidecar's fingerprint covers in which it and the source differ, with both
    values: the settings that decide the tokens, the input paths, the units, else the files."""
    counted, here = meta.get("identity"), catalog.text.identity()
    if isinstance(counted, dict):
        for key in sorted(set(counted) | set(here)):
            if counted.get(key) != here.get(key):
                return f"{key} differs (counted: {counted.get(key)!r:.60}; here: {here.get(key)!r:.60})"
    resolved = meta["version"] >= 3
    paths = meta.get("paths") if resolved else meta.get("units")
    ours = [storage.redact(p) for p in catalog.input_paths(True)] if resolved else list(catalog.urls)
    if isinstance(paths, list) and paths != ours:
        what = "input files" if resolved else "units"
        if len(paths) != len(ours):
            return f"it counts {len(paths)} {what}, the source has {len(ours)}"
        i = next(i for i, (a, b) in enumerate(zip(paths, ours)) if a != b)
        note = "" if resolved else " (a sidecar before version 3 compares paths as they were given)"
        return f"{what[:-1]} {i} differs (counted: {paths[i]!r:.120}; here: {ours[i]!r:.120}){note}"
    if units != len(catalog.units):
        return f"it counts {units} units, the source has {len(catalog.units)} (another unit_bytes?)"
    return "the units' byte ranges, or the input files' kinds or sizes, differ (another unit_bytes?)"
