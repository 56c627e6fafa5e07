"""The dataset index (index.json) and its side files: what a loader plans an epoch from without
opening a shard. An index is untrusted data: every name in it is checked before use, and every side
file is read through :func:`read_side_file`, which checks its size and sha256 against the index.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import FormatError
from .group import npy_array

FORMAT_NAME = "wdsllm"
FORMAT_VERSION = 2
#: Versions this code reads. Add a reader here, never drop one, when the version is bumped.
#: 1: no groups.npy (a reader then finds groups by reading the shard from its start).
READABLE_VERSIONS = (1, 2)

INDEX_NAME = "index.json"
#: Per-document token counts of a docs-mode dataset, in dataset order (uint32 .npy).
LENGTHS_NAME = "lengths.npy"
#: Where each group (tar sample) starts, per shard in shard order (int64 .npy, GROUP_COLUMNS per
#: group); version 2 on. Lets a reader start a shard at any group with a ranged read.
GROUPS_NAME = "groups.npy"
SHARD_PATTERN = "{prefix}-{number:06d}.tar"
SHARD_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+(?:[A-Za-z0-9_-]*[A-Za-z0-9_])?)-(?P<number>\d{6,})\.tar$")
MODES = ("docs", "packed")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65,536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(prefix: str, number: int) -> str:
    return SHARD_PATTERN.format(prefix=prefix, number=number)


@dataclass(frozen=True)
class SideFile:
    """A file beside index.json that the index vouches for (lengths.npy, groups.npy)."""

    name: str
    bytes: int
    sha256: str

    @classmethod
    def of(cls, name: str, data: bytes) -> SideFile:
        """The reference an index stores for ``data`` written under ``name``."""
        return cls(name, len(data), hashlib.sha256(data).hexdigest())

    @classmethod
    def from_json(cls, body: Any, where: str) -> SideFile | None:
        if body is None:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise FormatError(f"{where}: a side file reference must be an object with a name, not {body!r:.80}")
        size, sha = body.get("bytes"), body.get("sha256")
        if not isinstance(size, int) or size < 0 or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise FormatError(f"{where}: the reference to {body['name']!r} needs its size in bytes and a sha256")
        return cls(check_shard_name(body["name"], where), size, sha)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def check(self, data: bytes, where: str) -> bytes:
        """``data`` if it is what the index vouches for, else a FormatError naming the file."""
        if len(data) != self.bytes:
            raise FormatError(f"{where}: {len(data)} bytes, index.json says {self.bytes}")
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise FormatError(f"{where} does not match its checksum in index.json")
        return data


def read_side_file(root: str, ref: SideFile, *, retry: Any = None) -> np.ndarray:
    """The side file's array, read from the dataset root and checked against the index."""
    from .. import storage

    url = storage.join_url(root, ref.name)
    return npy_array(ref.check(storage.read_bytes(url, retry=retry), url), url)


@dataclass
class TokenizerInfo:
    source: str
    sha256: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None = None


@dataclass
class ShardEntry:
    name: str
    samples: int  # tar samples (groups)
    documents: int  # docs mode: documents (pieces count); packed: documents that start here
    tokens: int
    bytes: int
    sha256: str
    rows: int = 0  # packed mode: rows of seq_len (the last row of a shard may be short)


@dataclass
class Index:
    """index.json: everything a loader needs to plan an epoch without opening a shard."""

    mode: str
    dtype: str
    seq_len: int | None
    tokenizer: TokenizerInfo
    shards: list[ShardEntry]
    doc_lengths: dict[str, Any]
    options: dict[str, Any]
    inputs: list[dict[str, Any]]
    skipped: dict[str, Any]
    lengths_file: SideFile | None = None
    packed: dict[str, Any] | None = None  # packed mode: {"max_row_segments": k, "short_rows": n}
    groups_file: SideFile | None = None  # version 2 on
    version: int = FORMAT_VERSION
    format: str = FORMAT_NAME
    created_by: str = ""

    # -- derived ------------------------------------------------------------------------------
    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def items_per_shard(self) -> list[int]:
        """What the loader counts per shard: documents in docs mode, rows in packed mode."""
        return [s.rows if self.mode == "packed" else s.documents for s in self.shards]

    def totals(self) -> dict[str, int]:
        out = {
            "shards": len(self.shards),
            "samples": sum(s.samples for s in self.shards),
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": sum(s.bytes for s in self.shards),
        }
        if self.mode == "packed":
            out["rows"] = self.rows
        return out

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> str:
        body = {
            "format": self.format,
            "version": self.version,
            "created_by": self.created_by,
            "mode": self.mode,
            "dtype": self.dtype,
            "seq_len": self.seq_len,
            "tokenizer": asdict(self.tokenizer),
            "totals": self.totals(),
            "doc_lengths": self.doc_lengths,
            "lengths_file": self.lengths_file.to_json() if self.lengths_file else None,
            "groups_file": self.groups_file.to_json() if self.groups_file else None,
            "packed": self.packed,
            "options": self.options,
            "inputs": self.inputs,
            "skipped": self.skipped,
            "shards": [asdict(s) for s in self.shards],
        }
        return json.dumps(body, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = INDEX_NAME) -> Index:
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise FormatError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise FormatError(
                f"{where}: not a wdsllm index (format field is "
                f"{body.get('format') if isinstance(body, dict) else None!r})"
            )
        version = body.get("version")
        if version not in READABLE_VERSIONS:
            raise FormatError(
                f"{where}: format version {version} is not readable by this wdsllm (reads "
                f"{list(READABLE_VERSIONS)}); upgrade wdsllm"
            )
        try:
            shards = [ShardEntry(**s) for s in body["shards"]]
            index = cls(
                mode=body["mode"],
                dtype=body["dtype"],
                seq_len=body.get("seq_len"),
                tokenizer=TokenizerInfo(**body["tokenizer"]),
                shards=shards,
                doc_lengths=body.get("doc_lengths", {}),
                options=body.get("options", {}),
                inputs=body.get("inputs", []),
                skipped=body.get("skipped", {}),
                lengths_file=SideFile.from_json(body.get("lengths_file"), where),
                groups_file=SideFile.from_json(body.get("groups_file"), where) if version >= 2 else None,
                packed=body.get("packed"),
                version=version,
                format=body["format"],
                created_by=body.get("created_by", ""),
            )
        except (KeyError, TypeError) as exc:
            raise FormatError(f"{where}: malformed index: {exc!r}") from exc
        if index.mode not in MODES:
            raise FormatError(f"{where}: unknown mode {index.mode!r}")
        if np.dtype(index.dtype) not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise FormatError(f"{where}: token dtype must be uint16 or uint32, not {index.dtype}")
        for s in shards:
            check_shard_name(s.name, where)
        return index


def check_shard_name(name: str, where: str = INDEX_NAME) -> str:
    """An index is untrusted data: its shard names must be plain relative file names."""
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or ":" in name
        or name in (".", "..")
        or name.startswith((".", "-", "|"))
        or any(ord(c) < 32 for c in name)
    ):
        raise FormatError(f"{where}: refusing shard name {name!r}: shard names must be plain relative file names")
    return name


def length_histogram(lengths: np.ndarray) -> dict[str, Any]:
    """Counts per power-of-two bucket [2^k, 2^(k+1)), plus summary statistics."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return {"edges": [], "counts": [], "count": 0}
    top = int(lengths.max())
    nb = max(1, int(top).bit_length())
    edges = [0] + [1 << k for k in range(nb + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    qs = np.percentile(lengths, [50, 90, 99]).tolist()
    return {
        "edges": edges,
        "counts": counts.tolist(),
        "count": len(lengths),
        "min": int(lengths.min()),
        "max": top,
        "mean": round(float(lengths.mean()), 3),
        "p50": qs[0],
        "p90": qs[1],
        "p99": qs[2],
    }
