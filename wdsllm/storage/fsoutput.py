"""The Output of an object store reached through an fsspec filesystem (s3://, gs://, az://).

Each object appears only when its upload completes (S3 and GCS make an object visible at the end of
its (multipart / resumable) upload, Azure commits a block list at once), which is the atomicity
contract of :class:`~wdsllm.storage.output.Output`. Every call goes through the retry policy;
the libraries' own retries are switched off where they can be (see each backend). Copies between
two names of the same store are server-side: no byte passes through this machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

from ..errors import NotFoundError
from .output import Output, is_control
from .resumable import read_bytes
from .retry import DEFAULT_RETRY, RetryPolicy, retrying
from .urls import check_name, split_query


class FsspecOutput(Output):
    """A dataset under ``scheme://container/prefix/`` of an fsspec filesystem.

    Subclasses say how to reach the filesystem (:meth:`filesystem`), how a URL maps to a path
    (:meth:`path_of`), and what an upload needs (:meth:`put_options`).
    """

    def __init__(self, url: str, *, retry: RetryPolicy | None = None, **kwargs: Any) -> None:
        super().__init__(url)
        self.retry = retry or DEFAULT_RETRY
        self.root = self.path_of(url).rstrip("/")
        self._staging: str | None = None

    # what a subclass says
    def filesystem(self) -> Any:
        raise NotImplementedError

    def path_of(self, url: str) -> str:
        """The filesystem path (``bucket/key``) of a URL of this store."""
        raise NotImplementedError

    def put_options(self, size: int) -> dict[str, Any]:
        return {}

    def same_store(self, url: str) -> bool:
        """Whether ``url`` lives in the store this output writes to (a server-side copy can reach it)."""
        return False

    def after_copy(self, path: str) -> None:
        """Wait until a server-side copy to ``path`` is complete (Azure copies asynchronously)."""

    # the Output contract
    def _path(self, name: str) -> str:
        return f"{self.root}/{check_name(name)}"

    def _call(self, name: str | None, op: Any) -> Any:
        return retrying(self.url if name is None else self.url_of(name), self.retry, op)

    def list_names(self) -> list[str]:
        fs = self.filesystem()

        def op() -> list[str]:
            fs.invalidate_cache()  # listings are cached by the filesystem; this one must be fresh
            try:
                return fs.find(self.root)
            except FileNotFoundError:
                return []

        prefix = self.root + "/"
        names = (p[len(prefix) :] for p in self._call(None, op) if p.startswith(prefix))
        return sorted(n for n in names if n and not is_control(n))

    def is_empty(self) -> bool:
        return not self.list_names()

    def put_file(self, local_path: str, name: str) -> None:
        path, size = self._path(name), os.path.getsize(local_path)
        fs = self.filesystem()
        self._call(name, lambda: fs.put_file(local_path, path, **self.put_options(size)))
        os.unlink(local_path)

    def put_bytes(self, name: str, data: bytes) -> None:
        path = self._path(name)
        fs = self.filesystem()
        self._call(name, lambda: fs.pipe_file(path, data))

    def get_bytes(self, name: str) -> bytes | None:
        try:
            return read_bytes(self.url_of(name), retry=self.retry)
        except NotFoundError:
            return None

    def delete(self, name: str) -> None:
        path = self._path(name)
        fs = self.filesystem()

        def op() -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)

        self._call(name, op)

    def copy_in(self, source_url: str, name: str) -> bool:
        """Copy ``source_url`` to ``name`` inside the store (server-side); False when the source
        is elsewhere and the bytes must pass through this machine."""
        if not self.same_store(source_url):
            return False
        src, dst = self.path_of(source_url), self._path(name)
        fs = self.filesystem()
        self._call(name, lambda: fs.copy(src, dst))
        self.after_copy(dst)
        return True

    def local_staging_dir(self) -> str:
        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix="wdsllm-stage-")
        return self._staging

    def clear(self) -> None:
        for name in self.list_names():
            self.delete(name)

    def close(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


def bucket_path(url: str, scheme_len: int) -> str:
    """``bucket/key`` of ``scheme://bucket/key`` (a query string dropped: paths carry none)."""
    return split_query(url)[0][scheme_len:]
