"""Names and sizes of remote objects: glob patterns expanded by listing the store, and one object's
size and version, for inputs read from object stores.

A store that can be listed gives its backend a ``list_objects(url, timeout)`` method (the
:class:`Lister` seam): every object under a prefix with its size and version. A glob is matched
here, on the listed names, the same way for every store (``*`` and ``?`` stay inside one path
segment, ``**`` crosses them, ``[...]`` is a character class), so the expansion is the same
whatever the client library's own glob does, and it is sorted, so that every task of a pack and
every run see the same list. http(s) servers cannot be listed: their files are named (brace
patterns are expanded before this, by the caller).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .backends import backend_for
from .retry import DEFAULT_RETRY, RetryPolicy, make_error, retrying
from .urls import split_query

_MAGIC = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class ObjectInfo:
    """A remote object: its URL, its size, and what identifies this version of it (an ETag, a
    GCS generation, a Hub commit, written as :mod:`.versions` says, the same for a listing and an
    answer); a resumed pack refuses inputs whose version changed, and reads pinned to it refuse
    any other version."""

    url: str
    size: int
    version: str = ""


class Lister(Protocol):
    """What a backend provides to be listed."""

    def list_objects(self, url: str, timeout: float) -> list[ObjectInfo]:
        """Every object whose URL starts with ``url`` (a "directory" ending in "/", or a prefix)."""
        ...


def has_magic(url: str) -> bool:
    """Whether the path of ``url`` holds glob characters (a query string does not count)."""
    return bool(_MAGIC.search(split_query(url)[0]))


def glob_regex(pattern: str) -> re.Pattern:
    """The regular expression a glob pattern stands for (on whole URLs, query string excluded)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 2)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def list_prefix(url: str, retry: RetryPolicy | None = None) -> list[ObjectInfo]:
    """Every object under ``url`` (a prefix), sorted by URL."""
    policy = retry or DEFAULT_RETRY
    backend = backend_for(url)
    lister = getattr(backend, "list_objects", None)
    if lister is None:
        raise make_error(
            url,
            "this store cannot be listed, so globs and directories cannot be expanded here; name the files "
            "(brace patterns such as part-{000..099}.parquet are expanded)",
        )
    found = retrying(url, policy, lambda: lister(url, policy.timeout))
    return sorted(found, key=lambda o: o.url)


def glob_objects(pattern: str, retry: RetryPolicy | None = None) -> list[ObjectInfo]:
    """The objects whose URLs match the glob ``pattern``, sorted by URL; the store is listed under
    the pattern's longest literal directory."""
    head, query = split_query(pattern)
    first = _MAGIC.search(head)
    prefix = head[: head.rfind("/", 0, first.start()) + 1] if first else head
    regex = glob_regex(head)
    listed = list_prefix(prefix + (f"?{query}" if query else ""), retry)
    return [o for o in listed if regex.match(split_query(o.url)[0])]


def stat_object(url: str, retry: RetryPolicy | None = None) -> ObjectInfo:
    """Size and version of one object, from the answer to a one-byte ranged read (so every store,
    http(s) included, answers it the same way). A missing object raises NotFoundError."""
    policy = retry or DEFAULT_RETRY
    backend = backend_for(url)

    def probe() -> ObjectInfo:
        body: Any = backend.open(url, 0, 1, policy.timeout, None)
        try:
            if body.total is None:
                raise make_error(url, "the store did not say the object's size (no Content-Range)")
            return ObjectInfo(url, int(body.total), body.etag or "")
        finally:
            body.close()

    return retrying(url, policy, probe)


def fsspec_objects(
    fs: Any, path: str, url_of: Callable[[str], str], version_of: Callable[[dict], str]
) -> list[ObjectInfo]:
    """The objects under the directory ``path`` ("bucket/prefix/") of an fsspec filesystem; ``url_of(path)``
    makes each one's URL, ``version_of(info)`` its version as the store's answers say it (:mod:`.versions`)."""
    fs.invalidate_cache()  # a listing must be fresh: another job may have written since
    prefix = path if path.endswith("/") else path + "/"
    try:
        found = fs.find(prefix.rstrip("/"), detail=True, withdirs=False)
    except FileNotFoundError:
        return []
    out = []
    for name, info in found.items():
        if not name.startswith(prefix) or info.get("type") == "directory":
            continue
        out.append(ObjectInfo(url_of(name), int(info.get("size") or 0), version_of(info)))
    return out
