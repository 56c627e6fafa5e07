"""hf:// (the Hugging Face Hub): ``hf://datasets/ORG/NAME@REV/path`` read through the Hub's file URLs.

A revision (a branch such as ``main``, a tag, ``refs/convert/parquet`` written ``refs%2Fconvert%2Fparquet``)
is resolved to its commit once per process with huggingface_hub's ``HfApi.repo_info``, and every
object is then read at that commit: a push to ``main`` during a run cannot mix two versions of a
dataset, and DataLoader workers forked from the process read the commit it resolved. The bytes
come from ``{endpoint}/datasets/ORG/NAME/resolve/{commit}/path`` over the http backend (ranged
GETs, resumes), with the token of ``HF_TOKEN`` or ``huggingface-cli login`` as a bearer token;
aiohttp drops it on the Hub's redirect to its CDN, whose address is remembered per file for the
next ranged GETs (one request a block, not two; resolved again when it expires or is refused).
``HF_ENDPOINT`` selects another Hub. Reading
through ``HfFileSystem`` was measured and not used: its ranged reads buffer whole ranges and its
streaming file cannot seek.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from datetime import datetime, timezone
from functools import partial
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from ..errors import StorageError, TransientError
from . import versions
from .backends import anonymous, register
from .http import head, open_url
from .output import Output
from .retry import make_error
from .state import carry, own
from .urls import split_query

_KINDS = {"datasets": "dataset", "spaces": "space", "models": "model"}
_SHA = re.compile(r"[0-9a-f]{40}")

log = logging.getLogger(__name__)


class HubState:
    """What this process resolved at the Hub.

    ``revisions``: (endpoint, repo type, repo, revision) -> commit, kept across a fork (children
    read the same commit); ``cdn``: (a file's resolve URL at a commit, Authorization) -> the CDN
    URL it redirected to (signed: never logged).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.revisions: dict[tuple[str, str, str, str], str] = {}
        self.cdn: dict[tuple[str, str | None], str] = {}

    def reset(self) -> None:
        with self.lock:
            self.revisions, self.cdn = {}, {}

    def after_fork(self) -> None:
        self.lock = threading.Lock()

    def export(self) -> dict[tuple[str, str, str, str], str]:
        """The commits resolved here: a helper reads the same ones."""
        with self.lock:
            return dict(self.revisions)

    def adopt(self, snapshot: dict[tuple[str, str, str, str], str]) -> None:
        with self.lock:
            self.revisions.update(snapshot)


HUB = carry("hub", own("hub", HubState()))


def parse(url: str) -> tuple[str, str, str, str]:
    """(repo type, repo id, revision, path in the repo) of an hf:// URL."""
    rest = split_query(url)[0][len("hf://") :]
    parts = rest.split("/")
    kind = "model"
    if parts and parts[0] in _KINDS:
        kind = _KINDS[parts.pop(0)]
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise make_error(url, "an hf:// URL names a repository: hf://datasets/ORG/NAME[@REVISION]/path")
    org, name = parts[0], parts[1]
    name, _, revision = name.partition("@")
    return kind, f"{org}/{name}", unquote(revision) or "main", "/".join(parts[2:])


def endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT`` as it is now (huggingface_hub reads it once, at import)."""
    value = os.environ.get("HF_ENDPOINT")
    if not value:
        from huggingface_hub import constants

        value = constants.ENDPOINT
    return value.rstrip("/")


def token() -> str | None:
    """``HF_TOKEN``, else the ``huggingface-cli login`` token; None with ``WDSLLM_ANONYMOUS`` (=1 or =hf)."""
    if anonymous("hf"):
        return None
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token()


def commit_of(url: str, timeout: float) -> str:
    """The commit that the URL's revision names, resolved once per process."""
    kind, repo, revision, _ = parse(url)
    if _SHA.fullmatch(revision):
        return revision
    key = (endpoint(), kind, repo, revision)
    with HUB.lock:
        sha = HUB.revisions.get(key)
    if sha is not None:
        return sha
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.utils import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError as exc:
        raise make_error(url, "hf:// URLs need huggingface_hub, which is not installed") from exc
    try:
        api = HfApi(endpoint=key[0], token=token() or False)  # False: not even the login's token
        info = api.repo_info(repo, repo_type=kind, revision=revision, timeout=timeout)
    except RepositoryNotFoundError as exc:
        how = "a token was sent" if token() else "no token: set HF_TOKEN or run `huggingface-cli login`"
        if anonymous("hf"):
            how = "anonymous requests: WDSLLM_ANONYMOUS"
        raise make_error(
            url, f"repository {repo} not found, or private and not readable ({how})", missing=True
        ) from exc
    except RevisionNotFoundError as exc:
        raise make_error(url, f"revision {revision!r} not found in {repo}", missing=True) from exc
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", 0) or 0
        raise make_error(
            url, f"the Hub answered HTTP {status}", transient=status in (408, 429) or status >= 500
        ) from exc
    with HUB.lock:
        HUB.revisions[key] = sha = info.sha
    return sha


def pinned(url: str, timeout: float = 30.0) -> str:
    """``url`` with its revision replaced by the commit that the revision names now.

    Every process of a run resolves a branch on its own; ranks started apart can see a push land
    between them. Resolve once (rank 0) and hand this URL to every rank (``docs/remote.md``)
    to make them read one commit. The loader does not do it for you: a collective in its
    constructor would hang a job that makes a loader on some ranks only.
    """
    kind, repo, _, path = parse(url)
    query = split_query(url)[1]
    prefix = {"dataset": "datasets/", "space": "spaces/", "model": ""}[kind]
    tail = f"/{path}" if path else ""
    return f"hf://{prefix}{repo}@{commit_of(url, timeout)}{tail}" + (f"?{query}" if query else "")


def file_url(url: str, timeout: float, commit: str | None = None) -> str:
    """The Hub's resolve URL of an hf:// object at ``commit``, by default its revision's."""
    kind, repo, _, path = parse(url)
    prefix = "" if kind == "model" else f"{kind}s/"
    return f"{endpoint()}/{prefix}{repo}/resolve/{commit or commit_of(url, timeout)}/{quote(path, safe='/')}"


def _headers() -> dict[str, str]:
    value = token()
    return {"Authorization": f"Bearer {value}"} if value else {}


#: Seconds before a signed CDN URL's ``Expires`` from which it is not used: a fresh one is asked for.
_EXPIRY_MARGIN = 60.0


def _expired(target: str) -> bool:
    """Whether a signed URL is past or near its end: CloudFront's ``Expires`` (epoch seconds) or
    S3's ``X-Amz-Date`` + ``X-Amz-Expires`` (both seen on the Hub's CDNs)."""
    query = parse_qs(urlsplit(target).query)
    try:
        if "Expires" in query:
            end = float(query["Expires"][0])
        elif "X-Amz-Date" in query and "X-Amz-Expires" in query:
            signed = datetime.strptime(query["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
            end = signed.timestamp() + float(query["X-Amz-Expires"][0])
        else:
            return False
    except ValueError:
        return True  # a signature we cannot read: ask the Hub again rather than guess
    return end - _EXPIRY_MARGIN <= time.time()


def _open(url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
    """One ranged GET: straight to the CDN URL the Hub redirected this file to before, else the
    Hub's resolve URL (then its 302), remembering where it led.

    The resolve URL names a commit, so its target holds the same bytes for the run; the real
    Hub's targets are signed and expire, so an expired one, or one the CDN refuses (403, 404,
    ...), is resolved again. The CDN gets no Authorization header (the Hub's token is not its).
    The version of a Hub file is its commit (:mod:`.versions`): a read pinned to one is read at
    that commit, whatever the revision names now.
    """
    commit = versions.pinned_commit(etag) or commit_of(url, timeout)
    body = _open_at(url, file_url(url, timeout, commit), start, end, timeout)
    body.etag = versions.commit(commit)
    return body


def _open_at(url: str, resolve: str, start: int, end: int | None, timeout: float) -> Any:
    """One ranged GET of the file whose resolve URL (at a commit) is ``resolve``."""
    headers = _headers()
    key = (resolve, headers.get("Authorization"))  # a private repository's address is the token's only
    target = HUB.cdn.get(key)
    if target is not None and not _expired(target):
        same_host = urlsplit(target).netloc == urlsplit(resolve).netloc  # aiohttp keeps the token there
        try:
            return open_url(target, start, end, timeout, headers=headers if same_host else None, shown=url)
        except StorageError as exc:
            if isinstance(exc, TransientError):
                raise
        log.debug("%s: the CDN refused a remembered address; resolving it again", url)
    HUB.cdn.pop(key, None)
    return open_url(
        resolve, start, end, timeout, headers=headers, shown=url, redirected=partial(HUB.cdn.__setitem__, key)
    )


class HfBackend:
    schemes = ("hf",)
    remote = True

    def open(self, url: str, start: int, end: int | None, timeout: float, etag: str | None) -> Any:
        return _open(url, start, end, timeout, etag)

    def exists(self, url: str, timeout: float) -> bool:
        return head(file_url(url, timeout), timeout, headers=_headers(), shown=url)

    def list_objects(self, url: str, timeout: float) -> list:
        """The repository's files under the URL's directory, at the commit of its revision."""
        from huggingface_hub import HfApi
        from huggingface_hub.utils import EntryNotFoundError

        from .listing import ObjectInfo

        kind, repo, _, path = parse(url)
        commit = commit_of(url, timeout)
        root = split_query(url)[0][: len(split_query(url)[0]) - len(path)]  # "hf://datasets/ORG/NAME@REV/"
        directory = path.rstrip("/")
        api = HfApi(endpoint=endpoint(), token=token())
        try:
            entries = api.list_repo_tree(
                repo, path_in_repo=directory or None, revision=commit, repo_type=kind, recursive=True
            )
            files = [e for e in entries if getattr(e, "size", None) is not None and not hasattr(e, "tree_id")]
        except EntryNotFoundError:
            return []
        prefix = directory + "/" if directory else ""
        return [
            ObjectInfo(root + e.path, int(e.size), versions.commit(commit)) for e in files if e.path.startswith(prefix)
        ]

    def output_class(self, url: str) -> type[Output]:
        raise make_error(
            url,
            "datasets are not written to hf:// directly; pack to a local directory and upload it with "
            "`huggingface-cli upload`",
        )


register(HfBackend())
