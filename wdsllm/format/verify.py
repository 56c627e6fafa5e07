"""`wdsllm verify`: check every shard of a dataset against its index, decoding every sample.

A shard is read once, as a stream: its bytes are hashed while the strict tar reader
(:mod:`tario`, header checksums on) walks it and every group is decoded and counted. Problems are
collected, not raised, so that one run names every broken shard; each names the shard and, where
there is one, the byte offset.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from .. import format as fmt
from .. import storage
from ..format import tar as tario
from .index import read_index_bytes
from .side import SideArray

#: ``group_key``: at least four digits of task (part) index and nine of group counter, more when
#: the number needs them (a part id of 10,000 or more, a task of a billion groups)
KEY_RE = re.compile(r"^(?:\d{4}|[1-9]\d{4,})-(?:\d{9}|[1-9]\d{9,})$")
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
    path = storage.split_query(source)[0] if storage.is_remote(source) else source
    root = storage.dirname_url(source) if path.rstrip("/").endswith(fmt.INDEX_NAME) else source
    url = storage.join_url(root, fmt.INDEX_NAME)
    try:
        data = read_index_bytes(url)
    except storage.NotFoundError as exc:
        fmt.check_finished(root)
        raise storage.NotFoundError(f"{url}: cannot read the index ({exc}); is {root} a wdsllm dataset?") from exc
    except storage.StorageError as exc:
        raise storage.StorageError(f"{url}: cannot read the index ({exc}); is {root} a wdsllm dataset?") from exc
    index, body = fmt.read_index(root, check_totals=False, data=data)
    return root, index, body


def check_shard(root: str, entry: fmt.ShardEntry, index: fmt.Index, listed: np.ndarray | None = None) -> ShardCheck:
    """Decode every sample of one shard; compare its counts, size and checksum with the index, and
    each sample's bytes with its row of groups.npy (``listed``: the shard's rows), so that a changed
    byte is named by its sample and byte range, as the loader names it."""
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
                _check_group_bytes(check, raw, data, listed)
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


def _check_group_bytes(check: ShardCheck, raw: tario.RawSample, data: bytes, listed: np.ndarray | None) -> None:
    """The sample's bytes against the checksum groups.npy lists for it (when the index has one)."""
    g = check.samples
    if listed is None or g >= len(listed):
        return
    offset, size, checksum = int(listed[g][0]), int(listed[g][3]), int(listed[g][4])
    if offset == raw.offset and size == len(data) and checksum == fmt.group_checksum(data):
        return
    check.fail(
        f"{check.name}: sample {raw.key}, bytes {offset}-{offset + size}: the bytes do not match the checksum in "
        f"{fmt.GROUPS_NAME} (a changed or corrupted sample)"
    )


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
        check.fail(f"{where}: key is not TTTT-GGGGGGGGG (task index and group counter, at least 4 and 9 digits)")
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
# The dataset as a whole, streamed: shards are checked in parallel processes and come back in
# order, and each one's lengths and group rows are compared with its part of lengths.npy and
# groups.npy at once, then dropped. What is kept per shard is its tallies and errors.


def verify(source: str, jobs: int = 1, on_shard: Callable[[int, int, ShardCheck], None] | None = None) -> Report:
    """Check every shard (in ``jobs`` processes; 0: one per core), then lengths.npy, groups.npy
    and the index's own totals."""
    root, index, raw = load(source)
    sides = _SideChecks(root, index)
    checks: list[ShardCheck] = []
    keys: dict[str, str] = {}
    key_errors: list[str] = []
    jobs = jobs or len(os.sched_getaffinity(0))
    for check in _checked_in_order(root, index, jobs, sides.listed_rows):
        sides.add(check)
        _note_keys(check, keys, key_errors)
        check.lengths, check.starts, check.groups, check.keys = [], [], [], []
        checks.append(check)
        if on_shard:
            on_shard(len(checks), len(index.shards), check)
    errors = _check_index(index, raw, checks) + key_errors + sides.finish() + _check_tokenizer(root, index)
    return Report(root=root, index=index, shards=checks, errors=errors)


_WORKER: dict = {}


def _init_worker(root: str, index: fmt.Index) -> None:
    _WORKER["root"], _WORKER["index"] = root, index


def _check_in_worker(position: int, listed: np.ndarray | None) -> ShardCheck:
    index = _WORKER["index"]
    return check_shard(_WORKER["root"], index.shards[position], index, listed)


def _checked_in_order(
    root: str, index: fmt.Index, jobs: int, listed_rows: Callable[[int], np.ndarray | None]
) -> Iterator[ShardCheck]:
    """Every shard's check, in shard order; with several jobs, a bounded window of shards is in
    flight in worker processes (decoding tars is Python work: threads would share one core)."""
    n = len(index.shards)
    if jobs <= 1 or n <= 1:
        for i in range(n):
            yield check_shard(root, index.shards[i], index, listed_rows(i))
        return
    with ProcessPoolExecutor(min(jobs, n), initializer=_init_worker, initargs=(root, index)) as pool:
        pending: deque = deque()
        submitted = 0
        while submitted < n or pending:
            while submitted < n and len(pending) < 4 * jobs:
                pending.append(pool.submit(_check_in_worker, submitted, listed_rows(submitted)))
                submitted += 1
            yield pending.popleft().result()


def _note_keys(check: ShardCheck, seen: dict[str, str], errors: list[str]) -> None:
    for key in check.keys:
        if key in seen:
            errors.append(f"key {key} is in both {seen[key]} and {check.name}")
            break
        seen[key] = check.name


def index_problems(index: fmt.Index, raw: dict) -> list[str]:
    """What the index says against itself, without reading a shard: totals that are not the sum of
    the shard entries, and numbers JSON has no word for (NaN, infinities)."""
    errors = []
    totals = index.totals()
    for key, value in (raw.get("totals") or {}).items():
        if totals.get(key) != value and not _is_non_finite(value):
            errors.append(f"{fmt.INDEX_NAME}: totals.{key} is {value}, the shard entries add up to {totals.get(key)}")
    errors.extend(f"{fmt.INDEX_NAME}: {path} is {value}, not a number" for path, value in _non_finite(raw, ""))
    return errors


def _is_non_finite(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _non_finite(value: object, path: str, depth: int = 0) -> Iterator[tuple[str, float]]:
    """(path, value) of every NaN or infinity in parsed JSON (the index's depth is bounded when parsed)."""
    if _is_non_finite(value):
        yield path or "(top)", value
    elif isinstance(value, dict) and depth < 64:
        for k, v in value.items():
            yield from _non_finite(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list) and depth < 64:
        for i, v in enumerate(value):
            yield from _non_finite(v, f"{path}[{i}]", depth + 1)


def _check_index(index: fmt.Index, raw: dict, checks: list[ShardCheck]) -> list[str]:
    errors = index_problems(index, raw)
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
    return errors


class _SideChecks:
    """lengths.npy and groups.npy against the shards, one shard at a time, in shard order: each
    shard's decoded lengths (docs mode; packed mode: the documents its starts end) and group rows
    are compared with the side file's next entries. Both files are also hashed whole (sha256 and
    chunk digests) in a pass that holds one piece at a time."""

    def __init__(self, root: str, index: fmt.Index) -> None:
        self.index = index
        self.errors: list[str] = []
        self.shard_errors = False
        self.vouched: set[str] = set()  # side files whose digests match the index
        samples = index.shards.column("samples") if len(index.shards) else np.zeros(0, np.int64)
        self.samples_before = np.concatenate([[0], np.cumsum(samples, dtype=np.int64)])
        self.lengths = self._open(root, index.lengths_file, "lengths")
        self.groups = self._open(root, index.groups_file, "groups") if index.groups_file else None
        if self.lengths is not None and self.lengths.dtype != np.uint32:
            self.errors.append(
                f"{index.lengths_file.name}: holds {self.lengths.dtype} values; the format stores uint32 lengths"
            )
        self.docs = 0  # lengths compared so far
        self.group_rows = 0  # groups compared so far
        self.first_length: str | None = None  # the first difference found
        self.first_group: str | None = None
        self.pending_start: int | None = None  # packed: the global start of the last document seen
        self.tokens = 0  # packed: tokens of the shards so far

    def _open(self, root: str, ref: fmt.SideFile | None, what: str) -> SideArray | None:
        if ref is None:
            if what == "lengths":
                self.errors.append(f"{fmt.INDEX_NAME}: no lengths_file entry")
            return None
        url = storage.join_url(root, ref.name)
        try:
            if storage.scheme_of(url) == "file":
                side = SideArray.open(root, ref, check=False)
            else:
                side = SideArray(url, ref, data=storage.read_bytes(url), check=False)
        except storage.StorageError as exc:
            self.errors.append(f"{ref.name}: missing or unreadable: {exc}")
            return None
        except fmt.FormatError as exc:
            self.errors.append(str(exc))
            return None
        if side.offset + side.count * side.dtype.itemsize != side.size:
            self.errors.append(f"{ref.name}: .npy payload is {side.size - side.offset} bytes, header says {side.count}")
            return None
        size, sha256, chunks = side.digests()
        if (size, sha256) != (ref.bytes, ref.sha256):
            self.errors.append(f"{ref.name}: size or sha256 differs from the index")
        elif ref.chunks and chunks != list(ref.chunks):
            self.errors.append(f"{ref.name}: its chunk digests differ from the index's")
        else:
            self.vouched.add(what)
        return side

    def listed_rows(self, position: int) -> np.ndarray | None:
        """Shard ``position``'s rows of groups.npy, shaped (samples, columns), when the file is the
        one the index vouches for and holds group checksums; else None."""
        if self.groups is None or "groups" not in self.vouched or not self.index.checks_groups:
            return None
        columns = self.index.group_columns
        a = columns * self.samples_before[position]
        b = a + columns * self.index.shards[position].samples
        if b > self.groups.count:
            return None
        return self.groups.read(a, b, check=False).astype(np.int64).reshape(-1, columns)

    def add(self, check: ShardCheck) -> None:
        if check.errors:
            self.shard_errors = True
        if self.shard_errors:
            return  # the shards' own errors say more than a mismatch would
        if self.lengths is not None:
            self._add_lengths(self._shard_lengths(check))
        if self.groups is not None:
            self._add_groups(np.asarray(check.groups, np.int64).reshape(-1))

    def _shard_lengths(self, check: ShardCheck) -> np.ndarray:
        if self.index.mode == "docs":
            return np.concatenate(check.lengths).astype(np.int64) if check.lengths else np.zeros(0, np.int64)
        # packed: a document runs from its start to the next one (across groups and shards)
        starts = [s + self.tokens for s in check.starts]
        self.tokens += check.tokens
        if self.pending_start is not None:
            starts.insert(0, np.array([self.pending_start], np.int64))
        if not starts:
            return np.zeros(0, np.int64)
        flat = np.concatenate(starts)
        self.pending_start = int(flat[-1])
        return np.diff(flat)

    def _add_lengths(self, lengths: np.ndarray) -> None:
        a = self.docs
        self.docs += len(lengths)
        if self.first_length is not None or a >= self.lengths.count:
            return
        have = self.lengths.read(a, a + len(lengths)).astype(np.int64)
        n = len(have)
        if not np.array_equal(have, lengths[:n]):
            i = int(np.argmax(have != lengths[:n]))
            name = self.index.lengths_file.name
            self.first_length = f"{name}: document {a + i} is {have[i]} tokens there, {lengths[i]} in the shards"

    def _add_groups(self, rows: np.ndarray) -> None:
        columns = self.index.group_columns
        a = self.group_rows * columns
        self.group_rows += len(rows) // columns
        if self.first_group is not None or a >= self.groups.count:
            return
        have = self.groups.read(a, a + len(rows)).astype(np.int64)
        n = len(have)
        if not np.array_equal(have, rows[:n]):
            g = (a + int(np.argmax(have != rows[:n]))) // columns
            listed = self.groups.read(columns * g, columns * (g + 1)).tolist()
            said = rows[columns * g - a : columns * (g + 1) - a].tolist()
            name = self.index.groups_file.name
            self.first_group = f"{name}: group {g} (in dataset order) is listed as {listed}, the shards say {said}"

    def finish(self) -> list[str]:
        errors = self.errors
        if self.shard_errors:
            return errors
        if self.lengths is not None:
            if self.index.mode == "packed" and self.pending_start is not None:
                self._add_lengths(np.array([self.tokens - self.pending_start], np.int64))
            name = self.index.lengths_file.name
            if self.docs != self.lengths.count:
                errors.append(f"{name}: holds {self.lengths.count} lengths, the shards hold {self.docs} documents")
            elif self.first_length:
                errors.append(self.first_length)
        if self.groups is not None:
            columns = self.index.group_columns
            name = self.index.groups_file.name
            if self.group_rows * columns != self.groups.count:
                errors.append(f"{name}: lists {self.groups.count // columns} groups, the shards hold {self.group_rows}")
            elif self.first_group:
                errors.append(self.first_group)
        return errors


def _check_tokenizer(root: str, index: fmt.Index) -> list[str]:
    """tokenizer.json, when the index names it: the exact text whose sha256 the index holds (the
    tokenizer the dataset was packed with)."""
    if not index.tokenizer_file:
        return []  # packed before datasets carried their tokenizer
    name = index.tokenizer_file.name
    try:
        fmt.read_side_bytes(root, index.tokenizer_file)
    except storage.StorageError as exc:
        return [f"{name}: missing or unreadable: {exc}"]
    except fmt.FormatError:
        return [f"{name}: size or sha256 differs from the index (not the packing tokenizer)"]
    return []
