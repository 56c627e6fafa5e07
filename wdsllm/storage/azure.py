"""az:// and abfs(s):// (Azure Blob Storage) through adlfs: ranged streaming GETs signed by the
blob SDK's own pipeline, and the Azure output (staged block uploads, server-side copies).

``az://container/path`` takes the account from the environment as adlfs does
(``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_NAME`` with
``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_SAS_TOKEN`` / a service principal's
``AZURE_CLIENT_ID``... / the managed identity through azure-identity's default chain);
``abfs://container@ACCOUNT.dfs.core.windows.net/path`` names it. A SAS token may also ride on the
URL's query string (``az://container/ds/?sv=...&sig=...``); it is carried to every object of the
dataset and redacted from every message. ``WDSLLM_ANONYMOUS=1`` (or ``=az``) reads public
containers. The SDK's retries (10 tries by default, minutes against an unreachable host) are off
on every call: :class:`~wdsllm.storage.retry.RetryPolicy` alone decides.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from . import versions
from .aio import LoopBody, environment_to_trust, instance, range_header, release_if_read, run, salvaging_reader
from .backends import EmptyBody, anonymous, parse_content_range, register
from .fsoutput import FsspecOutput
from .output import Output
from .retry import DEFAULT_RETRY, add_classifier, make_error, parse_retry_after
from .urls import split_query

_SCHEMES = ("az", "abfs", "abfss")
#: Bytes the SDK's transport reads from the socket at a time (its default, 4 KiB, costs CPU).
_BLOCK = 256 * 1024


def parse(url: str) -> tuple[str | None, str, str, str]:
    """(account or None, container, blob, SAS query) of an az:// or abfs(s):// URL."""
    head, sas = split_query(url)
    parts = urlsplit(head)
    netloc, account = parts.netloc, None
    if "@" in netloc:  # abfs://container@account.dfs.core.windows.net/path
        netloc, _, host = netloc.partition("@")
        account = host.split(".", 1)[0]
    container, blob = netloc, parts.path.lstrip("/")
    if not container:
        raise make_error(url, "Azure URL has no container (az://container/path)")
    return account, container, blob, sas


def _options(account: str | None, sas: str) -> dict[str, Any]:
    """adlfs options for an account (None: the environment's) and a SAS from the URL."""
    conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    fields = dict(f.split("=", 1) for f in conn.split(";") if "=" in f) if conn else {}
    endpoint = fields.get("BlobEndpoint")
    # the environment's connection string serves a URL that names its account (abfs://c@ACCOUNT...)
    own = account is None or account == fields.get("AccountName")
    opts: dict[str, Any] = {}
    if anonymous("az"):
        if endpoint and own:
            opts["connection_string"] = f"BlobEndpoint={endpoint};"
        else:
            opts.update(account_name=account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"), anon=True)
    elif sas:
        if endpoint and own:
            opts["connection_string"] = f"BlobEndpoint={endpoint};SharedAccessSignature={sas}"
        else:
            opts.update(account_name=account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"), sas_token=sas)
    elif account and not (conn and own):
        opts["account_name"] = account
    return opts


def filesystem(url: str, timeout: float = DEFAULT_RETRY.timeout) -> Any:
    account, _, _, sas = parse(url)
    opts = _options(account, sas)
    key = ("az", os.environ.get("AZURE_STORAGE_CONNECTION_STRING"), tuple(sorted(opts.items())), timeout)

    def make() -> Any:
        try:
            from adlfs import AzureBlobFileSystem
        except ImportError as exc:
            raise make_error(url, "az:// URLs need adlfs, which is not installed: pip install 'wdsllm[azure]'") from exc
        try:
            fs = AzureBlobFileSystem(skip_instance_cache=True, **opts)
        except ValueError as exc:  # adlfs: "Must provide either a connection_string or account_name ..."
            raise make_error(
                url,
                "no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME "
                "(with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, a service principal's AZURE_CLIENT_ID... "
                "or a managed identity), or name it in the URL: abfs://container@ACCOUNT.dfs.core.windows.net/path",
            ) from exc
        config = fs.service_client._config
        config.connection_data_block_size = _BLOCK
        config.retry_policy.total_retries = 0  # every call: RetryPolicy is the one retry loop
        transport = getattr(getattr(fs.service_client, "_pipeline", None), "_transport", None)
        if not environment_to_trust() and hasattr(transport, "_use_env_settings"):
            # azure-core's aiohttp session would look up proxies and netrc in a thread for every
            # request (aio.environment_to_trust); read when it opens its session, on first use
            transport._use_env_settings = False
        return fs

    return instance(key, make)


def credential_source(fs: Any) -> str:
    if getattr(fs, "anon", False):
        return "none: anonymous requests (WDSLLM_ANONYMOUS)"
    if getattr(fs, "connection_string", None):
        return "AZURE_STORAGE_CONNECTION_STRING"
    if getattr(fs, "sas_token", None):
        return "a SAS token"
    if getattr(fs, "account_key", None):
        return "the account key (AZURE_STORAGE_ACCOUNT_KEY)"
    return "azure-identity's default chain (environment, workload identity, managed identity, az CLI)"


def _error(url: str, exc: BaseException, fs: Any) -> BaseException:
    """Azure's exception as a named StorageError (with the credential source on 401/403)."""
    azure = sys.modules.get("azure.core.exceptions")
    if azure is None or not isinstance(exc, azure.AzureError):
        return exc
    kind = _classify_azure(exc)
    if kind is None:
        return exc
    transient, reason, after = kind
    status = getattr(exc, "status_code", None)
    if isinstance(exc, azure.ClientAuthenticationError) or status in (401, 403):
        reason = f"{reason}; credentials: {credential_source(fs)}"
    return make_error(url, reason, transient=transient, missing=status == 404, retry_after=after)


def _open(url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
    from azure.core.exceptions import HttpResponseError
    from azure.storage.blob._generated.models import ModifiedAccessConditions
    from azure.storage.blob._shared.response_handlers import process_storage_error

    fs = filesystem(url, timeout)
    _, container, blob, _ = parse(url)
    rng = range_header(start, end)
    tag = versions.strong_tag(etag)  # a pinned or resumed read: that version, or 412

    async def go() -> Any:
        # azure-storage-blob's download_blob() buffers whole chunks (the first one 32 MiB) and
        # retries a broken chunk on its own; the generated client under it answers one streaming
        # GET, signed by the same pipeline (its errors mapped by the SDK's own handler).
        client = fs.service_client.get_blob_client(container, blob)
        try:
            resp, stream = await client._client.blob.download(
                range=rng,
                modified_access_conditions=ModifiedAccessConditions(if_match=tag) if tag else None,
                retry_total=0,
                cls=lambda pipeline_response, data, headers: (pipeline_response.http_response, data),
            )
        except HttpResponseError as exc:
            if exc.status_code == 416:
                total = parse_content_range(url, exc.response.headers.get("Content-Range"))[1]
                if total is not None and start >= total:
                    return EmptyBody(total, etag)
            process_storage_error(exc)  # ResourceNotFoundError, ClientAuthenticationError, ...
        return resp, stream.__aiter__()

    try:
        answer = run(go, timeout=timeout + 5)
    except Exception as exc:
        if tag and getattr(exc, "status_code", None) == 412:
            raise versions.changed(url, tag, None) from exc
        raise _error(url, exc, fs) from exc
    if isinstance(answer, EmptyBody):
        return answer
    resp, chunks = answer
    if resp.status_code == 206:
        first, total = parse_content_range(url, resp.headers.get("Content-Range"))
        if first != start:
            raise make_error(url, f"asked for bytes from {start}, Azure sent from {first}")
    else:
        length = resp.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
    raw = getattr(getattr(chunks, "response", None), "internal_response", None)  # azure-core's aiohttp answer
    if raw is not None and hasattr(raw, "content") and not raw.headers.get("Content-Encoding"):
        # aiohttp's stream itself: bytes that arrived before a cut are handed over (azure-core's
        # iterator drops them with the error), and no chunk is copied on the way
        read = salvaging_reader(raw.content)
    else:
        read = _ChunkReader(chunks).read

    async def aclose() -> None:
        if not release_if_read(raw):
            await resp.close()

    return _AzureBody(url, fs, read, aclose, total, versions.entity_tag(resp.headers.get("ETag")) or None, timeout)


class _ChunkReader:
    """``read(n)`` over azure-core's chunk iterator (another transport than aiohttp)."""

    def __init__(self, chunks: Any) -> None:
        self.chunks = chunks
        self.pending = bytearray()

    async def read(self, n: int) -> bytes:
        while not self.pending:
            try:
                self.pending = bytearray(await self.chunks.__anext__())
            except StopAsyncIteration:
                return b""
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out


class _AzureBody(LoopBody):
    """A LoopBody whose failures are named Azure errors."""

    def __init__(self, url: str, fs: Any, *args: Any) -> None:
        super().__init__(*args)
        self._url, self._fs = url, fs

    def readinto(self, b: Any) -> int:
        try:
            return super().readinto(b)
        except Exception as exc:
            error = _error(self._url, exc, self._fs)
            if error is exc:
                raise
            raise error from exc


def _exists(url: str, timeout: float) -> bool:
    from azure.core.exceptions import ResourceNotFoundError

    fs = filesystem(url, timeout)
    _, container, blob, _ = parse(url)

    async def go() -> bool:
        client = fs.service_client.get_blob_client(container, blob)
        try:
            await client.get_blob_properties(retry_total=0)
        except ResourceNotFoundError:
            return False
        return True

    try:
        return run(go, timeout=timeout + 5)
    except Exception as exc:
        raise _error(url, exc, fs) from exc


def _classify_azure(exc: BaseException) -> tuple[bool, str, float | None] | None:
    azure = sys.modules.get("azure.core.exceptions")
    if azure is None or not isinstance(exc, azure.AzureError):
        return None
    if isinstance(exc, (azure.ServiceRequestError, azure.ServiceResponseError, azure.IncompleteReadError)):
        return True, f"{type(exc).__name__}: {_first_line(exc)}", None
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "error_code", None)
    reason = f"Azure {code or type(exc).__name__}" + (f" (HTTP {status})" if status else "")
    if isinstance(exc, azure.ResourceModifiedError):
        return False, f"{reason}: the blob changed during the read", None
    if status is None:
        return False, f"{reason}: {_first_line(exc)}", None
    transient = status in (408, 429) or status >= 500
    after = None
    if transient and getattr(exc, "response", None) is not None:
        after = parse_retry_after(exc.response.headers.get("Retry-After"))
    return transient, reason, after


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _is_missing(exc: BaseException) -> bool:
    azure = sys.modules.get("azure.core.exceptions")
    return azure is not None and isinstance(exc, azure.ResourceNotFoundError)


class AzureOutput(FsspecOutput):
    """``az://container/prefix/``: staged block uploads through adlfs."""

    def filesystem(self) -> Any:
        return filesystem(self.url, self.retry.timeout)

    def path_of(self, url: str) -> str:
        _, container, blob, _ = parse(url)
        return f"{container}/{blob}"

    def same_store(self, url: str) -> bool:
        if urlsplit(url).scheme not in _SCHEMES:
            return False
        return parse(url)[0] == parse(self.url)[0] and parse(url)[3] == parse(self.url)[3]

    def after_copy(self, path: str) -> None:
        """Azure copies asynchronously (adlfs does not wait): poll until the copy is done."""
        container, _, blob = path.partition("/")
        fs = self.filesystem()
        deadline = time.monotonic() + 3600

        async def status() -> tuple[str | None, str | None]:
            props = await fs.service_client.get_blob_client(container, blob).get_blob_properties(retry_total=0)
            return props.copy.status, props.copy.status_description

        while True:
            state, why = run(status, timeout=self.retry.timeout)
            if state in (None, "success"):
                return
            if state != "pending":
                raise make_error(self.url_of(blob.rsplit("/", 1)[-1]), f"server-side copy {state}: {why}")
            if time.monotonic() > deadline:
                raise make_error(self.url, f"server-side copy to {path} still pending after an hour")
            time.sleep(0.5)


def _listed_version(info: dict) -> str:
    return versions.entity_tag(info.get("etag"))


class AzureBackend:
    schemes = _SCHEMES
    remote = True

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return _open(url, start, end, timeout, etag)

    def exists(self, url: str, timeout: float) -> bool:
        return _exists(url, timeout)

    def list_objects(self, url: str, timeout: float) -> list:
        from .listing import fsspec_objects

        _, container, blob, sas = parse(url)
        head = split_query(url)[0]
        root = head[: len(head) - len(blob)]  # "az://container/" or "abfs://container@host/"
        query = f"?{sas}" if sas else ""  # a SAS rides on every object's URL, as on the root's

        def url_of(path: str) -> str:
            return root + path[len(container) + 1 :] + query

        return fsspec_objects(filesystem(url, timeout), f"{container}/{blob}", url_of, _listed_version)

    def output_class(self, url: str) -> type[Output]:
        return AzureOutput


add_classifier(_classify_azure, _is_missing)
register(AzureBackend())
