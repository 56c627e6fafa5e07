"""One tar sample = one *group* of documents (or packed rows): its members, how they are encoded and
decoded, the provenance runs in its JSON member, and the group tables (groups.npy) that say where
every group of every shard starts. Pure numpy: no I/O.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ..errors import FormatError

if TYPE_CHECKING:
    from .index import ShardEntry

#: Columns of groups.npy, per group (format 3): the byte offset of the group's first member header
#: in its shard; the items of the shard before the group (documents, or rows in packed mode); the
#: documents of the shard before the group; the group's bytes (headers, payloads and padding of its
#: members); and the checksum of those bytes (``group_checksum``).
GROUP_COLUMNS = 5
#: Format 2 had the first three columns only (no checksums).
GROUP_COLUMNS_V2 = 3
OFFSET, ITEMS, DOCS, BYTES, CHECKSUM = range(GROUP_COLUMNS)
#: The checksum of a group's bytes; chosen by measurement (docs/reliability.md): xxh3 runs at about
#: 10 GB/s here on a zero-copy view of a mapped shard, CRC32C at 4.7 GB/s and only on a copy.
CHECKSUM_NAME = "xxh3_64"


def group_checksum(data: bytes | memoryview) -> int:
    """xxh3_64 of a group's bytes, as the signed 64-bit integer groups.npy stores."""
    value = xxhash.xxh3_64_intdigest(data)
    return value - (1 << 64) if value >= 1 << 63 else value


# Member suffixes of one tar sample; the key is everything before the first dot.
TOKENS = "tokens.npy"  # 1-D token ids: the group's documents (or rows) concatenated
LENGTHS = "lengths.npy"  # docs mode: 1-D uint32 token count of each document in the group
STARTS = "starts.npy"  # packed mode: 1-D uint32 offsets in TOKENS where a document starts
META = "json"  # provenance runs and counts


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
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, _fortran, dtype = read_header(stream)
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


def expand_provenance(
    runs: list[list[int]], documents: int, where: str = ""
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of provenance_runs: per-document (file, line, piece) arrays, for a group of
    ``documents`` documents (runs that do not add up to it are refused before anything is expanded:
    they come from the shard, which may be a stranger's)."""
    ok = isinstance(runs, list) and all(
        isinstance(r, list)
        and len(r) in (3, 4)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
        for r in runs
    )
    if not ok or sum(r[2] for r in runs) != documents:
        raise FormatError(f"{where}: the provenance runs do not describe the group's {documents} documents")
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


def encode_group(
    key: str, tokens: np.ndarray, *, lengths: np.ndarray | None = None, starts: np.ndarray | None = None, meta: dict
) -> dict[str, Any]:
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


def check_group_table(
    table: np.ndarray, entry: ShardEntry, items: int, where: str, columns: int = GROUP_COLUMNS
) -> np.ndarray:
    """A shard's rows of groups.npy as [groups, columns], checked against its index entry (the
    table is untrusted data: a reader seeks by it and trusts the checksums in it only because
    the index vouches for the file's sha256)."""
    table = np.asarray(table, np.int64).reshape(-1, columns)
    if len(table) != entry.samples:
        raise FormatError(f"{where}: {len(table)} groups listed for {entry.name}, the index counts {entry.samples}")
    if len(table):
        offsets, before, docs = table[:, 0], table[:, 1], table[:, 2]
        ok = (
            offsets[0] == 0
            and before[0] == 0
            and docs[0] == 0
            and bool(np.all(np.diff(offsets) > 0))
            and bool(np.all(offsets % 512 == 0))
            and int(offsets[-1]) < entry.bytes
            and bool(np.all(np.diff(before) >= 0))
            and int(before[-1]) <= items
            and bool(np.all(np.diff(docs) >= 0))
            and int(docs[-1]) <= entry.documents
        )
        if ok and columns > BYTES:
            sizes = table[:, BYTES]
            ends = offsets + sizes
            # groups are contiguous and end before the end-of-archive blocks
            ok = (
                bool(np.all(sizes > 0))
                and bool(np.all(ends[:-1] == offsets[1:]))
                and int(ends[-1]) + 1024 <= entry.bytes
            )
        if not ok:
            raise FormatError(
                f"{where}: the groups listed for {entry.name} are not increasing offsets and counts inside the shard"
            )
    return table
