"""``wdsllm.loader``: the DataLoader face — workers, ``set_epoch``, equal batches per rank.

Workers batch inside their processes and send compact batches (the items' tokens, no padding);
the main process collates them into tensors. Sending one sample at a time between processes, or
padded tensors through shared memory, costs far more than the collation.

Batches come out in DataLoader's round-robin order over workers; the loader keeps that order by
itself (a worker's batches are queued until its turn), so the order after a resume is the same
as without one.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Iterator

import torch
from torch.utils.data import DataLoader

from .batching import Batch
from .catalog import open_catalog
from .collate import collate_docs, collate_rows
from .items import ReadOptions
from .pipeline import Config, EndOfWorker, build_pipeline, collate_options, resolve_world, rows_out

log = logging.getLogger(__name__)


#: batches per message from a worker (see pipeline._bundle)
BUNDLE_BATCHES = 16


def _identity(x):
    return x


class Loader:
    """Iterate batches for this rank; call ``set_epoch(e)`` before each epoch (see docs/loader.md)."""

    def __init__(
        self,
        source,
        *,
        num_workers: int = 0,
        prefetch_factor: int | None = 2,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        retry=None,
        cache_dir: str | None = None,
        cache_size: int = 64 << 30,
        on_error: str = "raise",
        multiprocessing_context=None,
        **options,
    ):
        from . import storage

        self.catalog = open_catalog(source)
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.cfg = Config(**options)
        self.num_workers = int(num_workers)
        self.prefetch_factor = prefetch_factor if self.num_workers > 0 else None
        self.persistent_workers = persistent_workers and self.num_workers > 0
        self.pin_memory = pin_memory
        self.multiprocessing_context = multiprocessing_context
        cache = storage.ShardCache(cache_dir, cache_size) if cache_dir else None
        self.read_options = ReadOptions(retry=retry, cache=cache, on_error=on_error)
        self.pipeline = build_pipeline(
            self.catalog, self.cfg, self.rank, self.world_size, self.read_options,
            collate=False, end_marker=True, bundle=BUNDLE_BATCHES if self.num_workers > 0 else 0,
        )
        self.source = self.pipeline.source
        self.collate_options = collate_options(self.cfg, self.catalog)
        self._collate = collate_rows if rows_out(self.cfg, self.catalog) else collate_docs
        self._epoch = 0
        self._epoch_explicit = False
        self._dataloader: DataLoader | None = None
        self._stream: Iterator | None = None  # the endless stream of an infinite loader
        #: the equal-batches decision of the current epoch: dropped batches of this rank etc.
        self.limits = None
        self.dropped_batches = 0
        self.truncated_tokens = 0

    # -- epochs ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shuffle the next iteration uses (as DistributedSampler does).

        Without calls the epoch advances by one after every completed pass.
        """
        self._epoch = int(epoch)
        self._epoch_explicit = True

    @property
    def infinite(self) -> bool:
        return self.cfg.epochs is None or self.cfg.resample or self.cfg.steps_per_epoch is not None

    def __len__(self) -> int:
        if self.cfg.steps_per_epoch is not None:
            return self.cfg.steps_per_epoch
        if self.infinite:
            raise TypeError("an endless loader has no length; pass steps_per_epoch= to give it one")
        limits = self.source.limits(self._epoch, max(1, self.num_workers))
        if limits is not None:
            return limits.per_rank
        from .pipeline import batch_counts

        counts = batch_counts(self.catalog, self.cfg, self._epoch, self.world_size, max(1, self.num_workers))
        if counts is None:
            raise TypeError("the number of batches is unknown without an index")
        return int(counts[self.rank].sum())

    # -- iteration ------------------------------------------------------------------------------
    def _worker_batches(self) -> Iterator:
        """Compact batches and end markers from the workers (or this process)."""
        if self.num_workers == 0:
            return iter(self.pipeline)
        return (item for bundle in self._bundles() for item in bundle)

    def _bundles(self) -> Iterator[list]:
        if self._dataloader is None:
            self._dataloader = DataLoader(
                self.pipeline,
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=_identity,
                prefetch_factor=self.prefetch_factor,
                persistent_workers=self.persistent_workers,
                multiprocessing_context=self.multiprocessing_context,
            )
        return iter(self._dataloader)

    def _ordered(self, raw: Iterator, first_worker: int = 0) -> Iterator[Batch]:
        """Batches in round-robin order over the workers that still have batches."""
        n = max(1, self.num_workers)
        queues = [deque() for _ in range(n)]
        active = list(range(n))
        turn = first_worker % n
        while active:
            if turn not in active:
                turn = min((w for w in active if w > turn), default=active[0])
            while not queues[turn]:
                try:
                    item = next(raw)
                except StopIteration:
                    # DataLoader ended: every remaining queue is drained in order, then done.
                    if all(not q for q in queues):
                        return
                    break
                queues[item.worker].append(item)
            if not queues[turn]:
                active.remove(turn)
                continue
            item = queues[turn].popleft()
            if isinstance(item, EndOfWorker):
                active.remove(turn)
                continue
            yield item
            turn = min((w for w in active if w > turn), default=active[0])

    def _to_tensors(self, batch: Batch) -> dict:
        out = self._collate(batch.items, self.collate_options)
        out["epoch"] = batch.epoch
        self.truncated_tokens += batch.stats.get("truncated_tokens", 0)
        if self.pin_memory and torch.cuda.is_available():
            out = {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
        return out

    def __iter__(self) -> Iterator[dict]:
        if self.infinite:
            return self._iter_infinite()
        return self._iter_epoch()

    def _iter_epoch(self) -> Iterator[dict]:
        epoch = self._epoch
        self.source.set_epoch(epoch)
        self.limits = self.source.limits(epoch, max(1, self.num_workers))
        if self.limits is not None:
            self.dropped_batches = self.limits.dropped_batches
            if self.limits.dropped_batches:
                log.info(
                    "rank %d: epoch %d yields %d batches; %d batches beyond the smallest rank's count are dropped",
                    self.rank, epoch, self.limits.per_rank, self.limits.dropped_batches,
                )
        for batch in self._ordered(self._worker_batches()):
            yield self._to_tensors(batch)
        if not self._epoch_explicit:
            self._epoch = epoch + 1
        self._epoch_explicit = False

    def _iter_infinite(self) -> Iterator[dict]:
        if self._stream is None:
            self.source.set_epoch(self._epoch)
            self._stream = self._ordered(self._worker_batches())
        steps = self.cfg.steps_per_epoch
        produced = 0
        while steps is None or produced < steps:
            try:
                batch = next(self._stream)
            except StopIteration:
                return
            produced += 1
            yield self._to_tensors(batch)


def loader(source, **kwargs) -> Loader:
    """A loader over ``source``; keyword arguments as in docs/loader.md."""
    return Loader(source, **kwargs)
