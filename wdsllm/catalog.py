"""Resolving a source (dataset root, index URL, shard URLs or patterns) into shards + index.

The index is untrusted data when it comes from the network: its shard names are checked by
``format.check_shard_name`` and joined to the root by ``storage.join_url``, and ``pipe:`` is
allowed only for URLs the user typed.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from dataclasses import dataclass, field

import numpy as np

from . import format as fmt
from . import storage

log = logging.getLogger(__name__)


@dataclass
class Catalog:
    """The shards to read, in index order, and the index when there is one."""

    urls: list[str]
    index: fmt.Index | None = None
    root: str | None = None
    user_urls: bool = False  # urls typed by the user (pipe: allowed), not derived from an index
    shard_entries: list[fmt.ShardEntry] | None = None  # index entries of ``urls`` (same order)
    _lengths: np.ndarray | None = field(default=None, repr=False)

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

    @property
    def has_index(self) -> bool:
        return self.index is not None

    def lengths(self) -> np.ndarray | None:
        """Per-document token counts for the catalog's shards, in catalog order (docs mode)."""
        if self._lengths is not None:
            return self._lengths
        if self.index is None or not self.index.lengths_file or self.root is None:
            return None
        info = self.index.lengths_file
        data = storage.read_bytes(storage.join_url(self.root, fmt.check_shard_name(info["name"])))
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise fmt.FormatError(f"{self.root}: {info['name']} does not match the checksum in index.json")
        all_lengths = fmt.npy_array(data, info["name"]).astype(np.int64)
        counts = [e.documents for e in self.index.shards]
        if int(sum(counts)) != len(all_lengths):
            raise fmt.FormatError(f"{self.root}: {info['name']} has {len(all_lengths)} entries, the index counts {sum(counts)} documents")
        if self.shard_entries is not None and len(self.shard_entries) != len(self.index.shards):
            offsets = np.concatenate([[0], np.cumsum(counts)])
            position = {e.name: i for i, e in enumerate(self.index.shards)}
            parts = [all_lengths[offsets[position[e.name]] : offsets[position[e.name] + 1]] for e in self.shard_entries]
            all_lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        self._lengths = all_lengths
        return all_lengths

    def lengths_by_shard(self) -> list[np.ndarray] | None:
        lengths = self.lengths()
        if lengths is None:
            return None
        counts = self.docs_per_shard
        return np.split(lengths, np.cumsum(counts)[:-1]) if counts else []

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


def _read_index(root: str) -> fmt.Index | None:
    url = storage.join_url(root, fmt.INDEX_NAME)
    if not storage.exists(url):
        return None
    return fmt.Index.from_json(storage.read_bytes(url), url)


def _looks_like_shards(source: str) -> bool:
    return source.endswith((".tar", ".tgz", ".tar.gz")) or "{" in source or source.startswith("pipe:") or glob.has_magic(source)


def _expand(patterns: list[str]) -> list[str]:
    urls: list[str] = []
    for url in storage.expand_urls(patterns):
        if not storage.is_remote(url) and not url.startswith(("pipe:", "file:")) and glob.has_magic(url):
            found = sorted(glob.glob(url))
            if not found:
                raise storage.StorageError(f"{url}: no shard matches")
            urls.extend(found)
        else:
            urls.append(url)
    return urls


def open_catalog(source, *, index_for_shards: bool = True) -> Catalog:
    """Resolve a source into a Catalog.

    ``source`` is a dataset root (directory or URL holding index.json), the URL of an index.json,
    or shard URLs/patterns (a string or a list). For shard URLs, an index.json beside them is used
    when it lists every one of them, so the guarantees that need an index still hold.
    """
    if isinstance(source, Catalog):
        return source
    if isinstance(source, (list, tuple)):
        return _from_shards(_expand([str(s) for s in source]), index_for_shards)
    source = str(source)
    if source.endswith(fmt.INDEX_NAME):
        root = storage.dirname_url(source)
        return _from_root(root, required=True)
    if _looks_like_shards(source):
        return _from_shards(_expand([source]), index_for_shards)
    return _from_root(source, required=True)


def _from_root(root: str, required: bool) -> Catalog:
    index = _read_index(root)
    if index is None:
        if not storage.is_remote(root) and os.path.isdir(root):
            shards = sorted(glob.glob(os.path.join(root, "*.tar")))
            if shards:
                log.warning("%s has no index.json: reading %d shards without one (equal batches and exact counts are not available)", root, len(shards))
                return Catalog(urls=shards, user_urls=False, root=root)
        raise storage.StorageError(f"{root}: no {fmt.INDEX_NAME} here; pass shard URLs or patterns instead")
    urls = [storage.join_url(root, e.name) for e in index.shards]
    return Catalog(urls=urls, index=index, root=root, shard_entries=list(index.shards))


def _from_shards(urls: list[str], index_for_shards: bool) -> Catalog:
    if not urls:
        raise storage.StorageError("no shards given")
    catalog = Catalog(urls=urls, user_urls=True)
    if not index_for_shards or any(u.startswith("pipe:") for u in urls):
        return catalog
    roots = {storage.dirname_url(u) for u in urls}
    if len(roots) != 1:
        return catalog
    root = roots.pop()
    try:
        index = _read_index(root)
    except (storage.StorageError, fmt.FormatError) as exc:
        log.info("no usable index beside the shards (%s)", exc)
        return catalog
    if index is None:
        return catalog
    by_name = {e.name: e for e in index.shards}
    names = [u.rstrip("/").rsplit("/", 1)[-1] for u in urls]
    if not all(n in by_name for n in names):
        log.warning("%s does not list every given shard; reading them without an index", storage.join_url(root, fmt.INDEX_NAME))
        return catalog
    catalog.index = index
    catalog.root = root
    catalog.shard_entries = [by_name[n] for n in names]
    return catalog
