"""URLs: schemes, local paths, brace expansion, and joining names to a dataset root safely."""

from __future__ import annotations

import os
import re
from urllib.parse import quote, unquote, urlsplit

import braceexpand

from ..errors import StorageError
from .retry import make_error


def scheme_of(url: str) -> str:
    """'file' for local paths, else the lower-case scheme ('pipe' for ``pipe:CMD``)."""
    if url.startswith("pipe:"):
        return "pipe"
    head, sep, _ = url.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        return head.lower()
    return "file"


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


def join_url(base: str, name: str) -> str:
    """The URL of ``name`` inside the dataset root ``base`` (with or without a trailing slash).

    In http(s) and ``file://`` URLs the name is percent-encoded, so that it stays one literal
    name: a name such as ``%2e%2e%2fsecret`` from an untrusted index must not be decoded into a
    path that leaves the root (s3 keys and local paths are literal already).
    """
    check_name(name)
    scheme = scheme_of(base)
    if scheme == "pipe":
        raise make_error(base, "a pipe: URL has no directory to join names to")
    if scheme == "file" and not base.startswith("file://"):
        return os.path.join(base, name) if base else name
    if scheme != "s3":
        name = quote(name, safe="/")
    return base.rstrip("/") + "/" + name


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
    if url.endswith("/"):
        return url.rstrip("/")
    head, _, _ = url.rpartition("/")
    if head.endswith(":/"):  # "s3://bucket" has no parent inside the store
        return url
    return head
