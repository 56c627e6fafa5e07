"""Writing a dataset: the atomicity contract every store's output keeps."""

from __future__ import annotations

from typing import Any

from .backends import backend_for
from .urls import join_url

#: Names of control files (the output lock) that listing, emptiness and clearing ignore.
CONTROL_PREFIX = ".wdsllm-"


def is_control(name: str) -> bool:
    return name.rsplit("/", 1)[-1].startswith(CONTROL_PREFIX)


class Output:
    """A dataset directory being written: a local directory, or a prefix in S3, GCS or Azure.

    The packer relies on the atomicity contract: a name appears only when its content is complete
    (local: temp file, fsync, rename; object stores: an object becomes visible only when its upload
    completes), so putting ``index.json`` last means an interrupted job never leaves an index that
    points at missing shards. ``Output(url)`` returns the subclass for the URL's scheme.
    """

    url: str

    def __new__(cls, url: str, **kwargs: Any) -> Output:
        if cls is Output:
            cls = backend_for(url).output_class(url)
        return super().__new__(cls)

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.url = url

    def __enter__(self) -> Output:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def url_of(self, name: str) -> str:
        return join_url(self.url, name)

    def is_empty(self) -> bool:
        """Whether the output holds nothing but control files."""
        raise NotImplementedError

    def list_names(self) -> list[str]:
        """Every name under the output (control files left out), sorted."""
        raise NotImplementedError

    def put_file(self, local_path: str, name: str) -> None:
        raise NotImplementedError

    def put_bytes(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def get_bytes(self, name: str) -> bytes | None:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def copy_in(self, source_url: str, name: str) -> bool:
        """Copy ``source_url`` to ``name`` without the bytes passing through this machine (a
        server-side copy); False when this output cannot (another store), and the caller copies."""
        return False

    def local_staging_dir(self) -> str:
        raise NotImplementedError

    def clear(self) -> None:
        """Remove everything but control files."""
        raise NotImplementedError

    def close(self) -> None:
        """Release local resources (the staging directory of remote outputs)."""
