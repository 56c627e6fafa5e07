"""Batchers: turn a worker's shuffled item stream into batches, deterministically.

One module per mode, each a class that keeps the :class:`Batcher` protocol (``protocol``):

- ``fixed``: ``FixedBatcher``, consecutive items, ``batch_size`` per batch (random batches), and
  ``ItemChunker``, items one at a time (``batch_size=None``);
- ``bucket``: ``BucketBatcher``, length-sorted windows cut into batches of a size or a token budget;
- ``pack``: ``PackBatcher``, windows of documents packed into rows by best-fit decreasing;
- ``concat``: ``ConcatBatcher``, the documents concatenated and cut into rows (GPT-style).

``modes`` holds the :data:`MODES` table: a new batching mode is one module and one
:class:`BatchingMode` entry there; the loader asks the entry everything else (what the mode needs
of the dataset, whether it makes rows, how documents reach it).
"""

from .bucket import BucketBatcher, WindowPlan, budget_count
from .concat import ConcatBatcher
from .fixed import FixedBatcher, ItemChunker
from .modes import MODES, BatchingMode, mode_of
from .pack import PackBatcher, best_fit_decreasing, bfd_count
from .protocol import (
    COUNT_BY_ITEMS,
    COUNT_BY_TOKENS,
    COUNT_BY_WINDOWS,
    ArrayLengths,
    Batch,
    Batcher,
    Hint,
    ItemLengths,
    as_item_lengths,
    round_up,
)

__all__ = [
    "COUNT_BY_ITEMS",
    "COUNT_BY_TOKENS",
    "COUNT_BY_WINDOWS",
    "MODES",
    "ArrayLengths",
    "Batch",
    "Batcher",
    "BatchingMode",
    "BucketBatcher",
    "ConcatBatcher",
    "FixedBatcher",
    "Hint",
    "ItemChunker",
    "ItemLengths",
    "PackBatcher",
    "WindowPlan",
    "as_item_lengths",
    "best_fit_decreasing",
    "bfd_count",
    "budget_count",
    "mode_of",
    "round_up",
]
