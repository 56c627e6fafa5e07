"""URLs: schemes, local paths, brace expansion, joining names to a dataset root safely, and keeping
secrets out of messages.

A URL may carry secrets: a password in its userinfo (``https://user:pa55@host/ds/``) or a token in
its query string (an Azure SAS, a signed CDN URL). :func:`redact` removes both from a URL and
:func:`redact_text` from any text that embeds URLs; every message, log line and error that names a
URL goes through them. A query string on a root is part of how that root is reached, so
:func:`join_url` and :func:`dirname_url` carry it to every object URL made from the root.
"""

from __future__ import annotations

import os
import re
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import braceexpand

from ..errors import StorageError
from ..redact import redact, redact_text

__all__ = ["redact", "redact_text"]  # re-exported: storage's callers name them here


def scheme_of(url: str) -> str:
    """'file' for local paths, else the lower-case scheme ('pipe' for ``pipe:CMD``)."""
    if url.startswith("pipe:"):
        return "pipe"
    head, sep, _ = url.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        return head.lower()
    return "file"


def split_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """(the URL without userinfo, (user, password) or None): userinfo becomes basic auth, never
    part of a request line or a message."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)), (unquote(user), unquote(password))


def split_query(url: str) -> tuple[str, str]:
    """(the URL without its query string, the query string without "?")."""
    if scheme_of(url) in ("file", "pipe") and not url.startswith("file://"):
        return url, ""
    head, _sep, query = url.partition("?")
    return head, query


def _with_query(url: str, query: str) -> str:
    return f"{url}?{query}" if query else url


def make_error(url: str, reason: str) -> StorageError:
    from .retry import make_error as make  # retry.py imports this module for redact()

    return make(url, reason)


def local_path(url: str) -> str:
    if url.startswith("file://"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise make_error(url, f"file URL names host {parts.netloc!r}; only local files are supported")
        return unquote(parts.path)
    return url


def expand_urls(patterns: str | list[str]) -> list[str]:
    """Brace-expand each pattern (``shard-{000000..000009}.tar``), keeping order and duplicates."""
    if isinstance(patterns, str):
        patterns = [patterns]
    urls: list[str] = []
    for pattern in patterns:
        urls.extend(braceexpand.braceexpand(pattern))
    return urls


def check_name(name: str) -> str:
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(p in ("", ".", "..") for p in parts)
        or any(ord(c) < 32 for c in name)
    ):
        raise StorageError(f"{name!r}: not a plain relative name", reason="not a plain relative name")
    return name


#: Schemes whose object names are literal keys (no percent-decoding on the way to the store).
_LITERAL_KEYS = ("s3", "gs", "gcs", "az", "abfs", "abfss")


def join_url(base: str, name: str) -> str:
    """The URL of ``name`` inside the dataset root ``base`` (with or without a trailing slash).

    In http(s), hf and ``file://`` URLs the name is percent-encoded, so that it stays one literal
    name: a name such as ``%2e%2e%2fsecret`` from an untrusted index must not be decoded into a
    path that leaves the root (object-store keys and local paths are literal already). A query
    string on the base (a SAS token, a signed URL) is carried to the joined URL.
    """
    check_name(name)
    scheme = scheme_of(base)
    if scheme == "pipe":
        raise make_error(base, "a pipe: URL has no directory to join names to")
    if scheme == "file" and not base.startswith("file://"):
        return os.path.join(base, name) if base else name
    base, query = split_query(base)
    if scheme not in _LITERAL_KEYS:
        name = quote(name, safe="/")
    return _with_query(base.rstrip("/") + "/" + name, query)


def dirname_url(url: str) -> str:
    """The dataset root of ``.../index.json`` or ``.../shard-000001.tar``; a root given with a
    trailing slash comes back without it."""
    scheme = scheme_of(url)
    if scheme == "pipe":
        raise make_error(url, "a pipe: URL has no directory")
    if scheme == "file" and not url.startswith("file://"):
        if url.endswith("/"):
            return url.rstrip("/") or "/"
        return os.path.dirname(url) or "."
    url, query = split_query(url)
    if url.endswith("/"):
        return _with_query(url.rstrip("/"), query)
    head, _, _ = url.rpartition("/")
    if head.endswith(":/"):  # "s3://bucket" has no parent inside the store
        return _with_query(url, query)
    return _with_query(head, query)
