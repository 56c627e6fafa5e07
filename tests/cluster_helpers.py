"""Helpers shared by the pack_part and cluster-engine tests: wiki records with their provenance,
the single-machine pack they must equal, and a dataset's documents keyed by where they came from."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
from pack_helpers import GPT2, cached, groups, load_index, pack_api, wiki_subset

from wdsllm import format as fmt

#: small shapes, so that a few thousand records make many shards and groups
SMALL = {"shard_size": 64 * 1024, "sample_tokens": 4096, "chunk_bytes": 16 * 1024}


def local_pack(n: int, **options) -> Path:
    """A single-machine `wdsllm pack` of the first n wiki lines (cached for the session)."""
    options = {**SMALL, **options}
    key = f"cluster-local-{n}-" + "-".join(f"{k}={v}" for k, v in sorted(options.items()))
    return cached(key, lambda d: Path(pack_api([wiki_subset(n)], d / "out", **options).output))


def source_records(n: int) -> tuple[str, list[dict]]:
    """(the input's name as the local pack's index gives it, its n records with source and line)."""
    path = wiki_subset(n)
    name = load_index(local_pack(n)).inputs[0]["path"]
    with gzip.open(path, "rt", encoding="utf-8") as f:
        records = [{"text": json.loads(line)["text"], "source": name, "line": i} for i, line in enumerate(f, 1)]
    return name, records


def documents_by_origin(path: Path) -> dict[tuple[str, int, int], bytes]:
    """docs mode: every document's tokens, keyed by (input path, line, piece); duplicates refused."""
    index = load_index(path)
    names = {i["index"]: i["path"] for i in index.inputs}
    out: dict[tuple[str, int, int], bytes] = {}
    for g in groups(path):
        files, lines, pieces = fmt.expand_provenance(g.meta["provenance"], g.documents)
        ends = np.cumsum(g.lengths.astype(np.int64))
        for f, ln, p, tokens in zip(files.tolist(), lines.tolist(), pieces.tolist(), np.split(g.tokens, ends[:-1])):
            key = (names[f], ln, p)
            assert key not in out, f"document {key} is stored twice"
            out[key] = tokens.tobytes()
    return out


def visible_files(root: Path) -> list[str]:
    """Every file under root, relative (hidden ones included: orphans are what we look for)."""
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


__all__ = ["GPT2", "SMALL", "documents_by_origin", "local_pack", "source_records", "visible_files"]
