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
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import numpy as np

from .. import format as fmt
from .. import storage
from ..format.shard import shard_tables

log = logging.getLogger(__name__)


@dataclass
class Catalog:
    """The shards to read, in index order, and the index when there is one."""

    urls: list[str]
    index: fmt.Index | None = None
    root: str | None = None
    user_urls: bool = False  # urls typed by the user (pipe: allowed), not derived from an index
    shard_entries: list[fmt.ShardEntry] | None = None  # index entries of ``urls`` (same order)
    retry: storage.RetryPolicy | None = field(default=None, repr=False)  # for index and lengths reads
    _lengths: np.ndarray | None = field(default=None, repr=False)
    _by_shard: list | None = field(default=None, repr=False)
    _groups: list | None = field(default=None, repr=False)  # per shard: its rows of groups.npy

    @property
    def mode(self) -> str:
        return self.index.mode if self.index else "docs"

    @property
    def items_per_shard(self) -> list[int] | None:
        """Documents (docs mode) or rows (packed) per shard, when an index says so."""
        if self.shard_entries is None:
            return None
        return [e.rows if self.mode == "packed" else e.documents for e in self.shard_entries]

    @property
    def docs_per_shard(self) -> list[int] | None:
        return None if self.shard_entries is None else [e.documents for e in self.shard_entries]

    def __getstate__(self) -> dict:
        # Workers started by spawn get the catalog pickled: let them reload lengths.npy rather
        # than receive (and keep a copy of) every document's length in the message.
        state = dict(self.__dict__)
        state["_lengths"] = state["_by_shard"] = None
        state["_groups"] = None
        return state

    def lengths(self) -> np.ndarray | None:
        """Per-document token counts for the catalog's shards, in catalog order (docs mode)."""
        if self._lengths is not None:
            return self._lengths
        if self.index is None or not self.index.lengths_file or self.root is None:
            return None
        info = self.index.lengths_file
        all_lengths = fmt.read_side_file(self.root, info, retry=self.retry).astype(np.int64)
        counts = [e.documents for e in self.index.shards]
        if int(sum(counts)) != len(all_lengths):
            raise fmt.FormatError(
                f"{self.root}: {info.name} has {len(all_lengths)} entries, the index counts {sum(counts)} documents"
            )
        if self.shard_entries is not None and len(self.shard_entries) != len(self.index.shards):
            offsets = np.concatenate([[0], np.cumsum(counts)])
            position = {e.name: i for i, e in enumerate(self.index.shards)}
            parts = [all_lengths[offsets[position[e.name]] : offsets[position[e.name] + 1]] for e in self.shard_entries]
            all_lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        self._lengths = all_lengths
        return all_lengths

    def lengths_by_shard(self) -> list[np.ndarray] | None:
        """lengths() cut per shard (views, computed once: plans ask for it per slice)."""
        if self._by_shard is None:
            lengths = self.lengths()
            if lengths is None:
                return None
            counts = self.docs_per_shard
            self._by_shard = np.split(lengths, np.cumsum(counts)[:-1]) if counts else []
        return self._by_shard

    def group_table(self, shard: int) -> np.ndarray | None:
        """Where each group of shard ``shard`` starts (and, format 3, its size and checksum):
        [groups, columns] from groups.npy, or None without one. The file is read once, whole, and
        checked against its sha256 in the index (it is 40 bytes a group: about 1.5% of lengths.npy),
        because a reader seeks by it and checks every group's bytes against it."""
        if self._groups is None:
            self._groups = self._read_group_tables()
        return self._groups[shard] if self._groups else None

    def _read_group_tables(self) -> list:
        info = self.index.groups_file if self.index is not None else None
        if not info or self.root is None or self.shard_entries is None:
            return []
        url = storage.join_url(self.root, info.name)
        flat = fmt.read_side_file(self.root, info, retry=self.retry).astype(np.int64, copy=False)
        tables = shard_tables(self.index, flat, url)
        return [tables[entry.name] for entry in self.shard_entries]

    def fingerprint(self) -> str:
        """Identifies the shards' content; a resume state from other data is refused."""
        h = hashlib.sha256()
        if self.shard_entries is not None:
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
    return fmt.Index.from_json(data, url), ""


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


def open_catalog(source: Any, *, index_for_shards: bool = True, retry: storage.RetryPolicy | None = None) -> Catalog:
    """Resolve a source into a Catalog.

    ``source`` is a dataset root (directory or URL holding index.json), the URL of an index.json,
    or shard URLs/patterns (a string or a list). For shard URLs, an index.json beside them is used
    when it lists every one of them, so the guarantees that need an index still hold. ``retry``
    governs reading the index and ``lengths.npy``; a missing index, a 403 or a 404 fail at once.
    """
    if isinstance(source, Catalog):
        return source
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
    urls = [storage.join_url(root, e.name) for e in index.shards]
    _note_unchecked(root, index)
    return Catalog(urls=urls, index=index, root=root, shard_entries=list(index.shards), retry=retry)


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
    by_name = {e.name: e for e in index.shards}
    names = [storage.split_query(u)[0].rstrip("/").rsplit("/", 1)[-1] for u in urls]
    if not all(n in by_name for n in names):
        log.warning(
            "%s does not list every given shard; reading them without an index",
            storage.redact(storage.join_url(root, fmt.INDEX_NAME)),
        )
        return catalog
    catalog.index = index
    catalog.root = root
    catalog.shard_entries = [by_name[n] for n in names]
    _note_unchecked(root, index)
    return catalog
