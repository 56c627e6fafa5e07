"""`wdsllm verify`: check every shard of a dataset against its index, decoding every sample.

A shard is read once, as a stream: its bytes are hashed while the strict tar reader
(:mod:`tario`, header checksums on) walks it and every group is decoded and counted. Problems are
collected, not raised, so that one run names every broken shard; each names the shard and, where
there is one, the byte offset.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from .. import format as fmt
from .. import storage
from ..format import tar as tario

KEY_RE = re.compile(r"^\d{4}-\d{9}$")
MAX_ERRORS_PER_SHARD = 20


@dataclass
class ShardCheck:
    """What one shard holds, as decoded, and what is wrong with it."""

    name: str
    errors: list[str] = field(default_factory=list)
    bytes: int = 0
    samples: int = 0
    documents: int = 0
    tokens: int = 0
    rows: int = 0
    short_rows: int = 0
    keys: list[str] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)  # what groups.npy should say for the shard
    lengths: list[np.ndarray] = field(default_factory=list)  # docs mode: per-document lengths
    starts: list[np.ndarray] = field(default_factory=list)  # packed mode: document starts, shard offsets

    def fail(self, message: str) -> None:
        if len(self.errors) < MAX_ERRORS_PER_SHARD:
            self.errors.append(message)


@dataclass
class Report:
    root: str
    index: fmt.Index
    shards: list[ShardCheck]
    errors: list[str]  # dataset-level problems (index, lengths.npy)

    @property
    def ok(self) -> bool:
        return not self.errors and all(not s.errors for s in self.shards)

    @property
    def failures(self) -> list[str]:
        return self.errors + [
            f"{s.name}: {e}" if not e.startswith(s.name) else e for s in self.shards for e in s.errors
        ]


class _HashingReader:
    """Reads through a stream while hashing and counting the bytes (one pass per shard); with
    ``keep``, the bytes not yet taken are kept, so that each group's own bytes can be checksummed."""

    def __init__(self, stream: BinaryIO, keep: bool = False) -> None:
        self._stream = stream
        self.sha = hashlib.sha256()
        self.size = 0
        self._keep = keep
        self._tail = bytearray()  # bytes [self._tail_start, self.size)
        self._tail_start = 0

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        self.sha.update(data)
        self.size += len(data)
        if self._keep:
            self._tail += data
        return data

    def take(self, start: int, end: int) -> bytes:
        """The bytes [start, end) read so far (and forget those before ``end``)."""
        if start < self._tail_start or end > self.size:
            return b""
        data = bytes(self._tail[start - self._tail_start : end - self._tail_start])
        del self._tail[: end - self._tail_start]
        self._tail_start = end
        return data

    def seekable(self) -> bool:
        return False

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def load(source: str) -> tuple[str, fmt.Index, dict]:
    """(root, index, the raw index JSON) of a dataset directory, URL, or index.json URL."""
    root = storage.dirname_url(source) if source.rstrip("/").endswith(fmt.INDEX_NAME) else source
    url = storage.join_url(root, fmt.INDEX_NAME)
    try:
        data = storage.read_bytes(url)
    except storage.NotFoundError as exc:
        fmt.check_finished(root)
        raise storage.NotFoundError(f"{url}: cannot read the index ({exc}); is {root} a wdsllm dataset?") from exc
    except storage.StorageError as exc:
        raise storage.StorageError(f"{url}: cannot read the index ({exc}); is {root} a wdsllm dataset?") from exc
    return root, fmt.Index.from_json(data, url, check_totals=False), json.loads(data)


def check_shard(root: str, entry: fmt.ShardEntry, index: fmt.Index) -> ShardCheck:
    """Decode every sample of one shard; compare its counts, size and checksum with the index."""
    check = ShardCheck(entry.name)
    url = storage.join_url(root, entry.name)
    try:
        stream = storage.open_stream(url)
    except storage.StorageError as exc:
        check.fail(f"missing or unreadable: {exc}")
        return check
    complete = False
    with stream:
        reader = _HashingReader(stream, keep=index.checks_groups)
        try:
            for raw in tario.iter_samples(reader, entry.name, verify_checksums=True, end=entry.bytes):
                # a sample comes out once the next header block (another sample's, or the end of
                # the archive) is read: its group's bytes end where that block starts
                data = reader.take(raw.offset, reader.size - tario.BLOCK) if index.checks_groups else b""
                _check_sample(check, raw, index, data)
            complete = True
            reader.drain()
        except (fmt.FormatError, storage.StorageError, OSError) as exc:
            check.fail(str(exc))
            with contextlib.suppress(storage.StorageError, OSError):
                reader.drain()
    check.bytes = reader.size
    _compare_entry(check, entry, reader.sha.hexdigest(), counts=complete)
    return check


def _check_sample(check: ShardCheck, raw: tario.RawSample, index: fmt.Index, data: bytes) -> None:
    where = f"{check.name} sample {raw.key} @{raw.offset}"
    group = tario.decode_sample(raw, check.name)
    row = [raw.offset, check.rows if index.mode == "packed" else check.documents, check.documents]
    if index.checks_groups:
        row += [len(data), fmt.group_checksum(data)]
    check.groups.append(row)
    check.samples += 1
    check.keys.append(raw.key)
    if not KEY_RE.match(raw.key):
        check.fail(f"{where}: key is not TTTT-GGGGGGGGG")
    if group.tokens.dtype != np.dtype(index.dtype):
        check.fail(f"{where}: tokens are {group.tokens.dtype}, the index says {index.dtype}")
    if len(group.tokens) and int(group.tokens.max()) >= index.tokenizer.vocab_size:
        i = int(np.argmax(group.tokens >= index.tokenizer.vocab_size))
        at = _token_offset(raw, i, group.tokens.dtype.itemsize)
        check.fail(
            f"{check.name}: token id {int(group.tokens[i])} >= vocab size {index.tokenizer.vocab_size} at byte {at} "
            f"(sample {raw.key})"
        )
    docs = group.documents
    if group.meta.get("documents") != docs:
        check.fail(f"{where}: metadata says {group.meta.get('documents')} documents, the sample holds {docs}")
    try:
        fmt.expand_provenance(group.meta.get("provenance"), docs, where)
    except fmt.FormatError as exc:
        check.fail(str(exc))
    keys = group.meta.get("source_keys")
    if keys is not None and not (
        isinstance(keys, list) and len(keys) == docs and all(k is None or isinstance(k, str) for k in keys)
    ):
        check.fail(f"{where}: source_keys is not one key (or null) per document")
    if index.mode == "docs":
        _check_docs_group(check, group, where)
    else:
        _check_packed_group(check, group, where, index.seq_len)
    check.documents += docs
    check.tokens += len(group.tokens)


def _check_docs_group(check: ShardCheck, group: fmt.Group, where: str) -> None:
    if group.lengths is None:
        check.fail(f"{where}: a docs-mode sample without {fmt.LENGTHS}")
        return
    if len(group.lengths) and not group.lengths.all():
        check.fail(f"{where}: holds a document of 0 tokens")
    check.lengths.append(group.lengths)


def _check_packed_group(check: ShardCheck, group: fmt.Group, where: str, seq_len: int | None) -> None:
    if group.starts is None or not seq_len:
        check.fail(f"{where}: a packed-mode sample without {fmt.STARTS}")
        return
    rows = -(-len(group.tokens) // seq_len)
    if group.meta.get("rows") != rows:
        check.fail(f"{where}: metadata says {group.meta.get('rows')} rows, {len(group.tokens)} tokens make {rows}")
    check.rows += rows
    check.short_rows += int(len(group.tokens) % seq_len != 0)
    check.starts.append(group.starts.astype(np.int64) + check.tokens)


def _token_offset(raw: tario.RawSample, i: int, itemsize: int) -> int:
    """Byte offset in the shard of token i of a sample (wdsllm writes members in sorted order)."""
    pos = raw.offset
    for suffix, data in raw.members.items():
        start = pos + tario.BLOCK
        if suffix == fmt.TOKENS:
            header = len(data) - len(fmt.npy_array(data)) * itemsize
            return start + header + i * itemsize
        pos = start + -(-len(data) // tario.BLOCK) * tario.BLOCK
    return raw.offset


def _compare_entry(check: ShardCheck, entry: fmt.ShardEntry, sha256: str, counts: bool) -> None:
    """Size and checksum always; counts only when every sample decoded (else they are partial)."""
    if check.bytes != entry.bytes:
        check.fail(f"is {check.bytes} bytes, the index says {entry.bytes}")
    if sha256 != entry.sha256:
        check.fail(f"sha256 is {sha256[:16]}..., the index says {entry.sha256[:16]}...")
    if not counts:
        return
    for what in ("samples", "documents", "tokens", "rows"):
        have, want = getattr(check, what), getattr(entry, what)
        if have != want:
            check.fail(f"holds {have} {what}, the index says {want}")


# ----------------------------------------------------------------------------------------------
# The dataset as a whole.


def verify(source: str, jobs: int = 1, on_shard: Callable[[int, int, ShardCheck], None] | None = None) -> Report:
    """Check every shard (``jobs`` at a time), then lengths.npy and the index's own totals."""
    root, index, raw = load(source)
    checks: list[ShardCheck] = []
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for check in pool.map(lambda e: check_shard(root, e, index), index.shards):
            checks.append(check)
            if on_shard:
                on_shard(len(checks), len(index.shards), check)
    errors = _check_index(index, raw, checks) + _check_lengths(root, index, checks) + _check_groups(root, index, checks)
    return Report(root=root, index=index, shards=checks, errors=errors)


def _check_index(index: fmt.Index, raw: dict, checks: list[ShardCheck]) -> list[str]:
    errors = []
    totals = index.totals()
    for key, value in (raw.get("totals") or {}).items():
        if totals.get(key) != value:
            errors.append(f"{fmt.INDEX_NAME}: totals.{key} is {value}, the shard entries add up to {totals.get(key)}")
    hist = index.doc_lengths or {}
    if hist.get("count", 0) != index.documents or sum(hist.get("counts", [])) != index.documents:
        errors.append(
            f"{fmt.INDEX_NAME}: the length histogram counts {hist.get('count')} documents, the shards {index.documents}"
        )
    from_inputs = sum(i.get("documents", 0) for i in index.inputs)
    if from_inputs != index.documents:
        errors.append(f"{fmt.INDEX_NAME}: inputs account for {from_inputs} documents, the shards {index.documents}")
    counts = (index.skipped or {}).get("counts", {})
    if sum(counts.values()) != (index.skipped or {}).get("total", 0):
        errors.append(f"{fmt.INDEX_NAME}: skipped.total is not the sum of skipped.counts")
    if index.mode == "packed":
        short = sum(c.short_rows for c in checks)
        if (index.packed or {}).get("short_rows") != short:
            errors.append(
                f"{fmt.INDEX_NAME}: packed.short_rows is {(index.packed or {}).get('short_rows')}, the shards hold "
                f"{short}"
            )
    seen: dict[str, str] = {}
    for c in checks:
        for key in c.keys:
            if key in seen:
                errors.append(f"key {key} is in both {seen[key]} and {c.name}")
                break
            seen[key] = c.name
    return errors


def _read_side(root: str, ref: fmt.SideFile) -> tuple[np.ndarray | None, list[str]]:
    """A side file's array (None if unreadable) and what is wrong with it; a checksum mismatch is
    reported and the content still checked, so that the report says what differs."""
    url = storage.join_url(root, ref.name)
    try:
        data = storage.read_bytes(url)
    except storage.StorageError as exc:
        return None, [f"{ref.name}: missing or unreadable: {exc}"]
    errors = []
    try:
        ref.check(data, ref.name)
    except fmt.FormatError:
        errors.append(f"{ref.name}: size or sha256 differs from the index")
    try:
        return fmt.npy_array(data, ref.name), errors
    except fmt.FormatError as exc:
        return None, [*errors, str(exc)]


def _check_lengths(root: str, index: fmt.Index, checks: list[ShardCheck]) -> list[str]:
    """lengths.npy: its checksum, and that it holds the documents' lengths as the shards tell them."""
    if not index.lengths_file:
        return [f"{fmt.INDEX_NAME}: no lengths_file entry"]
    name = index.lengths_file.name
    lengths, errors = _read_side(root, index.lengths_file)
    if lengths is None:
        return errors
    if lengths.dtype != np.uint32:
        errors.append(f"{name}: holds {lengths.dtype} values; the format stores uint32 lengths")
    lengths = lengths.astype(np.int64)
    if any(c.errors for c in checks):
        return errors  # the shards' own errors say more than a mismatch would
    shard_lengths = _lengths_from_shards(index, checks)
    if len(lengths) != len(shard_lengths):
        errors.append(f"{name}: holds {len(lengths)} lengths, the shards hold {len(shard_lengths)} documents")
    elif not np.array_equal(lengths, shard_lengths):
        first = int(np.argmax(lengths != shard_lengths))
        errors.append(
            f"{name}: document {first} is {lengths[first]} tokens there, {shard_lengths[first]} in the shards"
        )
    return errors


def _check_groups(root: str, index: fmt.Index, checks: list[ShardCheck]) -> list[str]:
    """groups.npy: its checksum, and that it says where every group starts (format 3: and each
    group's size and checksum)."""
    if not index.groups_file:
        return []  # format 1: readers read shards from their start
    name = index.groups_file.name
    columns = index.group_columns
    table, errors = _read_side(root, index.groups_file)
    if table is None or any(c.errors for c in checks):
        return errors
    want = np.array([row for c in checks for row in c.groups], np.int64).reshape(-1)
    if len(table) != len(want):
        errors.append(f"{name}: lists {len(table) // columns} groups, the shards hold {len(want) // columns}")
    elif not np.array_equal(table, want):
        first = int(np.argmax(table != want)) // columns
        errors.append(
            f"{name}: group {first} (in dataset order) is listed as "
            f"{table[columns * first : columns * (first + 1)].tolist()}, "
            f"the shards say {want[columns * first : columns * (first + 1)].tolist()}"
        )
    return errors


def _lengths_from_shards(index: fmt.Index, checks: list[ShardCheck]) -> np.ndarray:
    if index.mode == "docs":
        parts = [part for c in checks for part in c.lengths]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    # packed: a document runs from its start to the next one (across groups and shards).
    starts, offset = [], 0
    for c in checks:
        starts.extend(s + offset for s in c.starts)
        offset += c.tokens
    if not starts:
        return np.zeros(0, np.int64)
    flat = np.concatenate(starts)
    return np.diff(np.append(flat, offset))
