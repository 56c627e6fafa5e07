"""The stream of a change's re-plan, started before its step (``steer_horizon``, ``at=``).

At a change's step the epoch goes on as a fresh pass over the re-planned rest: its first batch
needs a shuffle block read (thousands of group reads on a large mixture). That pass does not
depend on anything the steps before it do, so it is started ahead over a copy of the loader's
first stage that holds the new plan (``EpochSource.with_plan``), the loader's own left as it is:
without workers (or with workers run in this process) in the thread that made the plan, its
first batch pulled; with DataLoader workers from the loader's thread at a step once the plan is
made, so that the workers fork with the plan and read their first blocks while the old workers'
batches are still handed out. At the step the loader takes the stream where its plan is the one
the step re-planned to, else closes it and starts one as always.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Prestarted:
    """A pass over ``plan`` from its start, begun ahead: ``stream`` is what the transport gives
    (batches and end markers); ``keep`` holds what the old pass still needs until the switch
    (the ring its workers write into)."""

    plan: Any
    stream: Iterator
    keep: Any = None
    inner: Any = None  # the transport's own stream, where ``stream`` puts a first item before it

    def close(self) -> None:
        for stream in (self.stream, self.inner):
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        self.keep = None


def started(transport: Any, pipeline: Any, epoch: int, plan: Any, seed: int) -> Prestarted:
    """The pass over ``plan`` from the transport, as the loader would start it after the change;
    in this process (no real workers) its first item is pulled here, so the read is done."""
    copy = pipeline.with_source(pipeline.source.with_plan(epoch, plan))
    keep = transport.ring.ring  # forked workers get a ring of their own; the old one stays mapped
    transport.forget()  # a DataLoader of the copy, forgotten after: no later pass reads the copy
    stream = transport.stream(copy, seed)
    transport.forget()
    if transport.bundled:
        return Prestarted(plan, stream, keep)
    first = next(stream, None)
    return Prestarted(plan, itertools.chain([] if first is None else [first], stream), keep, stream)


__all__ = ["Prestarted", "started"]
