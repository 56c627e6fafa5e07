"""Streams started for a pass that has not begun yet (the next epoch's first shards), kept until
that pass adopts them or ends without them.

A loader reading epoch after epoch in one process starts the next epoch's first remote shards
while it reads this epoch's last ones (``prefetch_iter(..., then=...)``), so that the next epoch
does not begin with a wait for their first bytes. What a pass did not adopt is closed when it
ends: a guess that was wrong (``set_epoch`` chose another epoch) costs those downloads, no more.
Each stream is parked for an owner (a loader's stream of one rank and worker): a pass of another
loader in between (an evaluation between two training epochs) leaves it alone.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Hashable
from typing import Any, BinaryIO

from .urls import redact

log = logging.getLogger(__name__)


class Parking:
    """Started streams by (url, open keyword arguments), each with its owner and the count of
    passes begun when it was parked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._passes = 0
        self._streams: list[tuple[Hashable, int, str, dict[str, Any], BinaryIO]] = []

    def begin(self) -> int:
        """A pass begins: its number. What was parked before it is its to adopt until it ends."""
        with self._lock:
            self._passes += 1
            return self._passes

    def park(self, owner: Hashable, url: str, kwargs: dict[str, Any], stream: BinaryIO) -> None:
        with self._lock:
            self._streams.append((owner, self._passes, url, kwargs, stream))

    def adopt(self, owner: Hashable, url: str, kwargs: dict[str, Any]) -> BinaryIO | None:
        """``owner``'s parked stream of ``url`` opened with exactly ``kwargs`` (taken out), or
        None. One that failed is closed instead: opened again, it gets a fresh set of retries."""
        with self._lock:
            found = [i for i, e in enumerate(self._streams) if e[0] == owner and e[2] == url and e[3] == kwargs]
            if not found:
                return None
            stream = self._streams.pop(found[0])[4]
        if getattr(stream, "failed", False):
            stream.close()
            return None
        log.debug("%s: started by the pass before", redact(url))
        return stream

    def end(self, owner: Hashable, begun: int) -> None:
        """``owner``'s pass ``begun`` ended: what was parked for it before it began and not
        adopted is closed."""
        with self._lock:
            kept, stale = [], []
            for entry in self._streams:
                (stale if entry[0] == owner and entry[1] < begun else kept).append(entry)
            self._streams = kept
        for *_, stream in stale:
            stream.close()

    def clear(self) -> None:
        """Close everything parked."""
        with self._lock:
            streams, self._streams = [s for *_, s in self._streams], []
        for stream in streams:
            stream.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)


PARKING = Parking()


#: a forked child's copies of its parent's parked streams, never closed or collected there:
#: closing one would cancel the parent's download and give its memory back, through the parent's
#: fetch process, whose socket the child shares until the child's own at-fork hook closes it
_inherited: list[Parking] = []


def _after_fork() -> None:
    """A forked child starts with nothing parked: the parent's streams are filled by its threads."""
    global PARKING
    _inherited.append(PARKING)
    PARKING = Parking()


os.register_at_fork(after_in_child=_after_fork)


def _at_exit() -> None:
    PARKING.clear()


# at interpreter exit, before the download threads are joined (a parked download would otherwise
# run to its end first); threading's exit hooks run in reverse order, so this one before theirs
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_at_exit)
else:  # pragma: no cover - other interpreters
    import atexit

    atexit.register(_at_exit)


def parked_count() -> int:
    """Streams parked in this process (tests, tools)."""
    return len(PARKING)


def forget_parked() -> None:
    """Close every parked stream (tests; a process that reads no further pass)."""
    PARKING.clear()
