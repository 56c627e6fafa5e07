"""Resolving a source (dataset root, index URL, shard URLs or patterns) into shards + index.

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
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import numpy as np

from .. import format as fmt
from .. import storage
from ..format.side import SideArray

log = logging.getLogger(__name__)


class ShardUrls(Sequence):
    """The URLs of an index's shards, made when asked for: a dataset of a million shards never
    holds a million strings."""

    def __init__(self, root: str, table: fmt.ShardTable, positions: np.ndarray | None = None):
        self.root = root
        self.table = table
        self.positions = positions

    def __len__(self) -> int:
        return len(self.table) if self.positions is None else len(self.positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        p = i if self.positions is None else int(self.positions[i])
        return storage.join_url(self.root, self.table.name(p))

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


#: group tables kept checked per process (a few per shard being read; each is a few hundred bytes)
GROUP_TABLES_KEPT = 256


@dataclass
class Catalog:
    """The shards to read, in index order, and the index when there is one.

    Everything of dataset size stays out of Python objects: per-shard counts are int64 columns of
    the index's shard table, and lengths.npy and groups.npy are side files read in ranges
    (``format.side.SideArray``: memory-mapped, each range checked once per process), so opening a
    catalog costs the same for a thousand shards and for a million, and so does a worker.
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
        """One int64 count per catalog shard, from the index's shard table (cached)."""
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
        """Where each catalog shard's entries begin in a dataset-order file (documents in
        lengths.npy, groups in groups.npy): the index-wide running sum of ``name``."""
        key = f"start:{name}"
        if key not in self._columns:
            col = self.index.shards.column(name)
            starts = np.zeros(len(col) + 1, np.int64)
            np.cumsum(col, out=starts[1:])
            self._columns[key] = starts[:-1] if self.positions is None else starts[self.positions]
        return self._columns[key]

    # -- what a mixture (mixcatalog.MixtureCatalog) answers otherwise ----------------------------
    @property
    def mixing(self) -> Any:
        """How a shuffle block orders its items by source (``mixplan.Mixing``); None: one dataset."""
        return None

    def owner(self, shard: int) -> tuple[Catalog, int, int]:
        """(the catalog that reads shard ``shard``, its number there, the first shard it owns here)."""
        return self, shard, 0

    def default_plan(self, epoch: int) -> Any:
        """The ``counts.EpochPlan`` of every epoch (a mixture's); None: the normal plan."""
        return None

    def bind(self, cfg: Any, world: int) -> None:
        """Settle what depends on the loader's settings (a mixture's); nothing for one dataset."""

    def __getstate__(self) -> dict:
        # Workers started by spawn get the catalog pickled: side files travel as references and
        # are mapped again there; checked group tables are cheap to check again.
        state = dict(self.__dict__)
        state["_tables"] = {}
        state["_columns"] = {}
        return state

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

    def lengths_file(self) -> SideArray | None:
        """lengths.npy (every document's length, dataset order) as a checked, mapped side file."""
        if self.index is None or not self.index.lengths_file:
            return None
        known = self._sides.get(self.index.lengths_file.name)
        if known is not None:
            return known
        side = self.side(self.index.lengths_file)
        if side is not None and side.count != self.index.documents:
            self._sides.pop(self.index.lengths_file.name)
            raise fmt.FormatError(
                f"{side.url} has {side.count} entries, the index counts {self.index.documents} documents"
            )
        return side

    def shard_lengths(
        self, shard: int, start: int = 0, stop: int | None = None, *, check: bool = True
    ) -> np.ndarray | None:
        """Token counts of documents [start, stop) of catalog shard ``shard`` (int64, a copy);
        None without lengths.npy. ``check=False``: read now, checked later (``check_lengths``)."""
        side = self.lengths_file()
        if side is None:
            return None
        a, b = self.lengths_range(shard, start, stop)
        return side.read(a, b, check=check).astype(np.int64)

    def lengths_range(self, shard: int, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """Where documents [start, stop) of catalog shard ``shard`` are in lengths.npy."""
        n = int(self.docs_per_shard[shard])
        stop = n if stop is None else min(int(stop), n)
        base = int(self._starts("documents")[shard])
        return base + max(0, int(start)), base + stop

    def lengths_sums(
        self, shards: np.ndarray, starts: np.ndarray, stops: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, a, b): the sum of the lengths of documents [starts, stops) of each catalog
        shard in ``shards``, and where those are in lengths.npy, read now and checked later
        (``check_lengths``); one read per range, no Python object per document."""
        side = self.lengths_file()
        first = self.document_starts()[shards]
        a = first + np.asarray(starts, np.int64)
        b = first + np.asarray(stops, np.int64)
        return side.range_sums(a, b), a, b

    def document_starts(self) -> np.ndarray:
        """Where each catalog shard's documents begin in lengths.npy."""
        return self._starts("documents")

    def check_lengths(self, ranges: list[tuple[int, int]]) -> None:
        """Check ranges of lengths.npy read with ``check=False`` (each chunk once per process)."""
        side = self.lengths_file()
        for a, b in ranges:
            side.check_range(a, b)

    def lengths(self) -> np.ndarray | None:
        """Per-document token counts for the catalog's shards, in catalog order (docs mode): the
        uint32 map of lengths.npy itself when the catalog is the whole index (never widened, never
        copied: processes share its pages), else the catalog's shards' parts joined."""
        side = self.lengths_file()
        if side is None:
            return None
        if self.positions is None:
            return side.array()
        parts = [self.shard_lengths(i).astype(np.uint32) for i in range(len(self.positions))]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)

    def group_table(self, shard: int) -> np.ndarray | None:
        """Where each group of shard ``shard`` starts (and, format 3, its size and checksum):
        [groups, columns] from groups.npy, or None without one. Only this shard's rows are read,
        checked against the index (their chunk of groups.npy by digest, then as a table), and kept
        for the next few reads of the shard."""
        table = self._tables.get(shard)
        if table is not None:
            return table
        info = self.index.groups_file if self.index is not None else None
        if not info or self.root is None:
            return None
        side = self.side(info)
        columns = self.index.group_columns
        samples = self.index.shards.column("samples")
        if side.count != columns * int(samples.sum()):
            listed = side.count // columns
            raise fmt.FormatError(f"{side.url}: lists {listed} groups, index.json counts {int(samples.sum())}")
        first = int(self._starts("samples")[shard])
        entry = self.shard_entries[shard]
        rows = side.read(columns * first, columns * (first + entry.samples)).astype(np.int64, copy=False)
        items = entry.rows if self.mode == "packed" else entry.documents
        table = fmt.check_group_table(rows, entry, items, side.url, columns)
        if len(self._tables) >= GROUP_TABLES_KEPT:
            self._tables.pop(next(iter(self._tables)))
        self._tables[shard] = table
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


def _read_index(root: str, retry: storage.RetryPolicy | None = None) -> tuple[fmt.Index | None, str]:
    """(the index of ``root``, "") or (None, why there is none). One GET: a missing index is told
    from every other failure (403, exhausted retries, a malformed index), and those raise."""
    url = storage.join_url(root, fmt.INDEX_NAME)
    try:
        data = storage.read_bytes(url, retry=retry)
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


def open_catalog(
    source: Any, *, index_for_shards: bool = True, retry: storage.RetryPolicy | None = None, on_error: str = "raise"
) -> Catalog:
    """Resolve a source into a Catalog.

    A ``Mixture``, or the path or URL of a mixture file (``.yaml``/``.yml``), becomes a
    ``mixcatalog.MixtureCatalog``. Otherwise ``source`` is a dataset root (directory or URL
    holding index.json), the URL of an index.json, or shard URLs/patterns (a string or a list).
    For shard URLs, an index.json beside them is used when it lists every one of them, so the
    guarantees that need an index still hold. ``retry`` governs reading the index and
    ``lengths.npy``; a missing index, a 403 or a 404 fail at once. ``on_error`` is the loader's:
    a mixture's raw-text sources parse with it unless they set their own.
    """
    if isinstance(source, Catalog):
        return source
    from .mixture import is_mixture_source  # mixtures are catalogs of catalogs (mixcatalog imports this module)

    if is_mixture_source(source):
        from .mixcatalog import open_mixture

        return open_mixture(source, retry=retry, on_error=on_error)
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


def _from_root(root: str, retry: storage.RetryPolicy | None = None) -> Catalog:
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
                return Catalog(urls=[_listed_path(u) for u in urls], user_urls=False, root=root, retry=retry)
        raise storage.NotFoundError(
            f"{index_url}: {missing}: {root} is not a dataset root (it holds no {fmt.INDEX_NAME}); pass shard "
            f"URLs or patterns (such as {root.rstrip('/')}/shard-{{000000..000009}}.tar) instead",
            url=index_url,
            reason=missing,
        )
    _note_unchecked(root, index)
    return Catalog(urls=ShardUrls(root, index.shards), index=index, root=root, retry=retry)


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


def _from_shards(urls: list[str], index_for_shards: bool, retry: storage.RetryPolicy | None = None) -> Catalog:
    if not urls:
        raise storage.StorageError("no shards given")
    catalog = Catalog(urls=urls, user_urls=True, retry=retry)
    if not index_for_shards or any(u.startswith("pipe:") for u in urls):
        return catalog
    roots = {storage.dirname_url(u) for u in urls}
    if len(roots) != 1:
        return catalog
    root = roots.pop()
    try:
        index, _ = _read_index(root, retry)
    except (storage.StorageError, fmt.FormatError) as exc:
        log.warning("reading the shards without an index: the index beside them is unusable (%s)", exc)
        return catalog
    if index is None:
        return catalog
    positions = [index.shards.position(storage.split_query(u)[0].rstrip("/").rsplit("/", 1)[-1]) for u in urls]
    if any(p is None for p in positions):
        log.warning(
            "%s does not list every given shard; reading them without an index",
            storage.redact(storage.join_url(root, fmt.INDEX_NAME)),
        )
        return catalog
    catalog.index = index
    catalog.root = root
    catalog.positions = np.asarray(positions, np.int64)
    _note_unchecked(root, index)
    return catalog
