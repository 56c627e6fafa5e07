"""s3:// (and S3-compatible endpoints) through s3fs: ranged GETs with its aiobotocore client, and
the S3 output (multipart uploads, server-side copy).

Credentials, region and endpoint come from botocore's own chain (``AWS_PROFILE``, the
``AWS_ACCESS_KEY_ID`` family, ``~/.aws``, SSO, container and instance roles, ``AWS_ENDPOINT_URL``
/ ``AWS_ENDPOINT_URL_S3``), so an environment set up for the ``aws`` CLI needs nothing more.
``WDSLLM_ANONYMOUS=1`` (or ``=s3``) sends unsigned requests, for public buckets. botocore's and
s3fs's retries are off: :class:`~wdsllm.storage.retry.RetryPolicy` alone decides.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime, timezone
from typing import Any

from . import versions
from .aio import LoopBody, instance, process_key, range_header, release_if_read, run, salvaging_reader
from .backends import EmptyBody, anonymous, discard, on_prepare_workers, parse_content_range, register
from .counters import count
from .fsoutput import FsspecOutput, bucket_path
from .output import Output
from .retry import DEFAULT_RETRY, add_classifier, classification, make_error, parse_retry_after
from .state import own
from .urls import split_query

log = logging.getLogger(__name__)

#: Files of at least this size go to S3 as multipart uploads, in parts of half of it (at least
#: 5 MiB, S3's smallest part). ``WDSLLM_S3_MULTIPART_THRESHOLD`` (bytes) overrides it, e.g. for
#: tests that run ``wdsllm pack`` in a subprocess.
MULTIPART_THRESHOLD = int(os.environ.get("WDSLLM_S3_MULTIPART_THRESHOLD") or 64 * 2**20)
_MIN_PART = 5 * 2**20
_S3_MISSING = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_S3_AUTH = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "ExpiredToken", "InvalidToken"}
_S3_PERMANENT = {*_S3_MISSING, *_S3_AUTH, "PreconditionFailed", "InvalidBucketName"}
_S3_TRANSIENT = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "429",
}


def s3_endpoint() -> str | None:
    """The S3-compatible endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, if set."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Clients:
    """What this process knows of its S3 clients, by filesystem key.

    ``made``: the filesystems made here (key -> endpoint, anonymity, timeout); ``prepared``:
    sessions holding a built, never-entered client, for forked children to enter (they stay across
    a fork: that is what they are for); ``models``: botocore's parsed service models (plain data,
    kept across a fork, see :func:`_session`).
    """

    def __init__(self) -> None:
        self.made: dict[Any, tuple[str | None, bool, float]] = {}
        self.prepared: dict[Any, Any] = {}
        self.models: Any = None

    def reset(self) -> None:
        self.made, self.prepared = {}, {}

    def after_fork(self) -> None:
        self.made = {}  # the parent's filesystems are not this process's (aio drops them)


CLIENTS = own("s3 clients", S3Clients())
_session_class: Any = None


def _session() -> Any:
    """A new aiobotocore session that shares this process's parsed service models.

    Sessions and clients are per process (credentials refresh under locks, connections are
    sockets), but the models are plain data: a DataLoader worker forked from a process that has
    used S3 then makes its client without parsing botocore's S3 model again (about a second).
    """
    session = _prepared_session_class()()
    if CLIENTS.models is None:
        CLIENTS.models = session.get_component("data_loader")
    else:
        session.register_component("data_loader", CLIENTS.models)
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
    return session


_RFC7231 = "%a, %d %b %Y %H:%M:%S GMT"


def parse_timestamp(value: Any) -> datetime:
    """botocore's timestamp parser, quick for the two forms S3 sends.

    botocore hands every timestamp to dateutil's general parser, which costs many times the CPU of
    a direct parse, for each ``Last-Modified`` header (one per GET) and each object of a listing
    (1,000 per page). The forms S3 uses, the HTTP date of its headers and ISO 8601 with a zone in its XML, are
    parsed here directly; anything else (another locale's day names included) goes to botocore's
    parser, so the result is the same datetime.
    """
    if isinstance(value, str):
        try:
            if value.endswith(" GMT"):
                return datetime.strptime(value, _RFC7231).replace(tzinfo=timezone.utc)
            parsed = datetime.fromisoformat(value)
            if parsed.tzinfo is not None:
                return parsed
        except ValueError:
            pass
    from botocore.utils import parse_timestamp as botocore_parse

    return botocore_parse(value)


def _prepared_session_class() -> Any:
    """An AioSession whose next ``create_client`` may hand out a client built in advance.

    Building an S3 client (the session's event handlers, credentials from the chain, the client
    class, the endpoint rules) costs CPU (docs/remote.md, "Workers and clients"), and each
    DataLoader worker of each epoch would pay it again. :func:`prepare_workers` builds one in the
    process about to fork, without entering it: until ``__aenter__`` it has no aiohttp session,
    socket or event loop, so each forked child enters its own copy on its own loop. It is handed
    out only for exactly the arguments it was built with (s3fs's, see :func:`_client_args`).
    """
    global _session_class
    if _session_class is None:
        from aiobotocore.session import AioSession, ClientCreatorContext

        class PreparedSession(AioSession):
            prepared: tuple[Any, Any] | None = None  # (the create_client arguments, the client)

            def create_client(self, *args: Any, **kwargs: Any) -> Any:
                prepared, self.prepared = self.prepared, None
                if prepared is not None and prepared[0] == _signature(args, kwargs):
                    client = prepared[1]

                    async def ready() -> Any:
                        return client

                    return ClientCreatorContext(ready())
                return super().create_client(*args, **kwargs)

        _session_class = PreparedSession
    return _session_class


def _config(endpoint: str | None, timeout: float) -> dict[str, Any]:
    """The botocore Config options of our clients: our timeouts, our retries only."""
    config: dict[str, Any] = {
        "connect_timeout": timeout,
        "read_timeout": timeout,
        "retries": {"total_max_attempts": 1, "mode": "standard"},
        "max_pool_connections": 32,
    }
    if endpoint:  # S3-compatible stores (MinIO, Ceph, moto) rarely resolve bucket subdomains
        config["s3"] = {"addressing_style": "path"}
    return config


def _client_args(endpoint: str | None, anon: bool, timeout: float) -> tuple[tuple, dict[str, Any]]:
    """The arguments s3fs's ``set_session`` passes to ``create_client`` for our filesystem."""
    from aiobotocore.config import AioConfig

    options = _config(endpoint, timeout)
    if anon:
        from botocore import UNSIGNED

        options["signature_version"] = UNSIGNED
    kwargs: dict[str, Any] = {"config": AioConfig(**options), "use_ssl": True}
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    return ("s3",), kwargs


def _signature(args: tuple, kwargs: dict[str, Any]) -> Any:
    """Comparable form of create_client's arguments (a Config compares by its options)."""
    config = kwargs.get("config")
    rest = sorted((k, repr(v)) for k, v in kwargs.items() if k != "config")
    return args, rest, repr(sorted(getattr(config, "_user_provided_options", {}).items()))


async def _prepare(endpoint: str | None, anon: bool, timeout: float) -> Any:
    """A session holding a built, never-entered client (on the loop: credential providers are async)."""
    from aiobotocore.session import AioSession

    session = _session()
    args, kwargs = _client_args(endpoint, anon, timeout)
    client = await AioSession.create_client(session, *args, **kwargs)._coro  # built, not entered
    session.prepared = (_signature(args, kwargs), client)
    return session


def _prepare_workers() -> None:
    """For every S3 filesystem of this process, a prepared session that forked workers take."""
    for key, (endpoint, anon, timeout) in list(CLIENTS.made.items()):
        if key not in CLIENTS.prepared:
            session = run(_prepare, endpoint, anon, timeout, timeout=timeout + 5)
            _keep_tls_contexts(session.prepared[1])
            CLIENTS.prepared[key] = session


def _keep_tls_contexts(client: Any) -> None:
    """Build the prepared client's TLS contexts now, so that each forked child uses its copy.

    aiobotocore builds them when its HTTP session opens its first connection, loading the CA
    bundle (certifi's, or ``AWS_CA_BUNDLE``) into a new ``SSLContext``: most of what a fresh
    DataLoader worker spent on its first S3 request (docs/remote.md). A
    context is plain OpenSSL state that no socket has used yet, so a child's copy is as good
    as its own. The contexts depend only on the client's verify and certificate settings and
    the proxy URL; one for each proxy is built when first asked for. Private aiobotocore API:
    where it has changed, or where building fails here (a CA bundle that cannot be read), the
    child builds its own and reports what fails there.
    """
    http_session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    build = getattr(http_session, "_build_ssl_contexts", None)
    if build is None:
        return
    try:
        built: dict[str | None, Any] = {None: build(None)}
    except Exception:
        log.debug("no TLS contexts prepared for the workers", exc_info=True)
        return

    def contexts(proxy_url: str | None) -> Any:
        if proxy_url not in built:
            built[proxy_url] = build(proxy_url)
        return built[proxy_url]

    http_session._build_ssl_contexts = contexts


def filesystem(timeout: float = DEFAULT_RETRY.timeout, url: str = "s3://") -> Any:
    """This process's S3FileSystem for the current endpoint, timeout and anonymity."""
    endpoint, anon = s3_endpoint(), anonymous("s3")
    # a new client when the credentials in the environment change (a test, a refreshed profile)
    creds = tuple(os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"))
    key = ("s3", endpoint, anon, timeout, creds)

    def make() -> Any:
        try:
            import s3fs
        except ImportError as exc:
            raise make_error(url, "s3:// URLs need s3fs, which is not installed: pip install 'wdsllm[s3]'") from exc
        full_key = process_key(key)
        # a worker forked after prepare_workers() takes the parent's prepared client
        session = CLIENTS.prepared.pop(full_key, None) or _session()
        fs = s3fs.S3FileSystem(
            anon=anon,
            endpoint_url=endpoint,
            config_kwargs=_config(endpoint, timeout),
            session=session,
            skip_instance_cache=True,
        )
        fs.retries = 1  # a class attribute (5 by default), not an argument
        CLIENTS.made[full_key] = (endpoint, anon, timeout)
        return fs

    return instance(key, make)


def split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = bucket_path(url, len("s3://")).partition("/")
    if not bucket:
        raise make_error(url, "s3 URL has no bucket")
    return bucket, key


def credential_source(fs: Any) -> str:
    """Which credentials botocore found, for messages about permission failures."""
    if fs.anon:
        return "none: unsigned requests (WDSLLM_ANONYMOUS)"

    async def go() -> Any:
        await fs.set_session()
        return await fs.session.get_credentials()

    try:
        creds = run(go, timeout=10)
    except Exception:
        creds = None
    if creds is None:
        return (
            "none found (tried AWS_ACCESS_KEY_ID, AWS_PROFILE and ~/.aws, SSO, container and instance roles); "
            "for a public bucket set WDSLLM_ANONYMOUS=1"
        )
    return f"botocore's {getattr(creds, 'method', 'unknown')!r} source"


def _auth_error(exc: BaseException) -> bool:
    be = sys.modules.get("botocore.exceptions")
    if be is None:
        return False
    if isinstance(exc, be.NoCredentialsError):
        return True
    return isinstance(exc, be.ClientError) and _code(exc) in _S3_AUTH


def _code(exc: Any) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def explained(url: str, exc: BaseException, fs: Any) -> BaseException:
    """``exc``, or a permanent error that also says which credentials were used when it is a
    permission failure (the first thing a user needs to know about a 403)."""
    if not _auth_error(exc):
        return exc
    kind = classification(exc)
    reason = kind[1] if kind else str(exc)
    error = make_error(url, f"{reason}; credentials: {credential_source(fs)}")
    error.__cause__ = exc
    return error


def _classify_boto(exc: BaseException) -> tuple[bool, str, float | None] | None:
    # Only look at botocore if something imported it: reading local files must not import it.
    be = sys.modules.get("botocore.exceptions")
    if be is None:
        return None
    if isinstance(exc, be.ClientError):
        response = exc.response
        err = response.get("Error", {})
        code = str(err.get("Code", "?"))
        meta = response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode", 0) or 0
        message = err.get("Message") or ""
        reason = f"S3 {code}" + (f" (HTTP {status})" if status else "") + (f": {message}" if message else "")
        if code in _S3_PERMANENT:
            return False, reason, None
        transient = code in _S3_TRANSIENT or status >= 500 or status in (408, 429)
        after = parse_retry_after((meta.get("HTTPHeaders") or {}).get("retry-after")) if transient else None
        return transient, reason, after
    if isinstance(exc, be.NoCredentialsError):
        return False, f"no AWS credentials found ({exc})", None
    if isinstance(exc, (be.ConnectionError, be.HTTPClientError, be.IncompleteReadError)):
        return True, f"{type(exc).__name__}: {exc}", None
    if isinstance(exc, be.BotoCoreError):
        return False, f"{type(exc).__name__}: {exc}", None
    return None


def _is_missing(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return _code(exc) in _S3_MISSING or status == 404
    return False


def _open(url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
    bucket, key = split_s3(url)
    fs = filesystem(timeout, url)
    kwargs: dict[str, Any] = {}
    rng = range_header(start, end)
    if rng:
        kwargs["Range"] = rng
    tag = versions.strong_tag(etag)
    if tag:  # a pinned or resumed read must see that version of the object, or fail (412)
        kwargs["IfMatch"] = tag

    async def go() -> Any:
        # The aiobotocore client itself, not fs._call_s3: that one retries on its own and turns
        # S3's error codes (SlowDown, NoSuchBucket, PreconditionFailed) into bare OSErrors.
        await fs.set_session()
        client = await fs.get_s3(bucket)
        try:
            return await client.get_object(Bucket=bucket, Key=key, **kwargs)
        except Exception as exc:
            if _code(exc) != "InvalidRange":
                raise
            size = (await client.head_object(Bucket=bucket, Key=key))["ContentLength"]
            if start >= size:
                return EmptyBody(size, etag)
            raise

    try:
        resp = run(go, timeout=timeout + 5)
    except Exception as exc:
        if tag and _code(exc) == "PreconditionFailed":
            raise versions.changed(url, tag, None) from exc
        raise explained(url, exc, fs) from exc
    if isinstance(resp, EmptyBody):
        return resp
    stream = resp["Body"]
    raw = getattr(stream, "_raw_stream", None)  # the aiohttp response under aiobotocore's body

    async def aclose() -> None:
        if not release_if_read(raw):
            stream.close()

    content_range = resp.get("ContentRange")
    total = resp.get("ContentLength")
    first = start
    if content_range:
        first, total = parse_content_range(url, content_range)
    elif start > 0:
        first = 0
    read = salvaging_reader(raw.content) if raw is not None else stream.read
    body = LoopBody(read, aclose, total, versions.entity_tag(resp.get("ETag")) or None, timeout)
    if first != start:
        if first != 0:
            body.close()
            raise make_error(url, f"asked for bytes from {start}, S3 sent from {first}")
        log.warning("%s: store ignored Range and sent the whole object; skipping %d bytes", url, start)
        try:
            discard(url, body, start)
        except BaseException:
            body.close()
            raise
        count("skipped_bytes", start)
    return body


def _exists(url: str, timeout: float) -> bool:
    bucket, key = split_s3(url)
    fs = filesystem(timeout, url)

    async def go() -> bool:
        await fs.set_session()
        client = await fs.get_s3(bucket)
        try:
            await client.head_object(Bucket=bucket, Key=key)
        except Exception as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    try:
        return run(go, timeout=timeout + 5)
    except Exception as exc:
        raise explained(url, exc, fs) from exc


class S3Output(FsspecOutput):
    """``s3://bucket/prefix/``: uploads through s3fs, multipart above :data:`MULTIPART_THRESHOLD`."""

    def __init__(self, url: str, *, multipart_threshold: int | None = None, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.bucket, prefix = split_s3(url)
        self.prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        self.multipart_threshold = multipart_threshold or MULTIPART_THRESHOLD

    def filesystem(self) -> Any:
        return filesystem(self.retry.timeout, self.url)

    def path_of(self, url: str) -> str:
        return bucket_path(url, len("s3://"))

    def put_options(self, size: int) -> dict[str, Any]:
        # s3fs uploads in parts of `chunksize` when the file is at least twice that
        return {"chunksize": max(_MIN_PART, self.multipart_threshold // 2)}

    def same_store(self, url: str) -> bool:
        return url.startswith("s3://") and not split_query(url)[1]


def _s3_url(path: str) -> str:
    return f"s3://{path}"


def _listed_version(info: dict) -> str:
    return versions.entity_tag(info.get("ETag"))


class S3Backend:
    schemes = ("s3",)
    remote = True

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return _open(url, start, end, timeout, etag)

    def exists(self, url: str, timeout: float) -> bool:
        return _exists(url, timeout)

    def list_objects(self, url: str, timeout: float) -> list:
        from .listing import fsspec_objects

        fs = filesystem(timeout, url)
        return fsspec_objects(fs, bucket_path(url, len("s3://")), _s3_url, _listed_version)

    def output_class(self, url: str) -> type[Output]:
        return S3Output


add_classifier(_classify_boto, _is_missing)
register(S3Backend())
on_prepare_workers(_prepare_workers)
