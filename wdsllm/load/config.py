"""Loader settings: what decides which batches come out, checked once and asked in one place.

``Config`` is the order and batch records (``options.py``) taken together: the options that
decide the batches, and so belong in a resume state. The
questions every stage asks of them (is the stream endless, are batch counts made equal, what does
a worker's stream look like) are answered here and nowhere else. No torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .. import storage
from ..errors import ConfigError, normalize_on_error
from .batching import COUNT_BY_ITEMS, Batcher, BatchingMode, mode_of
from .options import BatchOptions, OrderOptions, ReadingOptions
from .read import ReadOptions
from .sources.protocol import Source
from .stream import StreamSpec, has_lengths

DEFAULT_DOC_BUFFER = 10_000
DEFAULT_ROW_BUFFER_TOKENS = 1 << 22


@dataclass(frozen=True)
class Config(OrderOptions, BatchOptions):
    """The options that decide which batches come out (and so belong in a resume state): the
    order and batch records together, with the questions every stage asks of them."""

    @classmethod
    def of(cls, order: OrderOptions, batch: BatchOptions) -> Config:
        return cls(**vars(order), **vars(batch))

    def as_json(self) -> dict:
        """The settings as plain JSON values (a state's ``config``, which its messages show)."""
        out = dict(vars(self))
        if self.schedule is not None:
            out["schedule"] = self.schedule.to_json()
        return out

    @property
    def mode(self) -> BatchingMode:
        return mode_of(self.batching)

    @property
    def unbatched(self) -> bool:
        """batch_size=None with fixed batching: items one at a time, for your own batching stages."""
        return self.batch_size is None and self.batching == "fixed"

    @property
    def row_len(self) -> int | None:
        """The tokens a row of pack or concat is read with: ``seq_len``, and one more with next-token
        labels (the last token is only the label of the one before it)."""
        return self.seq_len + 1 if self.shift_labels and self.seq_len else self.seq_len

    @property
    def infinite(self) -> bool:
        """Whether the stream never ends: endless epochs, resampling, or a fixed steps_per_epoch
        (whose loop continues into the next epoch's data)."""
        return self.epochs is None or self.resample or self.steps_per_epoch is not None

    def keeps_equal_batches(self, world: int) -> bool:
        """Whether ranks stop every epoch at the same batch count: the option, or its default (with
        more than one rank); a resampled stream has no epochs to count."""
        equal = self.equal_batches if self.equal_batches is not None else world > 1
        return equal and not self.resample

    def endless_by_epochs(self, world: int) -> bool:
        """Whether the loader's endless stream is whole epochs, one pass after another, each cut to
        the equal-batches count as a finite epoch is (so its state resumes, on another rank or
        layout too, wherever a finite one does); else each worker streams on across epochs."""
        return self.infinite and self.keeps_equal_batches(world)

    def can_count(self, catalog: Source) -> bool:
        """Whether the index counts an epoch's batches before reading (what equal batches, len()
        and an elastic resume need): item counts per shard, and lengths where the mode needs them."""
        if catalog.items_per_shard is None:
            return False
        return self.make_batcher().count_by == COUNT_BY_ITEMS or has_lengths(catalog)

    def one_state_for_all(self, catalog: Source, world: int) -> bool:
        """Whether any rank's state resumes every rank (a checkpointer may keep one copy for all):
        ranks yield equal counts that the index can count, which turn one rank's position into
        another's; else a state mid-epoch is its own rank's."""
        return world == 1 or (self.keeps_equal_batches(world) and self.can_count(catalog))

    def check_equal_batches(self, catalog: Source, world: int) -> None:
        """Refuse ``equal_batches=True`` where it cannot be honoured, rather than ignore it."""
        if not self.equal_batches or world == 1:
            return
        if self.resample:
            raise ConfigError(
                "equal_batches=True cannot be honoured with resample=True: a resampled stream draws shards forever "
                "and has no epochs whose batches could be counted; pass steps_per_epoch= to give every rank the "
                "same number of steps per loop"
            )
        if not self.can_count(catalog):
            raise ConfigError(
                "equal_batches=True cannot be honoured: the batches of an epoch cannot be counted before reading "
                "(shards without an index.json with lengths, or raw text without a count sidecar); use an index "
                "(wdsllm pack) or `wdsllm count`, or pass steps_per_epoch="
            )

    def share_unit(self, mode: str) -> int:
        """Items a worker's share is planned in: a full batch where a batch is a number of items
        (fixed batches, buckets of a batch size; the pieces of split documents are items too),
        so that only a rank's last worker ends with a short batch; else 1."""
        if self.batch_size is None or self.make_batcher().count_by != COUNT_BY_ITEMS:
            return 1
        return self.batch_size

    def rows_out(self, catalog: Source) -> bool:
        """Whether batches are rows of a fixed length (packed data, or a mode that makes rows)."""
        return catalog.mode == "packed" or self.mode.rows

    def make_batcher(self) -> Batcher:
        return self.mode.make(self)

    def check(self, catalog: Source) -> None:
        """What the options ask of each other and of the dataset (each number was checked when
        its record was built)."""
        mode = self.mode
        if self.batch_size is None and not self.unbatched and not (self.batching == "bucket" and self.max_tokens):
            raise ConfigError(f"batching={self.batching!r} needs batch_size=")
        if mode.docs_only and catalog.mode != "docs":
            raise ConfigError(
                f"batching={self.batching!r} works on docs-mode datasets; this one is packed (rows are fixed)"
            )
        if mode.needs_seq_len and not self.seq_len:
            raise ConfigError(f"batching={self.batching!r} needs seq_len=")
        if catalog.mode == "packed" and self.max_len is not None:
            raise ConfigError("max_len applies to docs-mode datasets; packed rows have the index's seq_len")
        if self.resample and not catalog.urls:
            raise ConfigError("resample needs at least one shard")

    def resolved(self, catalog: Source) -> Config:
        """Defaults that depend on the dataset filled in: the shuffle buffer (counted in items,
        and a packed row is thousands of tokens, so rows get a smaller count), and an endless
        stream's equal batches, off by default where the epochs cannot be counted (its workers then
        stream on across epochs)."""
        if self.infinite and self.equal_batches is None and not self.resample and not self.can_count(catalog):
            return replace(self, equal_batches=False).resolved(catalog)
        if self.shuffle_buffer is not None:
            return self
        if catalog.mode == "packed" and catalog.index is not None and catalog.index.seq_len:
            buffer = max(64, DEFAULT_ROW_BUFFER_TOKENS // catalog.index.seq_len)
        else:
            buffer = DEFAULT_DOC_BUFFER
        return replace(self, shuffle_buffer=buffer)

    def spec(self, epoch: int, rank: int, world: int, worker: int, workers: int) -> StreamSpec:
        """What decides the stream of (rank, worker) in ``epoch``."""
        max_len, max_len_mode = self.max_len, self.max_len_mode
        if self.mode.pieces_at_seq_len:  # longer documents become seq_len pieces, all kept
            max_len = self.row_len if max_len is None else min(max_len, self.row_len)
            max_len_mode = "split"
        return StreamSpec(
            seed=self.seed,
            epoch=epoch,
            rank=rank,
            world=world,
            worker=worker,
            workers=workers,
            shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer if self.shuffle else 0,
            max_len=max_len,
            max_len_mode=max_len_mode,
            resample=self.resample,
        )


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit arguments, else the initialised torch.distributed group, else RANK/WORLD_SIZE, else (0, 1)."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ConfigError("pass rank= and world_size= together")
        r, w = int(rank), int(world_size)
    else:
        import sys

        dist = sys.modules.get("torch.distributed")  # initialised only if torch was imported
        if dist is not None and dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            r, w = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        else:
            r, w = 0, 1
    if not (0 <= r < w):
        raise ConfigError(f"rank {r} is outside world size {w}")
    return r, w


def read_options(
    retry: storage.RetryPolicy | None,
    cache_dir: str | None,
    cache_size: int,
    on_error: str,
    check_groups: bool = True,
    fetch_process: bool | None = None,
) -> ReadOptions:
    """How shards are read: retry policy, optional local cache, what an unreadable shard does,
    whether every group is checked against its checksum (docs/reliability.md), and whether a fetch
    process downloads remote shards (docs/remote.md)."""
    cache = storage.ShardCache(cache_dir, cache_size) if cache_dir else None
    return ReadOptions(
        retry=retry,
        cache=cache,
        on_error=normalize_on_error(on_error),
        check_groups=check_groups,
        fetch_process=fetch_process,
    )


def reading_options(reading: ReadingOptions) -> ReadOptions:
    """The reading record as the readers take it (the cache opened)."""
    r = reading
    return read_options(r.retry, r.cache_dir, r.cache_size, r.on_error, r.check_groups, r.fetch_process)
