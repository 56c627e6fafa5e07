"""s3:// (and S3-compatible endpoints): boto3 imported lazily, clients cached per process; the
S3 output (multipart uploads) (to be replaced by a maintained fsspec client, issue #13)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

from ..errors import NotFoundError
from .backends import EmptyBody, discard, parse_content_range, register
from .counters import count
from .output import Output, is_control
from .resumable import read_bytes
from .retry import DEFAULT_RETRY, RetryPolicy, add_classifier, classify, make_error, retrying
from .urls import check_name

log = logging.getLogger(__name__)

#: Files above this size go to S3 as multipart uploads (``WDSLLM_S3_MULTIPART_THRESHOLD``, in
#: bytes, overrides it, e.g. for tests that run ``wdsllm pack`` in a subprocess).
MULTIPART_THRESHOLD = int(os.environ.get("WDSLLM_S3_MULTIPART_THRESHOLD") or 64 * 2**20)
_S3_MISSING = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}

_s3_clients: dict[tuple[Any, ...], Any] = {}
_s3_lock = threading.Lock()
_S3_PERMANENT = {
    "NoSuchKey",
    "NoSuchBucket",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NotFound",
    "PreconditionFailed",
}
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


def _import_boto3(url: str):
    try:
        import boto3
    except ImportError as exc:
        raise make_error(url, "s3:// URLs need boto3, which is not installed: pip install wdsllm[s3]") from exc
    return boto3


def s3_endpoint() -> str | None:
    """The S3-compatible endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, if set.

    Recent botocore reads these variables itself; passing the value explicitly also works with
    older versions and lets the client cache notice a change.
    """
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


_boto_loader: Any = None  # botocore's parsed service models, kept across fork (see _boto_session)


def _boto_session(boto3):
    """A new boto3 session that shares this process's parsed service models.

    Sessions and clients are per process (credentials may refresh under locks, connections are
    sockets), but the models are plain data: a DataLoader worker forked from a process that has
    used S3 then makes its client in about 20 ms instead of 80 ms, once per worker and epoch.
    """
    global _boto_loader
    import botocore.session

    core = botocore.session.get_session()
    if _boto_loader is None:
        _boto_loader = core.get_component("data_loader")
    else:
        core.register_component("data_loader", _boto_loader)
    return boto3.session.Session(botocore_session=core)


def _s3_client(timeout: float = DEFAULT_RETRY.timeout, url: str = "s3://"):
    """A client for this process. botocore's own retries are off: :class:`RetryPolicy` is the one
    place that decides how often to try, so ``attempts`` means what it says."""
    endpoint = s3_endpoint()
    key = (os.getpid(), endpoint, timeout)
    with _s3_lock:
        client = _s3_clients.get(key)
        if client is None:
            boto3 = _import_boto3(url)
            from botocore.config import Config

            config = Config(
                connect_timeout=timeout,
                read_timeout=timeout,
                retries={"total_max_attempts": 1, "mode": "standard"},
                max_pool_connections=32,
                # S3-compatible stores (MinIO, Ceph, moto) rarely resolve bucket subdomains.
                s3={"addressing_style": "path"} if endpoint else None,
            )
            client = _boto_session(boto3).client("s3", endpoint_url=endpoint, config=config)
            _s3_clients[key] = client
    return client


def _classify_boto(exc: BaseException) -> tuple[bool, str] | None:
    # Only look at botocore if something imported it: reading local files must not import boto3.
    be = sys.modules.get("botocore.exceptions")
    if be is None:
        return None
    upload_failed = getattr(sys.modules.get("boto3.exceptions"), "S3UploadFailedError", None)
    if upload_failed is not None and isinstance(exc, upload_failed):
        cause = exc.__cause__ or exc.__context__
        kind = classify(cause) if cause is not None else None
        return kind if kind is not None else (False, str(exc))
    if isinstance(exc, be.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "?"))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        message = err.get("Message") or ""
        reason = f"S3 {code}" + (f" (HTTP {status})" if status else "") + (f": {message}" if message else "")
        if code in _S3_PERMANENT:
            return False, reason
        transient = code in _S3_TRANSIENT or status >= 500 or status in (408, 429)
        return transient, reason
    if isinstance(exc, (be.ConnectionError, be.HTTPClientError, be.IncompleteReadError)):
        return True, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, be.NoCredentialsError):
        return False, f"no AWS credentials found ({exc})"
    if isinstance(exc, be.BotoCoreError):
        return False, f"{type(exc).__name__}: {exc}"
    urllib3 = sys.modules.get("urllib3.exceptions")
    if urllib3 is not None and isinstance(exc, urllib3.HTTPError):
        return True, f"{type(exc).__name__}: {exc}"
    return None


class _S3Body:
    def __init__(self, body, total: int | None, etag: str | None) -> None:
        self.body, self.total, self.etag = body, total, etag

    def readinto(self, b: Any) -> int:
        # urllib3 reads until `amt` is filled; small reads bound what a reset can throw away.
        data = self.body.read(min(len(b), 64 * 1024))
        n = len(data)
        b[:n] = data
        count("received_bytes", n)
        return n

    def close(self) -> None:
        self.body.close()


def _s3_open(url: str, start: int, end: int | None, timeout: float, etag: str | None) -> _S3Body | EmptyBody:
    bucket, key = split_s3(url)
    client = _s3_client(timeout, url)
    kwargs: dict[str, Any] = {}
    if start > 0 or end is not None:
        kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    if etag:  # a resumed read must see the same object version, or fail
        kwargs["IfMatch"] = etag
    try:
        resp = client.get_object(Bucket=bucket, Key=key, **kwargs)
    except Exception as exc:
        response = getattr(exc, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code != "InvalidRange":
            raise
        size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        if start >= size:
            return EmptyBody(size, etag)
        raise
    content_range = resp.get("ContentRange")
    if content_range:
        first, total = parse_content_range(url, content_range)
        if first != start:
            resp["Body"].close()
            raise make_error(url, f"asked for bytes from {start}, S3 sent from {first}")
    else:
        total = resp.get("ContentLength")
        if start > 0:  # a store that ignored Range
            log.warning("%s: store ignored Range and sent the whole object; skipping %d bytes", url, start)
            body = _S3Body(resp["Body"], total, resp.get("ETag"))
            try:
                discard(url, body, start)
            except BaseException:
                body.close()
                raise
            count("skipped_bytes", start)
            return body
    return _S3Body(resp["Body"], total, resp.get("ETag"))


def _s3_exists(url: str, timeout: float) -> bool:
    bucket, key = split_s3(url)
    try:
        _s3_client(timeout, url).head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        resp = getattr(exc, "response", None)
        if resp and (resp.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")):
            return False
        raise
    return True


def split_s3(url: str) -> tuple[str, str]:
    rest = url[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise make_error(url, "s3 URL has no bucket")
    return bucket, key


class S3Output(Output):
    def __init__(
        self, url: str, *, retry: RetryPolicy | None = None, multipart_threshold: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(url)
        self.bucket, prefix = split_s3(url)
        self.prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        self.retry = retry or DEFAULT_RETRY
        self.multipart_threshold = multipart_threshold or MULTIPART_THRESHOLD
        self._staging: str | None = None

    def _key(self, name: str) -> str:
        return self.prefix + check_name(name)

    def _client(self):
        return _s3_client(self.retry.timeout, self.url)

    def _keys(self, limit: int | None = None) -> list[str]:
        def op() -> list[str]:
            keys: list[str] = []
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix}
            if limit:
                kwargs["MaxKeys"] = limit
            while True:
                resp = self._client().list_objects_v2(**kwargs)
                keys.extend(o["Key"] for o in resp.get("Contents", []))
                if (limit and len(keys) >= limit) or not resp.get("IsTruncated"):
                    return keys
                kwargs["ContinuationToken"] = resp["NextContinuationToken"]

        return retrying(self.url, self.retry, op)

    def is_empty(self) -> bool:
        return not self.list_names()

    def list_names(self) -> list[str]:
        return sorted(n for n in (k[len(self.prefix) :] for k in self._keys()) if not is_control(n))

    def put_file(self, local_path: str, name: str) -> None:
        from boto3.s3.transfer import TransferConfig

        key = self._key(name)
        config = TransferConfig(
            multipart_threshold=self.multipart_threshold,
            # S3 parts are at least 5 MiB; 16 MiB parts upload in parallel without many requests.
            multipart_chunksize=max(5 * 2**20, min(self.multipart_threshold, 16 * 2**20)),
            max_concurrency=4,
        )
        retrying(
            self.url_of(name),
            self.retry,
            lambda: self._client().upload_file(local_path, self.bucket, key, Config=config),
        )
        os.unlink(local_path)

    def put_bytes(self, name: str, data: bytes) -> None:
        key = self._key(name)
        retrying(
            self.url_of(name),
            self.retry,
            lambda: self._client().put_object(Bucket=self.bucket, Key=key, Body=data),
        )

    def get_bytes(self, name: str) -> bytes | None:
        url = self.url_of(name)
        try:
            return read_bytes(url, retry=self.retry)
        except NotFoundError:
            return None

    def delete(self, name: str) -> None:
        key = self._key(name)
        retrying(self.url_of(name), self.retry, lambda: self._client().delete_object(Bucket=self.bucket, Key=key))

    def local_staging_dir(self) -> str:
        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix="wdsllm-stage-")
        return self._staging

    def clear(self) -> None:
        keys = [k for k in self._keys() if not is_control(k[len(self.prefix) :])]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}

            def op(batch: dict = batch) -> None:
                resp = self._client().delete_objects(Bucket=self.bucket, Delete=batch)
                if resp.get("Errors"):
                    first = resp["Errors"][0]
                    raise make_error(self.url, f"cannot delete {first.get('Key')}: S3 {first.get('Code')}")

            retrying(self.url, self.retry, op)

    def close(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


def _is_missing(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _S3_MISSING or status == 404
    return False


class S3Backend:
    schemes = ("s3",)
    remote = True

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return _s3_open(url, start, end, timeout, etag)

    def exists(self, url: str, timeout: float) -> bool:
        return _s3_exists(url, timeout)

    def output_class(self, url: str) -> type[Output]:
        return S3Output


add_classifier(_classify_boto, _is_missing)
register(S3Backend())


def _after_fork_in_child() -> None:
    """Clients and locks of the parent are not ours to use: start empty."""
    global _s3_lock
    _s3_lock = threading.Lock()
    _s3_clients.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
