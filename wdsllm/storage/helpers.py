"""What a reader of remote shards started in this process, stopped when it is done.

A loader that reads remote shards uses helpers that outlive one pass: the block reader threads
(:mod:`.parallel`), the fetch process (:mod:`.offload`) and the next pass's parked spools
(:mod:`.parking`). :func:`release` is what a loader's ``close()`` calls: its parked spools are
closed, and the helpers are stopped once nothing of this process uses them (no block queued or
running, no spool waiting for the fetch process, nothing parked). A later read starts them again.
"""

from __future__ import annotations

from collections.abc import Hashable

from . import offload, parallel, parking


def release(loader: Hashable) -> None:
    """``loader`` reads no more: close what is parked for it, and stop the idle helpers."""
    parking.PARKING.release(loader)
    stop_idle()


def stop_idle() -> None:
    """Stop the fetch process and the block reader threads where nothing uses them."""
    if len(parking.PARKING) or offload.SERVICE.busy():
        return
    offload.SERVICE.stop()
    if parallel.READERS.idle():
        parallel.READERS.stop_threads()
