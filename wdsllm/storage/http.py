"""http(s)://: ranged GETs through fsspec's HTTP filesystem (aiohttp), read only.

The aiohttp session of ``fsspec.implementations.http.HTTPFileSystem`` answers each request
(keep-alive pool, redirects, TLS, and ``HTTP(S)_PROXY`` / ``NO_PROXY`` with ``trust_env``); this
module turns the answer into a streaming body. Userinfo in a URL (``https://user:pw@host/ds/``)
is sent as HTTP basic auth and never as part of the URL, so it reaches no log or message. The hf
backend reads the Hub's file URLs through :func:`open_url` with a bearer token.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Any

from . import versions
from .aio import aiohttp_open, client_timeout, environment_to_trust, instance, range_header, run, status_error
from .backends import EmptyBody, discard, register
from .counters import count
from .retry import make_error
from .urls import redact, split_userinfo

log = logging.getLogger(__name__)

USER_AGENT = "wdsllm-storage/2"


def filesystem() -> Any:
    """This process's HTTP filesystem; ``trust_env`` makes aiohttp honour the proxy variables and
    netrc, where there are any (:func:`~wdsllm.storage.aio.environment_to_trust`)."""

    def make() -> Any:
        from fsspec.implementations.http import HTTPFileSystem

        trust = environment_to_trust()
        return HTTPFileSystem(skip_instance_cache=True, client_kwargs={"trust_env": trust, "auto_decompress": False})

    return instance("http", make)


async def _session() -> Any:
    return await filesystem().set_session()


def _request(url: str, headers: dict[str, str] | None) -> tuple[str, dict[str, str]]:
    """(the URL to send, headers): userinfo becomes an Authorization header."""
    target, auth = split_userinfo(url)
    hdrs = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **(headers or {})}
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        hdrs["Authorization"] = f"Basic {token}"
    return target, hdrs


def open_url(
    url: str,
    start: int,
    end: int | None,
    timeout: float,
    etag: str | None = None,
    headers: dict[str, str] | None = None,
    shown: str | None = None,
    redirected: Callable[[str], None] | None = None,
) -> Any:
    """Bytes ``[start, end)`` of an http(s) URL as a streaming body. ``shown``: the URL messages
    name; ``redirected`` is called with the final URL when the answer came after redirects;
    ``etag``: the version (:mod:`.versions`) the answer must be of (``If-Match`` with a strong
    ETag, ``If-Unmodified-Since`` with a Last-Modified date)."""
    shown = shown or url
    target, hdrs = _request(url, headers)
    rng = range_header(start, end)
    if rng:
        hdrs["Range"] = rng
    hdrs.update(versions.http_conditions(etag))

    async def go() -> Any:
        return await aiohttp_open(await _session(), target, shown, start, end, hdrs, timeout, pinned=etag)

    resp, body = run(go, timeout=timeout + 5)
    if redirected is not None and resp.history:
        redirected(str(resp.url))
    if resp.status == 200 and start > 0:
        log.warning("%s: server ignored Range and sent the whole object; skipping %d bytes", redact(shown), start)
        if body.total is not None and start >= body.total:
            body.close()
            return EmptyBody(body.total, body.etag)
        try:
            discard(shown, body, start)
        except BaseException:
            body.close()
            raise
        count("skipped_bytes", start)
    return body


def head(url: str, timeout: float, headers: dict[str, str] | None = None, shown: str | None = None) -> bool:
    """Whether ``url`` exists (HEAD, redirects followed); 404/410 is False, other failures raise."""
    shown = shown or url
    target, hdrs = _request(url, headers)

    async def go() -> Any:
        session = await _session()
        resp = await session.head(target, headers=hdrs, allow_redirects=True, timeout=client_timeout(timeout))
        try:
            if 200 <= resp.status < 300:
                return True
            if resp.status in (404, 410):
                return False
            raise await status_error(shown, resp)
        finally:
            resp.release()

    return run(go, timeout=timeout + 5)


class HttpBackend:
    schemes = ("http", "https")
    remote = True

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return open_url(url, start, end, timeout, etag)

    def exists(self, url: str, timeout: float) -> bool:
        return head(url, timeout)

    def output_class(self, url: str) -> Any:
        raise make_error(
            url, "datasets cannot be written over http(s); write to a local directory, s3://, gs:// or az://"
        )


register(HttpBackend())
