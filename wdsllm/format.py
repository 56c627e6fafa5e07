"""The shard format: the contract between packing and loading (see docs/format.md).

Both paths import this module and nothing else of each other. It knows member names, the token
dtype rule, how a tar sample (a *group* of documents or rows) is encoded and decoded, and the
schema of ``index.json`` with its version.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

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
#: (byte offset of the group's first member header in its shard, items of the shard before the
#: group (documents, or rows in packed mode), documents of the shard before the group)
GROUP_COLUMNS = 3
SHARD_PATTERN = "{prefix}-{number:06d}.tar"
SHARD_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+(?:[A-Za-z0-9_-]*[A-Za-z0-9_])?)-(?P<number>\d{6,})\.tar$")

# Member suffixes of one tar sample; the key is everything before the first dot.
TOKENS = "tokens.npy"  # 1-D token ids: the group's documents (or rows) concatenated
LENGTHS = "lengths.npy"  # docs mode: 1-D uint32 token count of each document in the group
STARTS = "starts.npy"  # packed mode: 1-D uint32 offsets in TOKENS where a document starts
META = "json"  # provenance runs and counts

MODES = ("docs", "packed")
TAR_MTIME = 0  # fixed so that identical input gives byte-identical shards
TAR_USER = "wdsllm"
TAR_MODE = 0o444


class FormatError(ValueError):
    """A shard, sample or index does not follow the format; the message says where."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65,536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(prefix: str, number: int) -> str:
    return SHARD_PATTERN.format(prefix=prefix, number=number)


def group_key(task: int, group: int) -> str:
    """Keys are unique across a dataset and survive `wdsllm merge`: task index plus group counter."""
    return f"{task:04d}-{group:09d}"


# ----------------------------------------------------------------------------------------------
# npy members. np.save/np.load are slow for millions of small reads; these are exact equivalents
# for 1-D little-endian arrays and still produce files that numpy and webdataset read.


def npy_bytes(array: np.ndarray) -> bytes:
    """Encode a 1-D array as .npy bytes (version 1.0 header, C order, no pickle)."""
    array = np.ascontiguousarray(array)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=False)
    return buf.getvalue()


_header_cache: dict[bytes, tuple[np.dtype, int, int]] = {}


def npy_array(data: bytes | memoryview, where: str = "") -> np.ndarray:
    """Decode .npy bytes to a read-only 1-D array without copying the payload."""
    view = memoryview(data)
    if len(view) < 10 or bytes(view[:6]) != b"\x93NUMPY":
        raise FormatError(f"{where}: not an .npy member")
    major = view[6]
    hlen_size = 2 if major == 1 else 4
    hlen = int.from_bytes(view[8 : 8 + hlen_size], "little")
    start = 8 + hlen_size + hlen
    header = bytes(view[:start])
    cached = _header_cache.get(header)
    if cached is None:
        try:
            stream = io.BytesIO(header)
            version = np.lib.format.read_magic(stream)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(stream)
        except Exception as exc:  # numpy raises several types for a bad header
            raise FormatError(f"{where}: bad .npy header: {exc}") from exc
        if len(shape) != 1 or dtype.hasobject:
            raise FormatError(f"{where}: expected a 1-D numeric array, got shape {shape} {dtype}")
        cached = (dtype, shape[0], start)
        if len(_header_cache) < 1024:
            _header_cache[header] = cached
    dtype, count, start = cached
    if len(view) - start != count * dtype.itemsize:
        raise FormatError(f"{where}: .npy payload is {len(view) - start} bytes, header says {count * dtype.itemsize}")
    return np.frombuffer(view, dtype=dtype, count=count, offset=start)


# ----------------------------------------------------------------------------------------------
# Provenance: runs that say where each document of a group came from, compactly.
#   [file, line, count]          -> `count` documents from lines line, line+1, ... (piece 0 each)
#   [file, line, count, piece]   -> `count` pieces piece, piece+1, ... of the document on `line`
# `file` indexes the dataset's input list (index.json "inputs"), lines are 1-based.


def provenance_runs(files: np.ndarray, lines: np.ndarray, pieces: np.ndarray) -> list[list[int]]:
    """Compress per-document (file, line, piece) into runs."""
    runs: list[list[int]] = []
    n = len(files)
    i = 0
    while i < n:
        f, ln, p = int(files[i]), int(lines[i]), int(pieces[i])
        j = i + 1
        if p == 0 and (j >= n or pieces[j] == 0):
            while j < n and files[j] == f and pieces[j] == 0 and lines[j] == ln + (j - i):
                j += 1
            runs.append([f, ln, j - i])
        else:
            while j < n and files[j] == f and lines[j] == ln and pieces[j] == p + (j - i):
                j += 1
            runs.append([f, ln, j - i, p])
        i = j
    return runs


def expand_provenance(runs: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of provenance_runs: per-document (file, line, piece) arrays."""
    files, lines, pieces = [], [], []
    for run in runs:
        f, ln, count = run[0], run[1], run[2]
        if len(run) == 3:
            files.extend([f] * count)
            lines.extend(range(ln, ln + count))
            pieces.extend([0] * count)
        else:
            files.extend([f] * count)
            lines.extend([ln] * count)
            pieces.extend(range(run[3], run[3] + count))
    return (
        np.asarray(files, dtype=np.int64),
        np.asarray(lines, dtype=np.int64),
        np.asarray(pieces, dtype=np.int64),
    )


# ----------------------------------------------------------------------------------------------
# One tar sample = one group.


@dataclass
class Group:
    """A decoded tar sample. Docs mode fills ``lengths``; packed mode fills ``starts``."""

    key: str
    tokens: np.ndarray
    lengths: np.ndarray | None = None
    starts: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def documents(self) -> int:
        return len(self.lengths) if self.lengths is not None else len(self.starts)


def encode_group(key: str, tokens: np.ndarray, *, lengths=None, starts=None, meta: dict) -> dict[str, Any]:
    """The webdataset sample dict (already bytes) for one group."""
    sample: dict[str, Any] = {"__key__": key, TOKENS: npy_bytes(tokens)}
    if lengths is not None:
        sample[LENGTHS] = npy_bytes(np.asarray(lengths, dtype=np.uint32))
    if starts is not None:
        sample[STARTS] = npy_bytes(np.asarray(starts, dtype=np.uint32))
    sample[META] = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    return sample


def decode_group(sample: dict[str, Any], where: str = "", meta: dict | None = None) -> Group:
    """Decode a raw webdataset sample (member suffix -> bytes) and check its internal counts.
    ``meta``: the json member already parsed (the reader parses it first, to skip groups)."""
    key = sample.get("__key__", "?")
    where = f"{where} sample {key}"
    if TOKENS not in sample:
        raise FormatError(f"{where}: missing {TOKENS}")
    tokens = npy_array(sample[TOKENS], f"{where}.{TOKENS}")
    lengths = npy_array(sample[LENGTHS], f"{where}.{LENGTHS}") if LENGTHS in sample else None
    starts = npy_array(sample[STARTS], f"{where}.{STARTS}") if STARTS in sample else None
    if meta is None:
        try:
            meta = json.loads(sample[META]) if META in sample else {}
        except ValueError as exc:
            raise FormatError(f"{where}.{META}: {exc}") from exc
    if lengths is None and starts is None:
        raise FormatError(f"{where}: neither {LENGTHS} nor {STARTS}")
    if lengths is not None and int(lengths.sum(dtype=np.int64)) != len(tokens):
        raise FormatError(f"{where}: lengths sum to {int(lengths.sum())}, tokens has {len(tokens)}")
    if starts is not None and len(starts) and (int(starts[-1]) >= len(tokens) or (starts[1:] <= starts[:-1]).any()):
        raise FormatError(f"{where}: document starts are not increasing offsets inside the tokens")
    return Group(key=key, tokens=tokens, lengths=lengths, starts=starts, meta=meta)


# ----------------------------------------------------------------------------------------------
# Group tables (groups.npy): where every group of every shard starts.


def group_table_bytes(tables: list[np.ndarray]) -> bytes:
    """groups.npy from per-shard [groups, GROUP_COLUMNS] int64 tables, in shard order."""
    flat = np.concatenate([np.asarray(t, np.int64).reshape(-1) for t in tables]) if tables else np.zeros(0, np.int64)
    return npy_bytes(flat)


def check_group_table(table: np.ndarray, entry: "ShardEntry", items: int, where: str) -> np.ndarray:
    """A shard's rows of groups.npy as [groups, GROUP_COLUMNS], checked against its index entry
    (the table is untrusted data: a reader seeks by it)."""
    table = np.asarray(table, np.int64).reshape(-1, GROUP_COLUMNS)
    if len(table) != entry.samples:
        raise FormatError(f"{where}: {len(table)} groups listed for {entry.name}, the index counts {entry.samples}")
    if len(table):
        offsets, before, docs = table[:, 0], table[:, 1], table[:, 2]
        ok = (
            offsets[0] == 0 and before[0] == 0 and docs[0] == 0
            and bool(np.all(np.diff(offsets) > 0)) and bool(np.all(offsets % 512 == 0)) and int(offsets[-1]) < entry.bytes
            and bool(np.all(np.diff(before) >= 0)) and int(before[-1]) <= items
            and bool(np.all(np.diff(docs) >= 0)) and int(docs[-1]) <= entry.documents
        )
        if not ok:
            raise FormatError(f"{where}: the groups listed for {entry.name} are not increasing offsets and counts inside the shard")
    return table


# ----------------------------------------------------------------------------------------------
# The index.


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
    lengths_file: dict[str, Any] | None = None
    packed: dict[str, Any] | None = None  # packed mode: {"max_row_segments": k, "short_rows": n}
    groups_file: dict[str, Any] | None = None  # version 2: {"name": "groups.npy", "bytes": n, "sha256": "…"}
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
            "lengths_file": self.lengths_file,
            "groups_file": self.groups_file,
            "packed": self.packed,
            "options": self.options,
            "inputs": self.inputs,
            "skipped": self.skipped,
            "shards": [asdict(s) for s in self.shards],
        }
        return json.dumps(body, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = INDEX_NAME) -> "Index":
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise FormatError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not a wdsllm index (format field is {body.get('format') if isinstance(body, dict) else None!r})")
        version = body.get("version")
        if version not in READABLE_VERSIONS:
            raise FormatError(
                f"{where}: format version {version} is not readable by this wdsllm (reads {list(READABLE_VERSIONS)}); upgrade wdsllm"
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
                lengths_file=body.get("lengths_file"),
                groups_file=body.get("groups_file") if version >= 2 else None,
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
        "count": int(len(lengths)),
        "min": int(lengths.min()),
        "max": top,
        "mean": round(float(lengths.mean()), 3),
        "p50": qs[0],
        "p90": qs[1],
        "p99": qs[2],
    }
