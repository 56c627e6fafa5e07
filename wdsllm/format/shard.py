"""Reading a shard's groups checked against the index: every byte the loader decodes is checked here.

A group's bytes (its members' headers, payloads and padding) are fetched whole, their checksum is
compared with the one groups.npy holds (the index vouches for groups.npy's sha256, so the chain
of trust starts at index.json), and only then are they parsed and decoded. The decoded group is
then checked against the index too: the token dtype, the number of documents or rows the table
says the group holds, and that every token id is below the vocabulary size (an out-of-range id is
a device-side assert hours into a run). Nothing leaves this module unchecked, whatever backend
the bytes came from; ``storage`` stays a byte mover and ``load`` never sees unchecked tokens.

Fetching is the caller's: a mapped local shard hands out zero-copy views, a remote stream reads
the next group, and a second attempt at a group whose checksum did not match re-reads it from the
store (a flaky proxy heals); a mismatch that persists is a :class:`ChecksumError`.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ChecksumError, FormatError, ShardError
from ..observe import stages
from ..storage.counters import count_store
from ..storage.state import own
from . import group as fmt
from .index import Index
from .tar import MappedReader, changed_file, decode_sample, iter_samples, views_mapped_file

#: fetch(offset, length, attempt) -> the bytes [offset, offset+length) of the shard, or None when
#: they cannot be fetched again (attempt > 0 on a local file: the same bytes would come back)
Fetch = Callable[[int, int, int], "bytes | memoryview | None"]

#: Attempts at a group whose checksum did not match, the first included.
CHECKSUM_ATTEMPTS = 3


@dataclass(frozen=True)
class Expect:
    """What the index says every group of a dataset must be."""

    mode: str
    dtype: np.dtype
    vocab_size: int
    seq_len: int | None = None

    @property
    def checks_ids(self) -> bool:
        """Whether an id of the dtype can be out of the vocabulary (uint16 with 65,536 ids cannot)."""
        return self.vocab_size <= np.iinfo(self.dtype).max


@dataclass(frozen=True)
class CheckedGroup:
    """A group that passed every check, with where it is and what comes before it in its shard."""

    offset: int
    items_before: int  # items of the shard before the group
    docs_before: int  # documents of the shard before the group
    items: int  # items the group holds
    group: fmt.Group


def shard_tables(index: Index, flat: np.ndarray, where: str) -> dict[str, np.ndarray]:
    """groups.npy (already checked against its sha256) cut into each shard's checked table."""
    columns = index.group_columns
    samples = [e.samples for e in index.shards]
    if len(flat) != columns * sum(samples):
        raise FormatError(f"{where}: lists {len(flat) // columns} groups, index.json counts {sum(samples)}")
    tables, at = {}, 0
    for entry in index.shards:
        rows = flat[columns * at : columns * (at + entry.samples)]
        items = entry.rows if index.mode == "packed" else entry.documents
        tables[entry.name] = fmt.check_group_table(rows, entry, items, where, columns)
        at += entry.samples
    return tables


def expect_of(index: Index) -> Expect:
    return Expect(index.mode, np.dtype(index.dtype), index.tokenizer.vocab_size, index.seq_len)


def sequential_fetch(stream: Any, position: int = 0, again: Callable[[int, int], bytes] | None = None) -> Fetch:
    """A Fetch over a stream read forward from byte ``position`` (a mapped reader: zero-copy
    views); ``again(offset, length)`` re-reads a range from the store for a second attempt."""
    return _SequentialFetch(stream, position, again)


class _SequentialFetch:
    """A Fetch that reads a stream forward; ``position`` is the stream's next byte."""

    def __init__(self, stream: Any, position: int, again: Callable[[int, int], bytes] | None) -> None:
        self.stream = stream
        self.position = position
        self.again = again

    def __call__(self, offset: int, length: int, attempt: int) -> bytes | memoryview | None:
        stream = self.stream
        if attempt:
            return self.again(offset, length) if self.again is not None else None
        if isinstance(stream, MappedReader):
            return stream.view[offset : offset + length]
        if offset < self.position:
            raise FormatError(f"group at byte {offset} requested after byte {self.position} was read")
        while self.position < offset:  # groups the caller does not want
            skipped = stream.read(min(offset - self.position, 1 << 20))
            if not skipped:
                return b""
            self.position += len(skipped)
        data = stream.read(length)
        self.position += len(data)
        return data


def _key_at(data: bytes | memoryview) -> str:
    """The sample key in the first member header of a group's bytes, if it looks like one."""
    name = bytes(data[:100]).split(b"\0", 1)[0].decode("ascii", "replace")
    key = name.split(".", 1)[0]
    return key if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", key) else "?"


class GroupRows:
    """A shard's checked rows of groups.npy (``array``), also as lists of Python ints: a read of a
    block of the epoch looks up a few groups, where numpy's cost per call would exceed the work."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.rows: list[list[int]] = array.tolist()
        self.items: list[int] = [row[fmt.ITEMS] for row in self.rows]  # items before each group

    def __len__(self) -> int:
        return len(self.rows)


def read_checked(
    fetch: Fetch,
    table: GroupRows,
    first: int,
    stop: int,
    *,
    items_total: int,
    docs_total: int,
    expect: Expect,
    where: str,
    on_retry: Callable[[str], None] | None = None,
    edges: Container[int] = (),
    buffer: Any = None,
) -> Iterator[CheckedGroup]:
    """Groups ``first`` .. ``stop - 1`` of a shard whose checked groups.npy rows are ``table``
    (format 3), each checked; ``items_total``/``docs_total``: the shard's items and documents (the index's).
    ``edges``: groups the caller reads only part of (a block of the epoch starts or stops inside
    them), kept for the read of their other part (``_RecentGroups``). ``buffer``: the spool ``fetch``
    reads in place, if any: a kept group over another buffer (a spool of an earlier pass) is read
    again from this one, so that the blocks of one read share one buffer
    (joined without a copy) and an old spool is not kept alive by the cache."""
    rows = table.rows
    for g in range(first, stop):
        offset, items_before, docs_before, size, checksum = rows[g]
        following = rows[g + 1] if g + 1 < len(rows) else None
        items_after = following[fmt.ITEMS] if following is not None else items_total
        docs_after = following[fmt.DOCS] if following is not None else docs_total
        # the same bytes, checked against the same expectations (the table's counts included)
        key = (where, offset, size, checksum, expect, items_after - items_before, docs_after - docs_before)
        group = _recent.get(key)
        if group is not None and (changed_file(group.tokens) is not None or not _inside(group.tokens, buffer)):
            group = None  # its file was rewritten since, or it is another buffer's: check the bytes here
        if group is None:
            data = _fetch_checked(fetch, offset, size, checksum, where, on_retry)
            began = time.perf_counter()  # plain clock reads: a context manager per group costs more
            group = _decode_one(data, offset, where)
            decoded = time.perf_counter()
            _check_group(group, items_after - items_before, docs_after - docs_before, expect, f"{where} @{offset}")
            stages.add("decode", decoded - began)
            stages.add("check", time.perf_counter() - decoded)
            _recent.put(key, group, size, edge=g in edges, mapped=views_mapped_file(group.tokens))
        yield CheckedGroup(offset, items_before, docs_before, items_after - items_before, group)


def _inside(tokens: np.ndarray, buffer: Any) -> bool:
    """Whether ``tokens`` view ``buffer`` (always, without one)."""
    if buffer is None:
        return True
    lo = np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]
    at = tokens.__array_interface__["data"][0]
    return lo <= at and at + tokens.nbytes <= lo + len(buffer)


class _GroupLru:
    """Checked groups by key, the least recently used dropped beyond ``max_groups`` or ``max_bytes``
    (the groups' sizes in the shard: their tokens are views of the shard's mapping or spool)."""

    def __init__(self, max_groups: int, max_bytes: int):
        self.max_groups, self.max_bytes = max_groups, max_bytes
        self.entries: OrderedDict[tuple, tuple[fmt.Group, int]] = OrderedDict()
        self.bytes = 0

    def get(self, key: tuple) -> fmt.Group | None:
        hit = self.entries.get(key)
        if hit is None:
            return None
        self.entries.move_to_end(key)
        return hit[0]

    def put(self, key: tuple, group: fmt.Group, size: int) -> None:
        if size > self.max_bytes:
            return
        had = self.entries.pop(key, None)
        if had is not None:
            self.bytes -= had[1]  # the same group read again from another buffer replaces it
        self.entries[key] = (group, size)
        self.bytes += size
        while len(self.entries) > self.max_groups or self.bytes > self.max_bytes:
            _, (_, gone) = self.entries.popitem(last=False)
            self.bytes -= gone

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


class _RecentGroups:
    """Groups checked in this process, by shard, place and checksum, so that a group read in two
    parts is fetched, hashed and decoded once:

    - the last few: a mixture reads each source in runs, and a run usually starts inside the group
      where that source's previous run stopped;
    - edge groups, which an epoch's block starts or stops inside: the block that reads the group's
      other part comes anywhere later in the shuffled order (and in every later epoch: the blocks'
      edges stay, their order changes), so more of them are kept;
    - groups of mapped local files, many more: they hold views of the page cache, not memory of
      this process, and the next epoch reads them again (the file is stat'ed before each batch is
      handed out and before a kept group is used, so a rewritten file is read and checked again).
      A dataset whose groups fit is hashed and decoded once per process, not once per epoch.
    """

    def __init__(
        self,
        max_groups: int = 16,
        max_bytes: int = 64 << 20,
        edge_groups: int = 2048,
        mapped_groups: int = 1024,
        mapped_bytes: int = 256 << 20,
    ):
        self.recent = _GroupLru(max_groups, max_bytes)
        self.edges = _GroupLru(edge_groups, max_bytes)
        self.mapped = _GroupLru(mapped_groups, mapped_bytes)
        self.lrus = (self.recent, self.mapped, self.edges)  # in the order a lookup asks them
        self.lock = threading.Lock()  # loaders of several threads share it

    def get(self, key: tuple) -> fmt.Group | None:
        with self.lock:
            for lru in self.lrus:
                group = lru.get(key)
                if group is not None:
                    return group
            return None

    def put(self, key: tuple, group: fmt.Group, size: int, edge: bool = False, mapped: bool = False) -> None:
        with self.lock:
            (self.edges if edge else self.mapped if mapped else self.recent).put(key, group, size)

    def reset(self) -> None:
        with self.lock:
            for lru in self.lrus:
                lru.clear()

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # the parent's may have been held by another thread at fork time


_recent = own("recent groups", _RecentGroups())


def _fetch_checked(
    fetch: Fetch, offset: int, size: int, checksum: int, where: str, on_retry: Callable[[str], None] | None
) -> bytes | memoryview:
    key = "?"
    for attempt in range(CHECKSUM_ATTEMPTS):
        data = fetch(offset, size, attempt)
        if data is None:
            break
        if attempt:
            count_store(where, "checksum_rereads")  # the store sent the group again
        began = time.perf_counter()
        good = len(data) == size and fmt.group_checksum(data) == checksum
        stages.add("check", time.perf_counter() - began)
        if good:
            return data
        key = _key_at(data)
        if on_retry is not None and attempt + 1 < CHECKSUM_ATTEMPTS:
            on_retry(f"{where}: sample {key}, bytes {offset}-{offset + size}: checksum mismatch; reading it again")
    raise ChecksumError(
        f"{where}: sample {key}, bytes {offset}-{offset + size}: the bytes do not match the checksum in groups.npy "
        "(a changed, corrupted or replaced shard); `wdsllm verify` checks the whole dataset"
    )


def _decode_one(data: bytes | memoryview, offset: int, where: str) -> fmt.Group:
    samples = iter_samples(MappedReader(data), where, base_offset=offset, eof_ok=True)
    raw = next(samples, None)
    if raw is None or raw.offset != offset or next(samples, None) is not None:
        raise ShardError(f"{where}: the bytes at {offset} are not exactly one sample")
    return decode_sample(raw, where)


def _check_group(group: fmt.Group, items: int, docs: int, expect: Expect, where: str) -> None:
    tokens = group.tokens
    if tokens.dtype != expect.dtype:
        raise ShardError(f"{where} sample {group.key}: tokens are {tokens.dtype}, the index says {expect.dtype}")
    if expect.mode == "packed":
        rows = -(-len(tokens) // expect.seq_len) if expect.seq_len else -1
        got = (rows, group.documents)
    else:
        got = (group.documents, group.documents)
    meta_items = group.meta.get("rows", group.meta.get("documents"))
    if got != (items, docs) or meta_items != items:
        raise ShardError(
            f"{where} sample {group.key}: holds {got[0]} items and {got[1]} documents (its metadata says "
            f"{meta_items!r:.20}); the index says {items} and {docs}"
        )
    if expect.checks_ids and len(tokens) and int(tokens.max()) >= expect.vocab_size:
        at = int(np.argmax(tokens >= expect.vocab_size))
        raise ShardError(
            f"{where} sample {group.key}: token {at} is id {int(tokens[at])}, outside the vocabulary of "
            f"{expect.vocab_size:,}"
        )
