"""The Batcher protocol and what every batching mode shares: item lengths as counting needs
them, the compact batch that crosses from workers, and the small helpers of the modes.

Every batcher is a pure function of the items' lengths and the random key (seed, epoch, rank,
worker): which items form batch j, and in what order batches come, never depends on anything
else. That gives three things at once:

- the number of batches can be computed from ``lengths.npy`` before any shard is read, so every
  rank can stop at the same count (equal batches, even for token budgets);
- a stream can be resumed at batch j by re-running the plan over lengths and reading only the
  window(s) that batch j needs;
- the work is numpy over index arrays, never Python per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import plan as planmod
from ..block import Block, windows

if TYPE_CHECKING:
    from ..stream import StreamSpec


#: A resume hint: the batcher's own note of where a worker's next batch starts (small, JSON-able)
Hint = dict


class ItemLengths(Protocol):
    """A stream's item lengths as far as counting needs them, without holding them: their sum,
    and each window's lengths. Counts by window need only each window's *multiset* of lengths
    (every windowed batcher sorts its window first), so a window may come in any order; this is
    what lets a count read lengths.npy in plan order, a window at a time, without a shuffle."""

    def total(self) -> int:
        """The items' tokens."""
        ...

    def windows(self, size: int) -> Iterator[np.ndarray]:
        """The lengths of items [i*size, (i+1)*size) of the shuffled stream, for i = 0, 1, ..."""
        ...


class ArrayLengths:
    """ItemLengths of lengths held in an array (in shuffled-stream order)."""

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths

    def total(self) -> int:
        return int(np.sum(self.lengths, dtype=np.int64))

    def windows(self, size: int) -> Iterator[np.ndarray]:
        for a in range(0, len(self.lengths), size):
            yield self.lengths[a : a + size]


def as_item_lengths(lengths: np.ndarray | ItemLengths | None) -> ItemLengths | None:
    return ArrayLengths(lengths) if isinstance(lengths, np.ndarray) else lengths


#: what a batcher's count needs of a stream: its number of items, its tokens, or its windows
COUNT_BY_ITEMS, COUNT_BY_TOKENS, COUNT_BY_WINDOWS = "items", "tokens", "windows"


class Batcher(Protocol):
    """Turns a worker's shuffled item stream into batches; a pure function of lengths and the key.

    ``count``, ``start_position`` and ``dry_batches`` work from the items' lengths alone (in
    shuffled-stream order), so counts are known and positions found without reading a token;
    ``batches`` does the same work on the items themselves, and must agree with them exactly.
    """

    #: whether start_position needs the items' lengths (else the number of items suffices)
    needs_lengths: bool
    #: what ``count`` needs: COUNT_BY_ITEMS (n_items), COUNT_BY_TOKENS (lengths.total()) or
    #: COUNT_BY_WINDOWS (lengths.windows(window))
    count_by: str

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None) -> int:
        """Batches the stream of ``n_items`` items (of these lengths) makes: the one counting
        formula of the mode, which equal batches, ``len``, stats and resumption all use."""
        ...

    def lower_bound(self, items: np.ndarray, tokens: np.ndarray | None, longest: int) -> np.ndarray:
        """Lower bounds on ``count`` for streams of ``items`` items holding ``tokens`` tokens
        (elementwise over arrays of shares; None: tokens unknown, every item holds at least one),
        whose longest item holds ``longest`` tokens: what is known before any pass over lengths."""
        ...

    def start_position(self, batch: int, lengths: np.ndarray | None, hint: Hint | None = None) -> int:
        """The shuffled-stream position to start reading at to produce batch ``batch``."""
        ...

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        """The shuffled-stream positions of each batch's items, from lengths alone."""
        ...

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_batch: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, Hint | None]]:
        """(batch number, items, hint for the batch after it) from batch ``first_batch`` on;
        ``shuffled`` starts at ``start_position(first_batch, ...)``."""
        ...

    def handing(self) -> Batcher:
        """This mode as a worker that hands its tail to its rank's last worker runs it: its full
        batches only (so that a rank ends its epoch with one short batch, not one per worker)."""
        ...

    def tail(self, lengths: np.ndarray, spec: StreamSpec) -> tuple[np.ndarray, int]:
        """(the shuffled-stream positions of the items that ``handing()``'s batches leave out,
        ascending; the tokens of the first of them that those batches already hold)."""
        ...


@dataclass(slots=True)
class Batch:
    """A batch in compact form: the items with their tokens gathered contiguously.

    This is what crosses from DataLoader workers to the main process (small: no padding), where
    ``collate`` turns it into tensors.
    """

    items: Block
    index: int  # batch number within the worker's epoch
    epoch: int
    worker: int
    hint: dict | None = None  # the batcher's resume hint: where the worker's next batch starts
    stats: dict = field(default_factory=dict)
    mix: Any = None  # a mixture's [sources, 2] tokens and items of this batch (counted in the worker)
    #: one of a worker's epoch-final batches, made after its item stream ended: the loader holds it
    #: and re-batches it with the other workers' (``load/tails.py``); the loader's merged batches too
    tail: bool = False


def left_out(handing: Batcher, lengths: np.ndarray, spec: StreamSpec) -> tuple[np.ndarray, int]:
    """``Batcher.tail`` of a mode whose batches hold whole items: the positions no batch of
    ``handing`` (the mode's ``handing()``) holds, from its batches on lengths alone."""
    unused = np.ones(len(lengths), bool)
    for part in handing.dry_batches(lengths, spec):
        unused[part] = False  # a mask, not setdiff1d: that sorts or hashes every position
    return np.flatnonzero(unused).astype(np.int64, copy=False), 0


def batches_of(n: int, b: int, drop_last: bool) -> int:
    """Batches of ``b`` that ``n`` things make (the last one short, or dropped)."""
    return n // b if drop_last else (n + b - 1) // b


def round_up(n: Any, multiple: int | None) -> Any:
    """``n`` (an int or an array) rounded up to a multiple (unchanged without one)."""
    return n if not multiple else (n + multiple - 1) // multiple * multiple


def item_windows(shuffled: Iterable[tuple[int, Block]], size: int) -> Iterator[Block]:
    """Windows of exactly ``size`` items over a shuffled stream of (position, block)."""
    return windows((block for _, block in shuffled), size)


def batch_order_rng(spec: StreamSpec, window: int) -> np.random.Generator:
    """The random order of the batches of window ``window`` of (seed, epoch, rank, worker)."""
    return planmod.rng(spec.seed, planmod.STREAM_BATCH_ORDER, spec.epoch, spec.rank, spec.worker, window)
