"""gs:// (Google Cloud Storage) through gcsfs: ranged media GETs on its authorised aiohttp session,
and the GCS output (resumable uploads, server-side ``rewriteTo`` copies).

Credentials come from google-auth's chain (``GOOGLE_APPLICATION_CREDENTIALS``, the gcloud ADC file,
the metadata server), so an environment set up for ``gcloud`` needs nothing more. The search runs
once per run: processes forked from the one that searched (the fetch process, DataLoader workers)
take what it found. ``STORAGE_EMULATOR_HOST`` points it at an emulator. ``WDSLLM_ANONYMOUS=1``
(or ``=gs``) reads public buckets without credentials. gcsfs on its own falls back to anonymous
access silently when it finds no credentials; a permission failure then says so.

A read pinned to a version (one listed, or the one a resumed read began on) asks for its
generation: GCS serves exactly that version or 404, never a splice of two versions. Emulators
ignore ``generation=``; the generation each answer reports is checked instead (:mod:`.versions`).
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from typing import Any

from ..errors import NotFoundError, StorageError
from . import versions
from .aio import aiohttp_open, environment_to_trust, instance, range_header, run
from .backends import anonymous, register
from .fsoutput import FsspecOutput, bucket_path
from .output import Output
from .retry import DEFAULT_RETRY, make_error
from .state import carry, own, picklable
from .urls import scheme_of, split_query

_SCHEMES = ("gs", "gcs")

log = logging.getLogger(__name__)


#: What google-auth's credential search reads besides the key file: a change to any of them
#: searches again.
_SEARCH_ENV = (
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "CLOUDSDK_CONFIG",
    "GOOGLE_CLOUD_PROJECT",
    "NO_GCE_CHECK",
    "GCE_METADATA_HOST",
    "GCE_METADATA_IP",
)


class Credentials:
    """What the credential search found in this process, by filesystem key: (method, credentials,
    project). A forked child (a DataLoader worker) inherits it and starts from there: off Google
    Cloud and without credentials the search waits for the metadata server in every process."""

    def __init__(self) -> None:
        self.found: dict[tuple, tuple[str, Any, str]] = {}

    def reset(self) -> None:
        self.found = {}

    def after_fork(self) -> None:
        """Kept: what the parent found is the child's too."""

    def export(self) -> dict[tuple, tuple[str, Any, str]]:
        return {key: found for key, found in self.found.items() if picklable(found)}

    def adopt(self, snapshot: dict[tuple, tuple[str, Any, str]]) -> None:
        self.found.update(snapshot)


CREDENTIALS = carry("gcs credentials", own("gcs credentials", Credentials()))


def filesystem(timeout: float = DEFAULT_RETRY.timeout, url: str = "gs://") -> Any:
    anon = anonymous("gs")
    key = ("gs", tuple(os.environ.get(v) for v in _SEARCH_ENV), anon)

    def make() -> Any:
        try:
            from gcsfs.core import GCSFileSystem
        except ImportError as exc:
            raise make_error(url, "gs:// URLs need gcsfs, which is not installed: pip install 'wdsllm[gcs]'") from exc
        method, credentials, project = CREDENTIALS.found.get(key, (None, None, ""))
        if anon:
            token: Any = "anon"
        elif method is not None:  # found by this process or the one it was forked from
            token = "anon" if method == "anon" else credentials
        else:
            token = None  # google-auth's search: key file, gcloud's ADC file, the metadata server
        started = time.monotonic()
        fs = GCSFileSystem(
            token=token,
            **({"project": project} if project else {}),  # else gcsfs's own (GCSFS_DEFAULT_PROJECT)
            session_kwargs={"trust_env": environment_to_trust()},  # HTTP(S)_PROXY / NO_PROXY, where set
            skip_instance_cache=True,
        )
        if method is None:
            CREDENTIALS.found[key] = (fs.credentials.method, fs.credentials.credentials, fs.credentials.project or "")
            searched = time.monotonic() - started
            if fs.credentials.method == "anon" and searched > 2:
                log.warning(
                    "gs://: no Google credentials found (the search, the metadata server's included, took %.0f s); "
                    "requests are anonymous. WDSLLM_ANONYMOUS=gs or NO_GCE_CHECK=true skips the search",
                    searched,
                )
        else:
            fs.credentials.method = method  # what credential_source reports (gcsfs says None for a given one)
        return fs

    return instance(key, make)


def gs_path(url: str) -> str:
    return bucket_path(url, len(scheme_of(url)) + 3)


def credential_source(fs: Any) -> str:
    method = getattr(getattr(fs, "credentials", None), "method", None)
    if anonymous("gs"):
        return "none: anonymous requests (WDSLLM_ANONYMOUS)"
    if method == "anon":
        return (
            "none found (tried GOOGLE_APPLICATION_CREDENTIALS, the gcloud ADC file and the metadata server), so "
            "the request was anonymous"
        )
    return f"google-auth's {method!r} source"


def _explained(url: str, exc: StorageError, fs: Any) -> StorageError:
    if exc.reason.startswith(("HTTP 401", "HTTP 403")):
        error = make_error(url, f"{exc.reason}; credentials: {credential_source(fs)}")
        error.__cause__ = exc
        return error
    return exc


def _open(url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
    fs = filesystem(timeout, url)
    bucket, key, generation = fs.split_path(gs_path(url))
    pinned = versions.pinned_generation(etag) or generation
    headers: dict[str, str] = {"Accept-Encoding": "identity"}
    rng = range_header(start, end)
    if rng:
        headers["Range"] = rng

    async def go() -> Any:
        await fs._set_session()
        target = fs.url(f"{bucket}/{key}", generation=pinned) if pinned else fs.url(f"{bucket}/{key}")
        resp, body = await aiohttp_open(fs.session, target, url, start, end, fs._get_headers(headers), timeout)
        gen = resp.headers.get("x-goog-generation")
        if gen is None:  # emulators send no generation (and ignore generation=): ask the metadata,
            # with one request (gcsfs's _info also lists the prefix, and may answer from its cache)
            gen = (await fs._call("GET", "b/{}/o/{}", bucket, key, json_out=True)).get("generation")
        body.etag = versions.generation(gen) or None
        return body

    try:
        return run(go, timeout=timeout + 5)
    except NotFoundError as exc:
        if etag and pinned:  # that generation is gone: the object was replaced or deleted
            raise versions.changed(url, etag, None) from exc
        raise
    except StorageError as exc:
        raise _explained(url, exc, fs) from exc.__cause__


def _exists(url: str, timeout: float) -> bool:
    fs = filesystem(timeout, url)

    async def go() -> bool:
        try:
            await fs._info(gs_path(url))
        except FileNotFoundError:
            return False
        return True

    return run(go, timeout=timeout + 5)


class GcsOutput(FsspecOutput):
    """``gs://bucket/prefix/``: resumable uploads through gcsfs."""

    def filesystem(self) -> Any:
        return filesystem(self.retry.timeout, self.url)

    def path_of(self, url: str) -> str:
        return gs_path(url)

    def same_store(self, url: str) -> bool:
        return scheme_of(url) in _SCHEMES and not split_query(url)[1]


def _gs_url(scheme: str, path: str) -> str:
    return f"{scheme}://{path}"


def _listed_version(info: dict) -> str:
    return versions.generation(info.get("generation"))


class GcsBackend:
    schemes = _SCHEMES
    remote = True

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return _open(url, start, end, timeout, etag)

    def exists(self, url: str, timeout: float) -> bool:
        return _exists(url, timeout)

    def list_objects(self, url: str, timeout: float) -> list:
        from .listing import fsspec_objects

        fs, scheme = filesystem(timeout, url), scheme_of(url)
        return fsspec_objects(fs, gs_path(url), partial(_gs_url, scheme), _listed_version)

    def output_class(self, url: str) -> type[Output]:
        return GcsOutput


register(GcsBackend())
