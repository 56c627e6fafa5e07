"""What one loader measures of its data path, and the flat dict of numbers it reports.

The loader owns one :class:`Observer`; its :func:`timed` stage wraps the loader's batches on the
trainer's thread (the data wait), and ``Loader.metrics()`` is :meth:`Observer.metrics` plus what
the workers and stores reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..load.options import ObserveOptions
from .wait import WaitClock


class Observer:
    """The data wait of one loader, its periodic reduction over the process group (opt-in), and
    the last reduction's figures."""

    def __init__(self, options: ObserveOptions):
        self.options = options
        self.wait = WaitClock(options.wait_window)
        #: the group ``reduce_every`` gathers over (None: the default group); the data-parallel
        #: group where the world also holds tensor or pipeline parallel ranks
        self.group: Any = None
        self.reduced: dict[str, float] = {}

    def stepped(self) -> None:
        """After each batch handed out: every ``reduce_every`` steps, the reduction (on every rank
        at the same step, as the ranks count the same steps)."""
        every = self.options.reduce_every
        if every is None or self.wait.total_steps % every:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        from .reduce import reduce_wait

        self.reduced = reduce_wait(self.wait.summary(), self.group)

    def metrics(self) -> dict[str, float]:
        """The data wait (this rank's, and the last reduction's where one ran), flat."""
        out = {"steps": float(self.wait.total_steps), "data_wait_total_s": self.wait.total_wait}
        out.update(self.wait.summary().flat())
        out.update(self.reduced)
        return out


def timed(batches: Iterator[dict], observer: Observer) -> Iterator[dict]:
    """The loader's batches, each ``next()`` timed on the calling (trainer's) thread."""
    clock = observer.wait
    try:
        while True:
            clock.entered()
            try:
                batch = next(batches)
            except StopIteration:
                return
            clock.left()
            observer.stepped()
            yield batch
    finally:
        clock.abandoned()
        batches.close()
