"""Inputs in object stores (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``hf://``): patterns into
objects, and the streams the readers read them through.

A pattern is brace-expanded first; then a glob (``s3://b/raw/*.jsonl.zst``) or a directory (a URL
ending in ``/``) is expanded by listing the store (:mod:`wdsllm.storage.listing`), and a plain URL
is asked for its size. Objects are never downloaded whole before they are read: streamed inputs
(text, tars) are read as a stream of concurrent ranged GETs, and Parquet and Arrow through a
seekable file whose every read is a ranged read of the bytes pyarrow asks for (the footer, then
only the column chunks a row group needs). The storage layer retries every request and resumes a
broken stream at the byte where it broke, and keeps secrets out of every message.

Every read of a listed object is pinned to the version its listing gave (an ETag, a GCS
generation, a Hub commit: :mod:`wdsllm.storage.versions`), the version an epoch's plan, a count
sidecar and a saved state were made for: an object replaced while an epoch or a pack reads it,
even at the same size, is a named error, never a mix of two versions' documents.
"""

from __future__ import annotations

from typing import BinaryIO

from .. import storage
from ..errors import NotFoundError, SourceError
from ..storage.listing import ObjectInfo, glob_objects, has_magic, list_prefix, stat_object


def is_remote_input(path: str) -> bool:
    """Whether an input names an object in a store read over the network."""
    return "://" in path and storage.is_remote(path)


def name_of(path: str) -> str:
    """The part of an input's name that says its kind (a URL's query string, such as a SAS, dropped)."""
    return storage.split_query(path)[0]


def expand_remote(pattern: str, wanted) -> list[ObjectInfo]:
    """The objects a remote pattern names, in order (each glob's and directory's sorted by URL);
    ``wanted(url)`` says whether a listed object of a directory is an input (a known kind)."""
    found: list[ObjectInfo] = []
    for expanded in storage.expand_urls(pattern):
        if has_magic(expanded):
            found.extend(glob_objects(expanded))
        elif storage.split_query(expanded)[0].endswith("/"):
            found.extend(o for o in list_prefix(expanded) if wanted(o.url))
        else:
            try:
                found.append(stat_object(expanded))
            except NotFoundError:
                head, query = storage.split_query(expanded)
                under = _list_or_none(head + "/" + (f"?{query}" if query else ""))
                if not under:
                    raise SourceError(f"input not found: {storage.redact(expanded)}") from None
                found.extend(o for o in under if wanted(o.url))
    return found


def _list_or_none(url: str) -> list[ObjectInfo] | None:
    """The objects under a "directory" URL, or None where the store cannot be listed (http)."""
    try:
        return list_prefix(url)
    except storage.StorageError:
        return None


def open_remote_stream(url: str, size: int | None, version: str = "") -> BinaryIO:
    """The object's bytes from its start: concurrent ranged GETs when the size is known, each of
    the ``version`` listed, when there is one (another version is a named error)."""
    return storage.open_stream(url, expected_size=size or None, version=version or None)


def open_remote_seekable(url: str, size: int, version: str = "") -> BinaryIO:
    """A seekable file over the object; every read is one ranged read, of the ``version`` listed."""
    return storage.open_ranged(url, size, version=version or None)
