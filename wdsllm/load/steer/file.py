"""Steering from a file an operator edits while the run trains (``SteerOptions``).

Every ``reload_every`` planned steps, rank 0 re-reads the file and sends what it holds to every
rank (one broadcast over the process group, which every rank reaches at the same step), and every
rank takes it as if the trainer had called ``set_weights``, ``skip`` and ``exclude``: what was
recorded already is a replay and changes nothing. The file is

    weights: {web: 0.7, code: 0.3}   # a mixture's weights, every source named
    skip: [[1000, 1200]]             # ranges of planned steps
    exclude: {sources: [code], shards: [3, shard-000012.tar], docs: [4294967301]}

or the mixture file the loader was built from, of which only ``weights`` is taken (its sources
must be the ones the run reads). A file that cannot be read or says something invalid is logged
as an error naming the file and what is wrong, on every rank, and the run keeps its settings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ... import storage
from ...errors import ConfigError, MixtureError, SteeringError, StorageError
from ..mixture import MAX_FILE_BYTES, _parse_yaml, is_mixture_source

log = logging.getLogger(__name__)

STEER_KEYS = ("weights", "skip", "exclude")
EXCLUDE_KEYS = ("sources", "shards", "docs")


def read_steer_file(url: str, names: list[str]) -> dict[str, Any]:
    """What ``url`` asks for, as plain data (``weights``, ``skip``, ``exclude``), checked for shape;
    ``names``: the mixture's sources (a mixture file must have these)."""
    where = storage.redact(url)
    with storage.open_stream(url) as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise SteeringError(f"{where}: more than {MAX_FILE_BYTES} bytes, too large for a steering file")
    try:
        doc = _parse_yaml(bytes(data), where)
    except MixtureError as exc:
        raise SteeringError(str(exc)) from None
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise SteeringError(f"{where}: a steering file holds a mapping of {', '.join(STEER_KEYS)}")
    if "sources" in doc:  # the mixture file itself: only its weights move
        sources = doc["sources"]
        if not isinstance(sources, Mapping) or sorted(map(str, sources)) != sorted(names):
            raise SteeringError(f"{where}: the mixture's sources changed; a reload takes its weights only")
        return {"weights": dict(doc["weights"])} if isinstance(doc.get("weights"), Mapping) else {}
    unknown = [k for k in doc if k not in STEER_KEYS]
    if unknown:
        raise SteeringError(f"{where}: key {unknown[0]!r} is not a steering key ({', '.join(STEER_KEYS)})")
    out: dict[str, Any] = {}
    if "weights" in doc:
        if not isinstance(doc["weights"], Mapping):
            raise SteeringError(f"{where}: key 'weights' must map source names to weights")
        out["weights"] = {str(k): v for k, v in doc["weights"].items()}
    if "skip" in doc:
        skips = doc["skip"]
        if not isinstance(skips, list) or not all(isinstance(r, list) and len(r) == 2 for r in skips):
            raise SteeringError(f"{where}: key 'skip' must be a list of [start, stop] ranges of planned steps")
        out["skip"] = [list(r) for r in skips]
    if "exclude" in doc:
        ex = doc["exclude"]
        if not isinstance(ex, Mapping) or any(k not in EXCLUDE_KEYS for k in ex):
            raise SteeringError(f"{where}: key 'exclude' must map {', '.join(EXCLUDE_KEYS)} to lists")
        if not all(isinstance(v, list) for v in ex.values()):
            raise SteeringError(f"{where}: every list under 'exclude' must be a list")
        out["exclude"] = {k: list(v) for k, v in ex.items()}
    return out


def fetched(url: str, names: list[str]) -> tuple[str, Any]:
    """("ok", what the file says) or ("error", why not): what rank 0 sends."""
    try:
        return "ok", read_steer_file(url, names)
    except (SteeringError, StorageError, OSError) as exc:
        return "error", f"{storage.redact(url)} was not taken: {exc}"


def shared(url: str, names: list[str]) -> tuple[str, Any]:
    """Rank 0's reading of the file, on every rank (read here where there is one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return fetched(url, names)
    box: list[Any] = [fetched(url, names) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def steer_file_of(face: Any) -> str | None:
    """The steering file a loader re-reads: the one named, else the mixture file it was built from."""
    given = face.steer.steer_file
    if given is None and face.steer.reload_every is not None:
        if isinstance(face.source, (str, os.PathLike)) and is_mixture_source(face.source):
            given = os.fspath(face.source)
        else:
            raise ConfigError("reload_every= re-reads a steering file: pass steer_file= (or build from a mixture file)")
    return given


__all__ = ["fetched", "read_steer_file", "shared", "steer_file_of"]
