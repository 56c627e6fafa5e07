"""The registry of batching modes: what the loader asks of a mode besides its Batcher.

A new batching mode is one module with a class that keeps the :class:`~.protocol.Batcher`
protocol and one :class:`BatchingMode` entry in :data:`MODES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from .bucket import BucketBatcher
from .concat import ConcatBatcher
from .fixed import FixedBatcher, ItemChunker
from .pack import PackBatcher
from .protocol import Batcher


@dataclass(frozen=True)
class BatchingMode:
    """What the loader needs to know of a batching mode besides its Batcher."""

    name: str
    make: Callable[[Any], Batcher]  # the Batcher for a load.config.Config (rows of its ``row_len``)
    docs_only: bool = False  # works on documents: a packed dataset's rows are fixed
    needs_seq_len: bool = False
    uses_window: bool = False
    rows: bool = False  # batches are rows of seq_len (documents in rows, with segments)
    boundaries: bool = False  # rows mark their documents' boundaries by default
    pieces_at_seq_len: bool = False  # documents longer than seq_len reach it as seq_len pieces
    hint_keys: frozenset[str] = frozenset()  # the keys of its batcher's resume hints (none: no hints)


def _fixed(cfg: Any) -> Batcher:
    return ItemChunker() if cfg.batch_size is None else FixedBatcher(cfg.batch_size, cfg.drop_last)


def _bucket(cfg: Any) -> Batcher:
    return BucketBatcher(
        cfg.window,
        batch_size=None if cfg.max_tokens else cfg.batch_size,
        max_tokens=cfg.max_tokens,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
        drop_last=cfg.drop_last,
    )


MODES: dict[str, BatchingMode] = {
    m.name: m
    for m in (
        BatchingMode("fixed", _fixed),
        BatchingMode("bucket", _bucket, docs_only=True, uses_window=True, hint_keys=frozenset({"w", "carry", "skip"})),
        BatchingMode(
            "pack",
            lambda cfg: PackBatcher(cfg.window, cfg.row_len, cfg.batch_size, cfg.drop_last),
            docs_only=True,
            needs_seq_len=True,
            uses_window=True,
            rows=True,
            boundaries=True,
            pieces_at_seq_len=True,
            hint_keys=frozenset({"w", "skip"}),
        ),
        BatchingMode(
            "concat",
            lambda cfg: ConcatBatcher(cfg.row_len, cfg.batch_size, cfg.drop_last),
            docs_only=True,
            needs_seq_len=True,
            rows=True,
            hint_keys=frozenset({"i", "lead"}),
        ),
    )
}


def mode_of(name: str) -> BatchingMode:
    try:
        return MODES[name]
    except KeyError:
        raise ConfigError(f"batching must be one of {tuple(MODES)}, not {name!r}") from None
