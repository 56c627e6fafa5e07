"""Streams started for a pass that has not begun yet (the next epoch's first shards), kept until
that pass adopts them or ends without them.

A loader reading epoch after epoch in one process starts the next epoch's first remote shards
while it reads this epoch's last ones (``Prefetcher.warm``, which the loader calls), so that the next epoch
does not begin with a wait for their first bytes. What a pass did not adopt is closed when it
ends: a guess that was wrong (``set_epoch`` chose another epoch) costs those downloads, no more.
Each stream is parked for an owner (a loader's stream of one rank and worker): a pass of another
loader in between (an evaluation between two training epochs) leaves it alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any, BinaryIO, NamedTuple

from .state import own
from .urls import redact

log = logging.getLogger(__name__)


class WarmKey(NamedTuple):
    """Whose parked streams these are: a loader (``loader``: what :meth:`Parking.release` names)
    and one of its streams (a rank and worker)."""

    loader: Hashable = None
    stream: Hashable = None


class _Parked(NamedTuple):
    owner: WarmKey
    passes: int  # passes begun when it was parked
    url: str
    kwargs: dict[str, Any]
    stream: BinaryIO


class Parking:
    """Started streams by (url, open keyword arguments), each with its owner and the count of
    passes begun when it was parked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._passes = 0
        self._streams: list[_Parked] = []
        #: a forked child's copies of its parent's parked streams, never closed or collected there:
        #: closing one would cancel the parent's download and give its memory back, through the
        #: parent's fetch process, whose socket the child shares until the child's own hook closes it
        self._inherited: list[list[_Parked]] = []

    def begin(self) -> int:
        """A pass begins: its number. What was parked before it is its to adopt until it ends."""
        with self._lock:
            self._passes += 1
            return self._passes

    def park(self, owner: WarmKey, url: str, kwargs: dict[str, Any], stream: BinaryIO) -> None:
        with self._lock:
            self._streams.append(_Parked(owner, self._passes, url, kwargs, stream))

    def adopt(self, owner: WarmKey, url: str, kwargs: dict[str, Any]) -> BinaryIO | None:
        """``owner``'s parked stream of ``url`` opened with exactly ``kwargs`` (taken out), or
        None. One that failed is closed instead: opened again, it gets a fresh set of retries."""
        with self._lock:
            found = [i for i, e in enumerate(self._streams) if e.owner == owner and e.url == url and e.kwargs == kwargs]
            if not found:
                return None
            stream = self._streams.pop(found[0]).stream
        if getattr(stream, "failed", False):
            stream.close()
            return None
        log.debug("%s: started by the pass before", redact(url))
        return stream

    def end(self, owner: WarmKey, begun: int) -> None:
        """``owner``'s pass ``begun`` ended: what was parked for it before it began and not
        adopted is closed."""
        self._close_where(lambda e: e.owner == owner and e.passes < begun)

    def release(self, loader: Hashable) -> None:
        """Close what is parked for any stream of ``loader`` (the loader is closed)."""
        self._close_where(lambda e: e.owner.loader == loader)

    def _close_where(self, chosen: Callable[[_Parked], bool]) -> None:
        with self._lock:
            stale = [e for e in self._streams if chosen(e)]
            self._streams = [e for e in self._streams if not chosen(e)]
        for entry in stale:
            entry.stream.close()

    def reset(self) -> None:
        """Close everything parked."""
        self._close_where(lambda e: True)

    def after_fork(self) -> None:
        """A forked child starts with nothing parked: the parent's streams are filled by its threads."""
        self._lock = threading.Lock()
        self._inherited.append(self._streams)
        self._streams = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)


PARKING = own("parking", Parking())


# at interpreter exit, before the download threads are joined (a parked download would otherwise
# run to its end first); threading's exit hooks run in reverse order, so this one before theirs
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(PARKING.reset)
else:  # pragma: no cover - other interpreters
    import atexit

    atexit.register(PARKING.reset)


def parked_count() -> int:
    """Streams parked in this process (tests, tools)."""
    return len(PARKING)
