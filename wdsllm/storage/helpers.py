"""What readers of remote shards started in this process, stopped when the last one is done.

A loader that reads remote shards uses helpers that outlive one pass: the block reader threads
(:mod:`.parallel`), the fetch process (:mod:`.offload`) and the next pass's parked spools
(:mod:`.parking`). Each loader that opens a prefetcher is a user (:func:`use`, by the loader
half of its :class:`~wdsllm.storage.parking.WarmKey`). :func:`release` is what a loader's
``close()`` calls: its parked spools are closed, and once no user is left and nothing waits for
them, the helpers stop. A later read starts them again.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from . import offload, parallel, parking
from .state import own


class Users:
    """The loaders of this process that may read again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loaders: set[Hashable] = set()

    def add(self, loader: Hashable) -> None:
        with self._lock:
            self.loaders.add(loader)

    def remove(self, loader: Hashable) -> bool:
        """Forget ``loader``; whether none is left."""
        with self._lock:
            self.loaders.discard(loader)
            return not self.loaders

    def reset(self) -> None:
        with self._lock:
            self.loaders = set()

    def after_fork(self) -> None:
        """A forked child's helpers are its own: its loaders register again as they read."""
        self._lock = threading.Lock()
        self.loaders = set()


USERS = own("helper users", Users())


def use(loader: Hashable) -> None:
    """``loader`` reads through the helpers (until :func:`release`)."""
    if loader is not None:
        USERS.add(loader)


def release(loader: Hashable) -> None:
    """``loader`` reads no more: close what is parked for it; the last one stops the helpers."""
    parking.PARKING.release(loader)
    if USERS.remove(loader):
        stop_idle()


def stop_idle() -> None:
    """Stop the fetch process and the block reader threads where nothing uses them."""
    if len(parking.PARKING) or offload.SERVICE.busy():
        return
    offload.SERVICE.stop()
    if parallel.READERS.idle():
        parallel.READERS.stop_threads()
