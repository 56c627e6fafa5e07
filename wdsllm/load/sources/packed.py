"""A packed dataset as a source: its shards and its index, resolved from a dataset root, an index
URL, or shard URLs and patterns.

A source is one of: a dataset root holding index.json (a directory, ``file://``, ``http(s)://``
or ``s3://`` URL, with or without a trailing slash); the URL of an index.json; shard URLs or
brace patterns on any of those schemes; local globs; ``pipe:CMD``.

The index is untrusted data when it comes from the network: its shard names are checked by
``format.check_shard_name`` and joined to the root by ``storage.join_url`` (which keeps them one
literal name), and ``pipe:`` is allowed only for URLs the user typed. Names that come from a
directory listing or a glob are made into paths that no scheme can claim.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote

import numpy as np

from ... import format as fmt
from ... import storage
from ...errors import MixtureError, TokenizerError
from ...format.index import read_index_bytes
from ...format.shard import Expect, GroupRows, expect_of
from ...format.side import SideArray
from ..block import Block, make_id
from ..plan import Slice
from ..read import ReadOptions, open_kwargs, ranged_start, read_slice
from .lengths import IndexLengths
from .protocol import OneDataset, Opening

log = logging.getLogger(__name__)


#: shard URLs a ``ShardUrls`` keeps once made (an epoch's blocks ask for a few shards' URLs often)
URLS_KEPT = 256


class ShardUrls(Sequence):
    """The URLs of an index's shards, made when asked for: a dataset of a million shards never
    holds a million strings (at most ``URLS_KEPT`` recently made)."""

    def __init__(self, root: str, table: fmt.ShardTable, positions: np.ndarray | None = None):
        self.root = root
        self.table = table
        self.positions = positions
        self._made: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.table) if self.positions is None else len(self.positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        url = self._made.get(i)
        if url is None:
            p = i if self.positions is None else int(self.positions[i])
            url = storage.join_url(self.root, self.table.name(p))
            if len(self._made) >= URLS_KEPT:
                self._made.clear()
            self._made[i] = url
        return url

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


#: shards whose group tables (checked) and ``ShardFacts`` a process keeps for their next reads
GROUP_TABLES_KEPT = 256
#: ... and at most this many groups in those tables: a group's row as Python ints is about 300 bytes
GROUP_ROWS_KEPT = 1 << 16


@dataclass(frozen=True)
class ShardFacts:
    """What every read of one shard asks of its URL and the index, worked out once per process: an
    epoch reads a few-shard dataset a block at a time, each block a read of its own."""

    url: str
    entry: fmt.ShardEntry | None  # None without an index
    remote: bool
    local_path: str | None  # a local file's path (found mapped again by a stat), else None
    items: int | None  # rows (packed) or documents, where an index says
    prev_doc: int  # packed rows: id of the previous shard's last document, which a first row may continue (-1)


@dataclass
class PackedSource(OneDataset):
    """The shards to read, in index order, and the index when there is one (a ``Source``, and
    the ``UnitReader`` of its own shards).

    Everything of dataset size stays out of Python objects: per-shard counts are int64 columns of
    the index's shard table, and lengths.npy and groups.npy are side files read in ranges
    (``format.side.SideArray``: memory-mapped, each range checked once per process), so opening a
    source costs the same for a thousand shards and for a million, and so does a worker.
    """

    urls: Sequence[str]
    index: fmt.Index | None = None
    root: str | None = None
    user_urls: bool = False  # urls typed by the user (pipe: allowed), not derived from an index
    positions: np.ndarray | None = None  # index positions of the shards (None: every shard, in index order)
    retry: storage.RetryPolicy | None = field(default=None, repr=False)  # for index and side file reads
    side_cache: Any = field(default=None, repr=False)  # a storage.ShardCache for remote side files
    _sides: dict = field(default_factory=dict, repr=False)  # side file name -> SideArray
    _columns: dict = field(default_factory=dict, repr=False)  # cached per-shard int64 columns
    _tables: dict = field(default_factory=dict, repr=False)  # shard -> its checked rows of groups.npy
    _facts: dict = field(default_factory=dict, repr=False)  # shard -> its ShardFacts
    _expect: Expect | None = field(default=None, repr=False)
    _lengths: IndexLengths | None = field(default=None, repr=False)  # lengths.npy, once opened

    #: the stream opens the shards, reading the next one ahead while this one is consumed
    opens_units = True

    @property
    def mode(self) -> str:
        return self.index.mode if self.index else "docs"

    @property
    def shard_entries(self) -> Sequence[fmt.ShardEntry] | None:
        """Index entries of ``urls`` (same order), or None without an index."""
        if self.index is None:
            return None
        if self.positions is None:
            return self.index.shards
        if "entries" not in self._columns:  # shards the user listed: a list is small
            self._columns["entries"] = [self.index.shards[int(p)] for p in self.positions]
        return self._columns["entries"]

    def _column(self, name: str) -> np.ndarray | None:
        """One int64 count per shard of the source, from the index's shard table (cached)."""
        if self.index is None:
            return None
        if name not in self._columns:
            col = self.index.shards.column(name)
            self._columns[name] = col if self.positions is None else col[self.positions]
        return self._columns[name]

    @property
    def items_per_shard(self) -> np.ndarray | None:
        """Documents (docs mode) or rows (packed) per shard, when an index says so."""
        return self._column("rows" if self.mode == "packed" else "documents")

    @property
    def docs_per_shard(self) -> np.ndarray | None:
        return self._column("documents")

    @property
    def tokens_per_shard(self) -> np.ndarray | None:
        return self._column("tokens")

    def _starts(self, name: str) -> np.ndarray:
        """Where each of the source's shards' entries begin in a dataset-order file (documents in
        lengths.npy, groups in groups.npy): the index-wide running sum of ``name``."""
        key = f"start:{name}"
        if key not in self._columns:
            col = self.index.shards.column(name)
            starts = np.zeros(len(col) + 1, np.int64)
            np.cumsum(col, out=starts[1:])
            self._columns[key] = starts[:-1] if self.positions is None else starts[self.positions]
        return self._columns[key]

    # -- what a mixture answers otherwise (``sources.mixture.MixtureSource``) ---------------------
    def bind(self, cfg: Any, world: int) -> None:
        """Nothing of one dataset depends on the loader's settings."""

    def components(self) -> list[PackedSource]:
        return [self]

    def reader(self, unit: int) -> tuple[PackedSource, int]:
        return self, unit

    def __getstate__(self) -> dict:
        # Workers started by spawn get the source pickled: side files travel as references and
        # are mapped again there; checked group tables are cheap to check again.
        state = dict(self.__dict__)
        state["_tables"] = {}
        state["_columns"] = {}
        state["_facts"] = {}
        return state

    # -- reading its shards (``UnitReader``) ------------------------------------------------------
    def opening(self, sl: Slice, skip: int, options: ReadOptions, whole: bool = False) -> Opening | None:
        """A remote shard opened by the stream (read ahead), entered at a group where a ranged read
        can be (``read.ranged_start``), unless ``whole``; None for a local one: the reader maps it
        (once per process, ``format.tar.map_cache``), and nothing is gained by opening it ahead."""
        facts = self.shard(sl.shard)
        if not facts.remote:
            return None
        start = None if whole else ranged_start(self, sl, skip, options)
        return Opening(facts.url, open_kwargs(self, sl.shard, options, start), start)

    def read(
        self,
        sl: Slice,
        *,
        skip: int,
        options: ReadOptions,
        opened: Opening | None = None,
        stream: Any = None,
        stats: Any = None,
        held: dict | None = None,
    ) -> Iterator[Block]:
        start = opened.start if opened is not None else None
        return read_slice(self, sl, skip=skip, options=options, stream=stream, start=start, held=held)

    # -- side files -------------------------------------------------------------------------
    def side(self, ref: fmt.SideFile | None) -> SideArray | None:
        """A side file of the index as a SideArray (opened once per process)."""
        if ref is None or self.root is None:
            return None
        side = self._sides.get(ref.name)
        if side is None:
            side = SideArray.open(self.root, ref, retry=self.retry, cache=self.side_cache)
            self._sides[ref.name] = side
        return side

    def lengths(self) -> IndexLengths | None:
        """lengths.npy (every document's length, dataset order) as a checked, mapped side file;
        None without one."""
        if self._lengths is not None:
            return self._lengths
        if self.index is None or not self.index.lengths_file:
            return None
        side = self.side(self.index.lengths_file)
        if side is None:
            return None
        if side.count != self.index.documents:
            self._sides.pop(self.index.lengths_file.name)
            raise fmt.FormatError(
                f"{side.url} has {side.count} entries, the index counts {self.index.documents} documents"
            )
        self._lengths = IndexLengths(side, self.docs_per_shard, self._starts("documents"), self.positions is None)
        return self._lengths

    def shard(self, shard: int) -> ShardFacts:
        """What reading shard ``shard`` needs of its URL and the index (kept for the next reads)."""
        facts = self._facts.get(shard)
        if facts is not None:
            return facts
        url = self.urls[shard]
        entries = self.shard_entries
        entry = entries[shard] if entries is not None else None
        prev_doc = -1
        if self.mode == "packed" and entries is not None and shard > 0:
            prev_doc = int(make_id(shard - 1, entries[shard - 1].documents - 1))
        local = storage.local_path(url) if storage.scheme_of(url) == "file" else None
        items = None if entry is None else entry.rows if self.mode == "packed" else entry.documents
        facts = ShardFacts(url, entry, storage.is_remote(url), local, items, prev_doc)
        _keep(self._facts, shard, facts)
        return facts

    def expect(self) -> Expect:
        """What the index says every group must be (``read_checked`` asks at each read)."""
        if self._expect is None:
            self._expect = expect_of(self.index)
        return self._expect

    def group_table(self, shard: int) -> np.ndarray | None:
        """Where each group of shard ``shard`` starts (and, format 3, its size and checksum):
        [groups, columns] from groups.npy, or None without one."""
        rows = self.group_rows(shard)
        return None if rows is None else rows.array

    def group_rows(self, shard: int) -> GroupRows | None:
        """Shard ``shard``'s rows of groups.npy, or None without one. Only this shard's rows are
        read, checked against the index (their chunk of groups.npy by digest, then as a table), and
        kept for the next few reads of the shard."""
        table = self._tables.get(shard)
        if table is not None:
            return table
        info = self.index.groups_file if self.index is not None else None
        if not info or self.root is None:
            return None
        side = self.side(info)
        columns = self.index.group_columns
        if side.count != columns * self.index.samples:
            listed = side.count // columns
            raise fmt.FormatError(f"{side.url}: lists {listed} groups, index.json counts {self.index.samples}")
        first = int(self._starts("samples")[shard])
        facts = self.shard(shard)
        entry = facts.entry
        rows = side.read(columns * first, columns * (first + entry.samples)).astype(np.int64, copy=False)
        table = GroupRows(fmt.check_group_table(rows, entry, facts.items, side.url, columns))
        _keep(self._tables, shard, table)
        while len(self._tables) > 1 and sum(len(t) for t in self._tables.values()) > GROUP_ROWS_KEPT:
            self._tables.pop(next(iter(self._tables)))
        return table

    def fingerprint(self) -> str:
        """Identifies the shards' content; a resume state from other data is refused."""
        h = hashlib.sha256()
        if self.index is not None and self.index.shards_file is not None:
            # a binary table: its checksum covers every shard's sha256, positions say which
            h.update(f"{self.index.shards_file.sha256}|".encode())
            if self.positions is not None:
                h.update(np.ascontiguousarray(self.positions, np.int64).tobytes())
        elif self.shard_entries is not None:
            for e in self.shard_entries:
                h.update(f"{e.name}:{e.sha256}|".encode())
        else:
            for u in self.urls:
                h.update(f"{u}|".encode())
        return h.hexdigest()[:16]

    def reads_remote(self) -> bool:
        """Shards an index names sit under its root, so the root's scheme answers for all of
        them, at any shard count; shards the user listed are asked one by one."""
        if self.root is not None and not self.user_urls:
            return storage.is_remote(self.root)
        return any(storage.is_remote(u) for u in self.urls)

    def describe_for_mixture(self, name: str) -> fmt.Index:
        """The index, its shard table cut to the source's shards: what a mixture plans it from."""
        if self.index is None:
            raise MixtureError(f"mixture source {name!r} has no index.json: a mixture is planned from the indexes")
        if self.positions is None:
            return self.index
        shards = self.index.shards
        names = [shards.name(int(p)) for p in self.positions]
        return replace(self.index, shards=fmt.ShardTable(shards.columns[self.positions], names=names))

    def tokenizer_json(self) -> str:
        """The tokenizer.json the dataset carries (checked against the index's sha256)."""
        index, root = self.index, self.root
        if index is None or root is None:
            raise TokenizerError("a dataset without index.json names no tokenizer")
        text = fmt.read_tokenizer_json(root, index, retry=self.retry)
        if text is None:
            raise TokenizerError(
                f"{root} carries no {fmt.TOKENIZER_NAME} (it was packed before datasets stored their tokenizer): "
                f"load {index.tokenizer.source!r} yourself (sha256 {index.tokenizer.sha256[:16]}...)"
            )
        return text


def _keep(kept: dict, shard: int, value: Any) -> None:
    """``value`` kept for ``shard``, the oldest dropped beyond ``GROUP_TABLES_KEPT``."""
    if len(kept) >= GROUP_TABLES_KEPT:
        kept.pop(next(iter(kept)))
    kept[shard] = value


def _read_index(root: str, retry: storage.RetryPolicy | None = None) -> tuple[fmt.Index | None, str]:
    """(the index of ``root``, "") or (None, why there is none). One GET: a missing index is told
    from every other failure (403, exhausted retries, a malformed index), and those raise."""
    url = storage.join_url(root, fmt.INDEX_NAME)
    try:
        data = read_index_bytes(url, retry=retry)
    except storage.NotFoundError as exc:
        return None, exc.reason
    return fmt.read_index(root, retry=retry, data=data)[0], ""


def _looks_like_shards(source: str) -> bool:
    return (
        source.endswith((".tar", ".tgz", ".tar.gz"))
        or "{" in source
        or source.startswith("pipe:")
        or glob.has_magic(source)
    )


def _listed_path(path: str) -> str:
    """A path found on disk (a glob match, a directory entry) as a URL that is that path: a file
    named ``pipe:rm -rf x.tar`` or ``s3:`` must never read as a command or another scheme."""
    return path if storage.scheme_of(path) == "file" else os.path.join(".", path)


def _local_dir(url: str) -> str | None:
    """The local path of a plain path or ``file://`` URL; None for other schemes."""
    if storage.scheme_of(url) != "file":
        return None
    return storage.local_path(url) if url.startswith("file://") else url


def _expand(patterns: list[str]) -> list[str]:
    urls: list[str] = []
    for url in storage.expand_urls(patterns):
        local = _local_dir(url)
        if local is not None and glob.has_magic(local):
            found = sorted(glob.glob(local))
            if not found:
                raise storage.StorageError(f"{url}: no shard matches", url=url, reason="no shard matches")
            if url.startswith("file://"):
                urls.extend("file://" + quote(os.path.abspath(f)) for f in found)
            else:
                urls.extend(_listed_path(f) for f in found)
        else:
            urls.append(url)
    return urls


def open_packed(
    source: Any, *, index_for_shards: bool = True, retry: storage.RetryPolicy | None = None
) -> PackedSource:
    """A packed dataset: ``source`` is a dataset root (directory or URL holding index.json), the
    URL of an index.json, or shard URLs/patterns (a string or a list). For shard URLs, an
    index.json beside them is used when it lists every one of them, so the guarantees that need an
    index still hold. ``retry`` governs reading the index and ``lengths.npy``; a missing index, a
    403 or a 404 fail at once."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, (list, tuple)):
        return _from_shards(
            _expand([os.fspath(s) if isinstance(s, os.PathLike) else str(s) for s in source]), index_for_shards, retry
        )
    source = str(source)
    path = storage.split_query(source)[0]  # a query string (a SAS token) is not part of the name
    if path.endswith(fmt.INDEX_NAME) and not source.startswith("pipe:"):
        return _from_root(storage.dirname_url(source), retry)
    if _looks_like_shards(path):
        return _from_shards(_expand([source]), index_for_shards, retry)
    return _from_root(source, retry)


def _from_root(root: str, retry: storage.RetryPolicy | None = None) -> PackedSource:
    index_url = storage.join_url(root, fmt.INDEX_NAME)
    index, missing = _read_index(root, retry)
    if index is None:
        fmt.check_finished(root, retry=retry)
        local = _local_dir(root)
        if local is not None:
            if not os.path.isdir(local):
                raise storage.NotFoundError(f"{root}: no such directory", url=root, reason="no such directory")
            names = sorted(
                e.name
                for e in os.scandir(local)
                if e.name.endswith(".tar") and not e.name.startswith(".") and e.is_file()
            )
            if names:
                log.warning(
                    "%s has no index.json: reading %d shards without one (equal batches and exact counts are not "
                    "available)",
                    storage.redact(root),
                    len(names),
                )
                urls = [storage.join_url(root, n) for n in names]
                return PackedSource(urls=[_listed_path(u) for u in urls], user_urls=False, root=root, retry=retry)
        raise storage.NotFoundError(
            f"{index_url}: {missing}: {root} is not a dataset root (it holds no {fmt.INDEX_NAME}); pass shard "
            f"URLs or patterns (such as {root.rstrip('/')}/shard-{{000000..000009}}.tar) instead",
            url=index_url,
            reason=missing,
        )
    _note_unchecked(root, index)
    return PackedSource(urls=ShardUrls(root, index.shards), index=index, root=root, retry=retry)


_told_unchecked: set[str] = set()


def _note_unchecked(root: str, index: fmt.Index | None) -> None:
    """Say once per dataset that its content cannot be checked as it is read."""
    if (index is not None and index.checks_groups) or root in _told_unchecked:
        return
    _told_unchecked.add(root)
    what = "reading shards without an index" if index is None else f"format {index.version} has no group checksums"
    log.warning(
        "%s: %s: its content is not checked as it is read; `wdsllm verify` checks it whole", storage.redact(root), what
    )


def _from_shards(urls: list[str], index_for_shards: bool, retry: storage.RetryPolicy | None = None) -> PackedSource:
    if not urls:
        raise storage.StorageError("no shards given")
    source = PackedSource(urls=urls, user_urls=True, retry=retry)
    if not index_for_shards or any(u.startswith("pipe:") for u in urls):
        return source
    roots = {storage.dirname_url(u) for u in urls}
    if len(roots) != 1:
        return source
    root = roots.pop()
    try:
        index, _ = _read_index(root, retry)
    except (storage.StorageError, fmt.FormatError) as exc:
        log.warning("reading the shards without an index: the index beside them is unusable (%s)", exc)
        return source
    if index is None:
        return source
    positions = [index.shards.position(storage.split_query(u)[0].rstrip("/").rsplit("/", 1)[-1]) for u in urls]
    if any(p is None for p in positions):
        log.warning(
            "%s does not list every given shard; reading them without an index",
            storage.redact(storage.join_url(root, fmt.INDEX_NAME)),
        )
        return source
    source.index = index
    source.root = root
    source.positions = np.asarray(positions, np.int64)
    _note_unchecked(root, index)
    return source
