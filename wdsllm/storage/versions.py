"""What identifies one version of a remote object, written one way per store, and what a read
pinned to that version asks of the store.

A listing and an answer say an object's version in different words: S3-compatible stores list an
ETag with or without its quotes, GCS lists a generation where its answers carry
``x-goog-generation``, an http(s) server without ETags has only ``Last-Modified``, and a Hub file
is pinned by the commit its URL resolves to. Every version the storage layer hands out, in an
:class:`~wdsllm.storage.listing.ObjectInfo` or a body's ``etag``, is written here, so the version
a listing gave and the one an answer gives compare as plain strings:

- an entity tag (S3, Azure, http(s)): its header form, quoted (``"abc"``, weak ``W/"abc"``);
- a GCS generation: ``gen:N``;
- a Last-Modified date, where a server sends no ETag: ``modified:DATE``;
- a Hub commit: ``commit:SHA``.

A read given a version (``open_stream(..., version=...)``) sends it as a condition on every
request (S3 and Azure ``If-Match``, http(s) ``If-Match`` or ``If-Unmodified-Since``, GCS
``generation=``, the Hub's resolve URL at that commit) and checks every answer's version against
it: a store that ignores the condition (an emulator) is caught by the answer. Either way a
changed object is :func:`changed`, a permanent error that names the URL: never bytes of two
versions, never a retry.
"""

from __future__ import annotations

from ..errors import VersionChangedError
from .urls import redact

_GENERATION = "gen:"
_MODIFIED = "modified:"
_COMMIT = "commit:"


def entity_tag(value: object) -> str:
    """An ETag in its header form (quoted; ``W/`` kept), or "" where there is none."""
    text = str(value or "").strip()
    if not text:
        return ""
    weak = text[:2].upper() == "W/"
    bare = text[2:] if weak else text
    if not (len(bare) >= 2 and bare[0] == bare[-1] == '"'):
        bare = f'"{bare.strip(chr(34))}"'
    return f"W/{bare}" if weak else bare


def generation(value: object) -> str:
    """A GCS generation as a version, or "" where there is none."""
    text = str(value or "").strip()
    return f"{_GENERATION}{text}" if text else ""


def modified(value: object) -> str:
    """A Last-Modified date as a version (for servers that send no ETag), or ""."""
    text = str(value or "").strip()
    return f"{_MODIFIED}{text}" if text else ""


def commit(sha: str) -> str:
    """A Hub commit as a version."""
    return f"{_COMMIT}{sha}"


def strong_tag(version: str | None) -> str | None:
    """The ``If-Match`` value that pins ``version``: a strong entity tag, else None (a weak tag
    never matches ``If-Match``; other kinds of version are pinned otherwise)."""
    return version if version and version.startswith('"') else None


def pinned_generation(version: str | None) -> str | None:
    """The GCS generation ``version`` names, or None."""
    return version[len(_GENERATION) :] if version and version.startswith(_GENERATION) else None


def pinned_commit(version: str | None) -> str | None:
    """The Hub commit ``version`` names, or None."""
    return version[len(_COMMIT) :] if version and version.startswith(_COMMIT) else None


def http_conditions(version: str | None) -> dict[str, str]:
    """The headers that make an http(s) GET answer only the bytes of ``version`` (412 otherwise)."""
    tag = strong_tag(version)
    if tag:
        return {"If-Match": tag}
    if version and version.startswith(_MODIFIED):
        return {"If-Unmodified-Since": version[len(_MODIFIED) :]}
    return {}


def changed(url: str, expected: str, now: str | None) -> VersionChangedError:
    """The error for an object that is no longer the version a read expects (the one listed when
    the epoch or pack was planned, or the one its first answer was of). ``now``: the version the
    store answered with; None where it refused the condition (412), or the version is gone."""
    answer = f"the store now has {now}" if now else "the store refused it (replaced or deleted)"
    url = redact(url)
    reason = (
        f"changed during the epoch or pack that reads it: version {expected} was expected and {answer}; "
        "bytes of two versions are never mixed: start again from a fresh listing (and run `wdsllm count` "
        "again if it has a count sidecar)"
    )
    return VersionChangedError(f"{url}: {reason}", url=url, reason=reason)
