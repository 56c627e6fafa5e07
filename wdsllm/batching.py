"""Batchers: turn a worker's shuffled item stream into batches, deterministically.

A batcher is a pure function of the stream: batch j is fixed by the items' positions and lengths
and the random key (seed, epoch, rank, worker). That gives three things: the number of batches
can be computed from lengths alone, before reading (equal batches per rank); a stream can resume
at batch j from a position (exact, cheap resumption); and no per-item Python runs.

This module holds the fixed-size batcher; windowed batchers (bucket, pack, concat) follow the
same protocol: ``count(lengths)``, ``start_position(j, lengths)``, ``batches(shuffled, j)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .items import Block, concat_blocks


@dataclass
class Batch:
    """A batch in compact form: the items with their tokens gathered contiguously.

    This is what crosses from DataLoader workers to the main process (small: no padding), where
    ``collate`` turns it into tensors.
    """

    items: Block
    index: int  # batch number within the worker's epoch
    epoch: int
    worker: int
    state: dict = field(default_factory=dict)  # the worker's position after this batch
    stats: dict = field(default_factory=dict)


class FixedBatcher:
    """``batch_size`` consecutive items of the shuffled stream per batch."""

    def __init__(self, batch_size: int, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.batch_size = batch_size
        self.drop_last = drop_last

    def count(self, n_items: int, lengths: np.ndarray | None = None) -> int:
        b = self.batch_size
        return n_items // b if self.drop_last else (n_items + b - 1) // b

    def start_position(self, batch: int, lengths: np.ndarray | None = None) -> int:
        return batch * self.batch_size

    def batches(self, shuffled: Iterator[tuple[int, Block]], first_batch: int = 0) -> Iterator[tuple[int, Block]]:
        """(batch number, items) from batch ``first_batch`` on; the stream must start at its position."""
        b = self.batch_size
        index = first_batch
        pending: list[Block] = []
        have = 0
        for _, block in shuffled:
            if have:
                pending.append(block)
                block = concat_blocks(pending)
                pending, have = [], 0
            full = len(block) // b
            for i in range(full):
                yield index, block.slice(i * b, (i + 1) * b)
                index += 1
            rest = len(block) - full * b
            if rest:
                pending, have = [block.slice(full * b, len(block))], rest
        if have and not self.drop_last:
            yield index, concat_blocks(pending)
