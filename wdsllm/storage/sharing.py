"""One spool of a whole remote object read by several consumers in turn.

An epoch's blocks cut a shard into runs read in a shuffled order (``load/plan.py``). Read by
range, each run of a remote shard is its own GET and spool, and tokens of different runs sit in
different buffers (a shuffle window then copies them). Where a pass reads several runs of a shard
that fits the read-ahead budget, the prefetcher downloads the shard once and hands each run a
:class:`SharedView` of that one spool: one download, one buffer, views that share it.
"""

from __future__ import annotations

import threading
from typing import Any

from .spool import SpooledRange


class SpoolShare:
    """A spool (opened with ``kwargs``) and its views: closed once the pass that shares it ended
    (:meth:`close`) and no view of it is open (an open view's reader still waits for its bytes),
    unless handed over to the next pass (:meth:`hand_over`), which reads the same object first."""

    def __init__(self, spool: SpooledRange, kwargs: dict[str, Any]) -> None:
        self.spool = spool
        self.kwargs = kwargs
        self.open_views = 0
        self.ended = False
        #: the next pass reads it first: handed over when this pass ends, not closed
        self.kept = False
        self._handed = False
        self._lock = threading.Lock()

    def view(self) -> SharedView:
        """The next consumer's view of the spool."""
        with self._lock:
            self.open_views += 1
        return SharedView(self)

    def release(self) -> None:
        """A view closed."""
        with self._lock:
            self.open_views -= 1
            done = self.ended and self.open_views <= 0 and not self._handed
        if done:
            self.spool.close()

    def close(self) -> None:
        """The pass ended: no more views."""
        with self._lock:
            self.ended = True
            done = self.open_views <= 0 and not self._handed
        if done:
            self.spool.close()

    def hand_over(self) -> SpooledRange:
        """The pass ended and the spool goes on to the next one (its bytes are only read, by
        views that may outlive the pass): it is no longer this share's to close."""
        with self._lock:
            self.ended = self._handed = True
        return self.spool


class SharedView(SpooledRange):
    """One consumer's view of a shared spool: its own read position over the spool's bytes."""

    def __init__(self, share: SpoolShare) -> None:
        super().__init__()
        self.share = share
        spool = share.spool
        self.name, self.offset, self.end, self.mm = spool.name, spool.offset, spool.end, spool.mm
        self._pos = spool.offset

    def wait(self, upto: int) -> None:
        self.share.spool.wait(upto)

    def available(self) -> int:
        return self.share.spool.available()

    @property
    def failed(self) -> bool:
        return self.share.spool.failed

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.share.release()
