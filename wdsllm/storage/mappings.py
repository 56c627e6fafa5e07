"""Anonymous mappings recycled between spools.

A remote shard is downloaded into an anonymous mapping (:class:`~wdsllm.storage.spool.Spool`).
A fresh mapping has no pages: the first write to each 4 KiB page traps into the kernel, which
finds and zeroes a page, in the copy that writes the received bytes, under the GIL, while the
loader wants the GIL to decode. A mapping whose pages are already there takes the same bytes an
order of magnitude faster (docs/remote.md), so a spool's mapping is handed to the next spool once
nothing views it any more.

"Nothing views it" is what ``mmap.resize`` checks: it refuses while any buffer (a NumPy array of
tokens, a memoryview of a reader, a block download in flight) is exported from the mapping. A
mapping some batch still views stays that batch's, and a new one is made. Where ``resize`` is not
available (no ``mremap``), every spool gets a fresh mapping.
"""

from __future__ import annotations

import mmap
import os
import threading

from .state import own

#: Mappings kept for reuse, and their total size (``WDSLLM_SPOOL_KEEP_BYTES``, bytes): a free
#: mapping stays resident, so what is kept is bounded by about one large shard. As many as the
#: loader spools at once (up to 8 small shards ahead, then the next 8 while those are viewed).
KEEP = 16
KEEP_BYTES = int(os.environ.get("WDSLLM_SPOOL_KEEP_BYTES") or 1 << 30)

#: Private, not mmap's default shared anonymous memory: a shared one is a file of fixed size, and
#: growing it with ``resize`` leaves pages past that size that raise SIGBUS when touched.
_PRIVATE = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}


class MappingPool:
    """Released mappings, oldest first, kept for a later spool while they fit :data:`KEEP` and
    :data:`KEEP_BYTES`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.free: list[mmap.mmap] = []

    def take(self, size: int) -> mmap.mmap:
        """A writable anonymous mapping of exactly ``size`` bytes (at least one): a recycled one
        when one is free, whose bytes are stale (a spool hands out only the bytes it has written)."""
        size = max(size, 1)
        with self._lock:
            # the closest in size first: resizing keeps the pages both sizes share
            for mm in sorted(self.free, key=lambda m: abs(len(m) - size)):
                if not _PRIVATE and len(mm) < size:
                    continue  # without private mappings, never grown (see _PRIVATE)
                try:
                    mm.resize(size)  # BufferError while anything views it; OSError/SystemError: no mremap
                except (BufferError, OSError, SystemError, ValueError):
                    continue
                self.free.remove(mm)
                return mm
        return mmap.mmap(-1, size, **_PRIVATE)

    def give(self, mm: mmap.mmap) -> None:
        """Keep ``mm`` for a later :meth:`take` (it is reused only once nothing views it)."""
        if mm.closed or len(mm) > KEEP_BYTES:
            return
        with self._lock:
            self.free.append(mm)
            while len(self.free) > KEEP or sum(len(m) for m in self.free) > KEEP_BYTES:
                self.free.pop(0)  # the oldest: arrays that still view it keep it alive until they go

    def reset(self) -> None:
        with self._lock:
            self.free = []

    def after_fork(self) -> None:
        """A child's copies of the parent's mappings are copy-on-write: a write to one costs more
        than a fresh page. The child starts with none."""
        self._lock = threading.Lock()
        self.free = []


POOL = own("mappings", MappingPool())


def take(size: int) -> mmap.mmap:
    """A mapping of ``size`` bytes from the process's pool (:meth:`MappingPool.take`)."""
    return POOL.take(size)


def give(mm: mmap.mmap) -> None:
    """Back to the process's pool (:meth:`MappingPool.give`)."""
    POOL.give(mm)
