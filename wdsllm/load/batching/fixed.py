"""Fixed-size batches: ``batch_size`` consecutive items of the shuffled stream, or items one at a
time (``batch_size=None``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ConfigError
from ..block import Block, concat_blocks
from .protocol import COUNT_BY_ITEMS, Hint, ItemLengths, batches_of

if TYPE_CHECKING:
    from ..stream import StreamSpec


class FixedBatcher:
    """``batch_size`` consecutive items of the shuffled stream per batch."""

    needs_lengths = False
    count_by = COUNT_BY_ITEMS

    def __init__(self, batch_size: int, drop_last: bool = False):
        if batch_size < 1:
            raise ConfigError("batch_size must be at least 1")
        self.batch_size = batch_size
        self.drop_last = drop_last

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None = None) -> int:
        return batches_of(n_items, self.batch_size, self.drop_last)

    def lower_bound(self, items: np.ndarray, tokens: np.ndarray | None, longest: int) -> np.ndarray:
        """The count itself: it needs only the items."""
        return batches_of(np.asarray(items, np.int64), self.batch_size, self.drop_last)

    def start_position(self, batch: int, lengths: np.ndarray | None = None, hint: dict | None = None) -> int:
        return batch * self.batch_size

    def handing(self) -> FixedBatcher:
        return FixedBatcher(self.batch_size, drop_last=True)

    def tail(self, lengths: np.ndarray, spec: StreamSpec) -> tuple[np.ndarray, int]:
        n = len(lengths)
        return np.arange(n - n % self.batch_size, n, dtype=np.int64), 0

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        """The shuffled-stream positions of each batch's items, from lengths alone."""
        n, b = len(lengths), self.batch_size
        for a in range(0, n, b):
            if self.drop_last and a + b > n:
                return
            yield np.arange(a, min(n, a + b))

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_batch: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, dict | None]]:
        """(batch number, items, resume hint) from batch ``first_batch``; ``shuffled`` starts at
        its position. The hint says where the next batch starts, so a resume needs no replanning
        (fixed batches need none)."""
        b = self.batch_size
        index = first_batch
        pending: Block | None = None
        for _, block in shuffled:
            if pending is not None:
                # complete the pending batch from the head of this block; join nothing more
                need = b - len(pending)
                head = block.slice(0, need)
                pending = concat_blocks([pending, head])
                block = block.slice(len(head), len(block))
                if len(pending) < b:
                    continue
                yield index, pending, None
                index += 1
                pending = None
            full = len(block) // b
            for i in range(full):
                yield index, block.slice(i * b, (i + 1) * b), None
                index += 1
            if len(block) > full * b:
                pending = block.slice(full * b, len(block))
        if pending is not None and len(pending) and not self.drop_last:
            yield index, pending, None


class ItemChunker:
    """batch_size=None: items one at a time. Counts and positions are per item (a batch of one),
    but items travel in chunks of the shuffled stream's blocks, never one Python object each."""

    needs_lengths = False
    count_by = COUNT_BY_ITEMS

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None = None) -> int:
        return n_items

    def lower_bound(self, items: np.ndarray, tokens: np.ndarray | None, longest: int) -> np.ndarray:
        return np.asarray(items, np.int64).copy()

    def start_position(self, item: int, lengths: np.ndarray | None = None, hint: dict | None = None) -> int:
        return item

    def handing(self) -> ItemChunker:
        return self

    def tail(self, lengths: np.ndarray, spec: StreamSpec) -> tuple[np.ndarray, int]:
        return np.zeros(0, np.int64), 0

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        for i in range(len(lengths)):
            yield np.array([i])

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_item: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, None]]:
        """(index of the chunk's first item, chunk)."""
        index = first_item
        for _, block in shuffled:
            if len(block):
                yield index, block, None
                index += len(block)
