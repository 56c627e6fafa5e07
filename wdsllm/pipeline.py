"""``wdsllm.dataset``: a webdataset.DataPipeline of epoch source -> worker batches -> collate.

Everything a worker does in an epoch is decided by (seed, epoch, rank, worker) and the index, so
the number of batches every (rank, worker) will produce is known before any shard is read. With
``equal_batches`` each rank stops after the same count N, and because each worker knows how many
of the rank's first N batches are its own (DataLoader takes them round-robin), the cap works
inside the workers: a plain ``torch.utils.data.DataLoader`` over this pipeline also yields exactly
N batches per rank, and no rank waits on another.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from . import plan as planmod
from .batching import Batch, BucketBatcher, ConcatBatcher, FixedBatcher, ItemChunker, PackBatcher
from .catalog import Catalog, open_catalog
from .collate import CollateOptions, collate_docs, collate_rows
from .items import ReadOptions
from .transport import RingHolder, send_bundles
from .stream import (
    StreamSpec,
    StreamStats,
    epoch_slices,
    plan_items,
    shuffle_lengths,
    shuffled_items,
    slice_item_counts,
    slice_item_lengths,
)

log = logging.getLogger(__name__)

BATCHINGS = ("fixed", "bucket", "pack", "concat")


@dataclass(frozen=True)
class Config:
    """Loader settings that decide which batches come out (and so belong in a resume state)."""

    batch_size: int | None = 32
    seed: int = 0
    shuffle: bool = True
    shuffle_buffer: int | None = None  # items per shuffle block; None: 10,000 documents or ~4M tokens of rows
    epochs: int | None = 1  # None: stream epoch after epoch forever
    resample: bool = False
    steps_per_epoch: int | None = None
    equal_batches: bool | None = None  # default: True when world_size > 1
    drop_last: bool = False
    max_len: int | None = None
    max_len_mode: str = "split"
    batching: str = "fixed"
    window: int = 10_000  # bucket/pack: items per window
    max_tokens: int | None = None  # bucket: padded tokens per batch instead of batch_size
    seq_len: int | None = None  # pack/concat: row length
    pad_id: int | None = None
    pad_to_multiple_of: int | None = None
    boundaries: bool = False
    max_segments: int | None = None
    docs: bool = True  # batches carry `docs` (packed rows: every row's documents); output only

    @property
    def unbatched(self) -> bool:
        """batch_size=None with fixed batching: items one at a time, for your own batching stages."""
        return self.batch_size is None and self.batching == "fixed"

    def check(self, catalog: Catalog) -> None:
        if self.batching == "bucket" and self.max_tokens is not None:
            if self.max_tokens < 1:
                raise ValueError("max_tokens must be positive")
        elif self.unbatched:
            pass
        elif self.batch_size is None or self.batch_size < 1:
            raise ValueError("batch_size must be a positive integer")
        if self.batching in ("bucket", "pack", "concat") and catalog.mode != "docs":
            raise ValueError(f"batching={self.batching!r} works on docs-mode datasets; this one is packed (rows are fixed)")
        if self.batching in ("pack", "concat") and not self.seq_len:
            raise ValueError(f"batching={self.batching!r} needs seq_len=")
        if self.batching in ("bucket", "pack") and self.window < 1:
            raise ValueError("window must be positive")
        if self.max_len_mode not in ("split", "truncate"):
            raise ValueError("max_len_mode must be 'split' or 'truncate'")
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {BATCHINGS}")
        if catalog.mode == "packed" and self.max_len is not None:
            raise ValueError("max_len applies to docs-mode datasets; packed rows have the index's seq_len")
        if self.resample and not catalog.urls:
            raise ValueError("resample needs at least one shard")


DEFAULT_DOC_BUFFER = 10_000
DEFAULT_ROW_BUFFER_TOKENS = 1 << 22


def resolve_config(cfg: Config, catalog: Catalog) -> Config:
    """Fill in defaults that depend on the dataset (the shuffle buffer is counted in items, and a
    packed row is thousands of tokens, so rows get a smaller count)."""
    if cfg.shuffle_buffer is None:
        if catalog.mode == "packed" and catalog.index is not None and catalog.index.seq_len:
            buffer = max(64, DEFAULT_ROW_BUFFER_TOKENS // catalog.index.seq_len)
        else:
            buffer = DEFAULT_DOC_BUFFER
        cfg = replace(cfg, shuffle_buffer=buffer)
    return cfg


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit arguments, else the initialised torch.distributed group, else RANK/WORLD_SIZE, else (0, 1)."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError("pass rank= and world_size= together")
        r, w = int(rank), int(world_size)
    else:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            r, w = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        else:
            r, w = 0, 1
    if not (0 <= r < w):
        raise ValueError(f"rank {r} is outside world size {w}")
    return r, w


def make_batcher(cfg: Config):
    if cfg.batching == "bucket":
        return BucketBatcher(cfg.window, batch_size=None if cfg.max_tokens else cfg.batch_size, max_tokens=cfg.max_tokens,
                             pad_to_multiple_of=cfg.pad_to_multiple_of, drop_last=cfg.drop_last)
    if cfg.batching == "pack":
        return PackBatcher(cfg.window, cfg.seq_len, cfg.batch_size, cfg.drop_last)
    if cfg.batching == "concat":
        return ConcatBatcher(cfg.seq_len, cfg.batch_size, cfg.drop_last)
    if cfg.unbatched:
        return ItemChunker()
    return FixedBatcher(cfg.batch_size, cfg.drop_last)


def rows_out(cfg: Config, catalog: Catalog) -> bool:
    """Whether batches are rows of a fixed length (packed data, or pack/concat batching)."""
    return catalog.mode == "packed" or cfg.batching in ("pack", "concat")


def collate_options(cfg: Config, catalog: Catalog) -> CollateOptions:
    tok = catalog.index.tokenizer if catalog.index else None
    pad = cfg.pad_id
    if pad is None:
        pad = (tok.pad_id if tok and tok.pad_id is not None else (tok.eos_id if tok and tok.eos_id is not None else 0))
    max_seg = cfg.max_segments
    seq_len = cfg.seq_len if cfg.batching in ("pack", "concat") else (catalog.index.seq_len if catalog.index else None)
    if max_seg is None:
        if catalog.mode == "packed" and catalog.index is not None:
            max_seg = (catalog.index.packed or {}).get("max_row_segments") or None
        elif cfg.batching in ("pack", "concat"):
            max_seg = seq_len  # every document has at least one token: a safe fixed bound
    return CollateOptions(
        pad_id=pad,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
        boundaries=cfg.boundaries or cfg.batching == "pack",
        seq_len=seq_len,
        max_segments=max_seg,
        docs=cfg.docs,
    )


# ----------------------------------------------------------------------------------------------
# Counting


def spec_for(cfg: Config, epoch: int, rank: int, world: int, worker: int, workers: int) -> StreamSpec:
    max_len = cfg.max_len
    if cfg.batching == "pack":  # longer documents become seq_len pieces, all kept
        max_len = cfg.seq_len if max_len is None else min(max_len, cfg.seq_len)
    return StreamSpec(
        seed=cfg.seed,
        epoch=epoch,
        rank=rank,
        world=world,
        worker=worker,
        workers=workers,
        shuffle=cfg.shuffle,
        shuffle_buffer=cfg.shuffle_buffer if cfg.shuffle else 0,
        max_len=max_len,
        max_len_mode="split" if cfg.batching == "pack" else cfg.max_len_mode,
        resample=cfg.resample,
    )


def slices_for(catalog: Catalog, cfg: Config, spec: StreamSpec, plan=None) -> list:
    """The slices (rank, worker) reads in spec.epoch: the normal plan, or a remainder plan."""
    if plan is None:
        return epoch_slices(catalog, spec)
    return plan.slices_for(catalog, cfg, spec.rank, spec.world, spec.worker, spec.workers)


def worker_batch_count(catalog: Catalog, cfg: Config, spec: StreamSpec, plan=None) -> int | None:
    """Batches (rank, worker) yields in the epoch, from the index alone; None if unknown."""
    slices = slices_for(catalog, cfg, spec, plan)
    batcher = make_batcher(cfg)
    counts = slice_item_counts(catalog, slices, spec)
    if counts is None:
        return None
    lengths = None
    if batcher.needs_lengths:
        lengths = slice_item_lengths(catalog, slices, spec)
        if lengths is None:
            return None
        lengths = shuffle_lengths(lengths, spec)
    return batcher.count(int(sum(counts)), lengths)


def batch_counts(catalog: Catalog, cfg: Config, epoch: int, world: int, workers: int, plan=None) -> np.ndarray | None:
    """[world, workers] batch counts for a finite epoch, or None when the index cannot say."""
    out = np.zeros((world, max(1, workers)), np.int64)
    for r in range(world):
        for w in range(max(1, workers)):
            c = worker_batch_count(catalog, cfg, spec_for(cfg, epoch, r, world, w, max(1, workers)), plan)
            if c is None:
                return None
            out[r, w] = c
    return out


def round_robin_share(counts: np.ndarray, total: int) -> np.ndarray:
    """How many of the first ``total`` batches, taken round-robin over workers that still have
    batches (DataLoader's order), come from each worker."""
    counts = np.asarray(counts, np.int64)
    if total >= counts.sum():
        return counts.copy()
    lo, hi = 0, int(counts.max())
    while lo < hi:  # the most full rounds that fit
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, mid).sum() <= total:
            lo = mid
        else:
            hi = mid - 1
    share = np.minimum(counts, lo)
    rest = total - int(share.sum())
    for w in np.nonzero(counts > lo)[0][:rest]:
        share[w] += 1
    return share


@dataclass
class EpochLimits:
    """The equal-batches decision for one epoch."""

    per_rank: int  # batches every rank yields
    per_worker: np.ndarray  # [workers] of this rank's share
    dropped_batches: int  # this rank's batches beyond per_rank
    dropped_items: int | None = None


def epoch_limits(catalog: Catalog, cfg: Config, epoch: int, rank: int, world: int, workers: int, plan=None) -> EpochLimits | None:
    counts = batch_counts(catalog, cfg, epoch, world, workers, plan)
    if counts is None:
        return None
    per_rank = int(counts.sum(axis=1).min())
    mine = counts[rank]
    share = round_robin_share(mine, per_rank)
    return EpochLimits(per_rank=per_rank, per_worker=share, dropped_batches=int(mine.sum()) - per_rank)


# ----------------------------------------------------------------------------------------------
# Stages


@dataclass
class EpochTask:
    """What a worker streams: one epoch of its plan, possibly resuming and possibly capped."""

    spec: StreamSpec
    first_batch: int = 0
    limit: int | None = None  # batches this worker may yield this epoch
    plan: object = None  # a resume.RemainderPlan replacing the normal epoch plan
    hint: dict | None = None  # the batcher's own note of where first_batch starts (same layout)


@dataclass
class EndOfWorker:
    """Marks the end of a worker's batches (the loader uses it to keep the round-robin order)."""

    worker: int
    epoch: int
    stats: dict = field(default_factory=dict)


class EpochSource(IterableDataset):
    """First stage: knows the rank, finds its worker, reads the current epoch, emits EpochTasks.

    The epoch lives in shared memory so that ``set_epoch`` reaches persistent DataLoader workers.
    """

    def __init__(self, catalog: Catalog, cfg: Config, rank: int, world: int):
        super().__init__()
        self.catalog = catalog
        self.cfg = cfg
        self.rank = rank
        self.world = world
        self._epoch = mp.get_context().Value("q", 0, lock=False)
        self.resume: dict[int, tuple] = {}  # worker -> (epoch, first batch, hint) for the next iteration
        self.plans: dict = {}  # epoch -> resume.RemainderPlan (an elastic resume's remainder)
        self.end_marker = False
        self._limits_cache: dict = {}

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = int(epoch)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_limits_cache"] = {}
        return state

    def limits(self, epoch: int, workers: int) -> EpochLimits | None:
        key = (epoch, workers)
        if key not in self._limits_cache:
            cfg = self.cfg
            equal = cfg.equal_batches if cfg.equal_batches is not None else self.world > 1
            finite = cfg.epochs is not None and not cfg.resample and cfg.steps_per_epoch is None
            limits = None
            if finite and equal:
                limits = epoch_limits(self.catalog, cfg, epoch, self.rank, self.world, workers, self.plans.get(epoch))
                if limits is None:
                    log.warning("equal_batches needs an index with counts; ranks may yield different numbers of batches")
            self._limits_cache = {key: limits}
        return self._limits_cache[key]

    def __iter__(self) -> Iterator[EpochTask]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.tasks(worker, workers)

    def tasks(self, worker: int, workers: int) -> Iterator[EpochTask]:
        """The tasks of DataLoader worker ``worker`` of ``workers`` (what ``__iter__`` yields there)."""
        cfg = self.cfg
        epoch = self.epoch
        first_batch, hint = 0, None
        if worker in self.resume:
            epoch, first_batch, hint = (tuple(self.resume[worker]) + (None,))[:3]
        infinite = cfg.epochs is None or cfg.steps_per_epoch is not None
        while True:
            spec = spec_for(cfg, epoch, self.rank, self.world, worker, workers)
            limits = self.limits(epoch, workers)
            limit = int(limits.per_worker[worker]) if limits is not None else None
            yield EpochTask(spec=spec, first_batch=first_batch, limit=limit, plan=self.plans.get(epoch), hint=hint)
            if not infinite:
                break
            epoch += 1
            first_batch, hint = 0, None


def _epoch_batches(tasks: Iterator[EpochTask], catalog: Catalog, cfg: Config, read: ReadOptions, end_marker: bool,
                   shared: bool = False) -> Iterator:
    """Second stage: read, shuffle and batch each task's stream (runs inside a worker).

    A batch made in a DataLoader worker is sent to the main process, so it gets its own compact
    token buffer: here, or with ``shared`` in ``transport.send_bundles``, which compacts into
    shared memory."""
    batcher = make_batcher(cfg)
    last = None
    stats = StreamStats()
    compact = get_worker_info() is not None and not shared

    def emit(spec: StreamSpec, index: int, items, hint, refill: bool = False) -> Batch:
        batch = Batch(
            items=items.compact() if compact else items,
            index=index,
            epoch=spec.epoch,
            worker=spec.worker,
            hint=hint,
        )
        if stats.truncated_tokens or stats.skipped_shards or refill:  # most batches have nothing to report
            batch.stats = {"truncated_tokens": stats.truncated_tokens, "skipped_shards": stats.skipped_shards, "refilled": int(refill)}
            stats.truncated_tokens = 0
            stats.skipped_shards = []
        return batch

    for task in tasks:
        spec = task.spec
        last = spec
        if task.limit is not None and task.first_batch >= task.limit:
            continue
        if spec.resample:
            slices = _resampled_slices(catalog, spec)
        else:
            slices = slices_for(catalog, cfg, spec, task.plan)
        lengths = None
        if batcher.needs_lengths and not spec.resample and task.hint is None:
            lengths = slice_item_lengths(catalog, slices, spec)
            if lengths is not None:
                lengths = shuffle_lengths(lengths, spec)
        start = batcher.start_position(task.first_batch, lengths, task.hint)
        failed: set[str] = set()

        def blocks_from(position: int, slices=slices, spec=spec):
            return plan_items(catalog, slices, spec, start=position, options=read, stats=stats)

        index = task.first_batch
        for index, items, hint in batcher.batches(shuffled_items(blocks_from, spec, start=start), task.first_batch, spec, lengths, task.hint):
            if task.limit is not None and index >= task.limit:
                break
            failed.update(stats.skipped_shards)
            if cfg.unbatched:  # a chunk of single items: `index` counts items
                if task.limit is not None and index + len(items) > task.limit:
                    items = items.slice(0, task.limit - index)
                yield emit(spec, index, items, hint)
                index += len(items)
                continue
            yield emit(spec, index, items, hint)
            index += 1
        failed.update(stats.skipped_shards)
        if task.limit is not None and index < task.limit and failed:
            yield from _refill(catalog, batcher, slices, spec, read, stats, failed, index, task.limit, emit)
    if end_marker and last is not None:
        yield EndOfWorker(worker=last.worker, epoch=last.epoch,
                          stats={"truncated_tokens": stats.truncated_tokens, "skipped_shards": stats.skipped_shards})


def _refill(catalog, batcher, slices, spec, read, stats, failed, index, limit, emit):
    """Top up a worker that lost shards (on_error='skip') to its share of the equal batch count.

    Every rank must take part in every step, so a short worker repeats its own readable documents
    of the epoch (logged, counted in ``loader.refilled_batches``) rather than end early and leave
    the other ranks waiting in a collective.
    """
    readable = [sl for sl in slices if catalog.urls[sl.shard] not in failed]
    log.warning("worker %d lost %d shard(s); repeating its other documents for %d batch(es) to keep batch counts equal",
                spec.worker, len(failed), limit - index)
    while index < limit:
        made = False

        def blocks_from(position: int):
            return plan_items(catalog, readable, spec, start=position, options=read, stats=stats)

        for _, items, _ in batcher.batches(shuffled_items(blocks_from, spec, start=0), 0, spec, None, None):
            if index >= limit:
                return
            made = True
            yield emit(spec, index, items, None, refill=True)
            index += 1
        if not made:
            raise RuntimeError(f"worker {spec.worker} of rank {spec.rank} has no readable shard left to fill its batches; "
                               "the ranks cannot keep equal batch counts")


#: tokens per DataLoader message at most (unless one batch holds more)
BUNDLE_TOKENS = 1 << 20


def _bundle(batches: Iterator, max_batches: int, max_tokens: int) -> Iterator[list]:
    """Lists of consecutive batches: one DataLoader message per list instead of per batch.

    DataLoader's per-message cost (queues, pickling threads, wake-ups) is several hundred
    microseconds; a bundle amortises it. The first bundle holds one batch so the first batch
    arrives as soon as it is made. A bundle holds at most ``max_tokens`` tokens unless one batch
    alone holds more (so that it fits a slot of the worker's token ring, transport.py).
    """
    bundle: list = []
    tokens = 0
    limit = 1
    for batch in batches:
        size = batch.items.n_tokens if isinstance(batch, Batch) else 0
        if bundle and tokens + size > max_tokens:
            yield bundle
            bundle, tokens, limit = [], 0, max_batches
        bundle.append(batch)
        tokens += size
        if len(bundle) >= limit:
            yield bundle
            bundle, tokens, limit = [], 0, max_batches
    if bundle:
        yield bundle


def _resampled_slices(catalog: Catalog, spec: StreamSpec):
    """An endless with-replacement stream of whole shards for (rank, worker)."""
    drawn = 0
    while True:
        for shard in planmod.resampled_shards(
            len(catalog.urls), seed=spec.seed, epoch=spec.epoch, rank=spec.rank, worker=spec.worker, start=drawn, count=256
        ):
            yield planmod.Slice(int(shard))
        drawn += 256


def _items_one_by_one(batches: Iterator, rows: bool) -> Iterator[dict]:
    """Third stage for batch_size=None: each document (or row) as its own sample.

    A chunk's tokens are converted to int64 once and handed out as slices, so the cost per item
    is a slice and a dict: composing your own batching stage stays cheap.
    """
    name = "row" if rows else "doc"
    for batch in batches:
        if isinstance(batch, EndOfWorker):
            continue
        items = batch.items
        if not len(items):
            continue
        lo, hi = int(items.starts.min()), int((items.starts + items.lengths).max())
        if hi - lo <= 2 * int(items.lengths.sum()):
            # the chunk's items lie together in their buffer (a shuffle block is a permutation of
            # consecutive items): convert that span once and slice it, no gather
            tokens = torch.from_numpy(items.tokens[lo:hi].astype(np.int64))
            firsts = items.starts - lo
        else:
            tokens = torch.from_numpy(items.gather_tokens().astype(np.int64))
            firsts = np.cumsum(items.lengths) - items.lengths
        bounds = zip(firsts.tolist(), (firsts + items.lengths).tolist())
        epoch = batch.epoch
        if items.pieces is None:
            for (a, b), item in zip(bounds, items.ids.tolist()):
                yield {"input_ids": tokens[a:b], name: item, "epoch": epoch}
        else:
            for (a, b), item, piece in zip(bounds, items.ids.tolist(), items.pieces.tolist()):
                yield {"input_ids": tokens[a:b], name: item, "piece": piece, "epoch": epoch}


def _collate(batches: Iterator, rows: bool, opts: CollateOptions) -> Iterator[dict]:
    """Third stage: compact batches to dicts of tensors."""
    fn = collate_rows if rows else collate_docs
    for batch in batches:
        if isinstance(batch, EndOfWorker):
            continue
        out = fn(batch.items, opts)
        out["epoch"] = batch.epoch
        yield out


class WdsPipeline(wds.DataPipeline):
    """A webdataset.DataPipeline that also exposes ``set_epoch`` and what the loader needs."""

    source: EpochSource

    def set_epoch(self, epoch: int) -> None:
        self.source.set_epoch(epoch)

    def worker_iter(self, worker: int, workers: int) -> Iterator:
        """What DataLoader worker ``worker`` of ``workers`` would yield, run in this process.

        Lets tests and tools check distribution semantics for any rank x worker layout in one
        process (ranks are explicit; workers are simulated here).
        """
        source = self.invoke(lambda: self.source.tasks(worker, workers))
        for step in self.pipeline[1:]:
            source = self.invoke(step, source)
        return source


def build_pipeline(
    catalog: Catalog, cfg: Config, rank: int, world: int, read: ReadOptions, *, collate: bool, end_marker: bool, bundle: int = 0,
    ring: RingHolder | None = None,
) -> WdsPipeline:
    cfg.check(catalog)
    # Packed shards: what each row holds is worked out only as far as the batches show it.
    read = replace(read, row_docs=cfg.docs, segments=cfg.boundaries)
    source = EpochSource(catalog, cfg, rank, world)
    stages = [source, wds.filters.pipelinefilter(_epoch_batches)(catalog, cfg, read, end_marker, shared=bool(bundle))]
    if bundle:
        stages.append(wds.filters.pipelinefilter(_bundle)(bundle, BUNDLE_TOKENS))
        stages.append(wds.filters.pipelinefilter(send_bundles)(ring or RingHolder()))
    if collate and cfg.unbatched:
        stages.append(wds.filters.pipelinefilter(_items_one_by_one)(rows_out(cfg, catalog)))
    elif collate:
        stages.append(wds.filters.pipelinefilter(_collate)(rows_out(cfg, catalog), collate_options(cfg, catalog)))
    pipe = WdsPipeline(*stages)
    pipe.source = source
    pipe.catalog = catalog
    pipe.cfg = cfg
    return pipe


def dataset(
    source,
    *,
    batch_size: int = 32,
    seed: int = 0,
    shuffle: bool = True,
    shuffle_buffer: int | None = None,
    epochs: int | None = 1,
    resample: bool = False,
    steps_per_epoch: int | None = None,
    equal_batches: bool | None = None,
    drop_last: bool = False,
    max_len: int | None = None,
    max_len_mode: str = "split",
    batching: str = "fixed",
    window: int = 10_000,
    max_tokens: int | None = None,
    seq_len: int | None = None,
    pad_id: int | None = None,
    pad_to_multiple_of: int | None = None,
    boundaries: bool = False,
    max_segments: int | None = None,
    docs: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    retry=None,
    cache_dir: str | None = None,
    cache_size: int = 64 << 30,
    on_error: str = "raise",
) -> WdsPipeline:
    """A webdataset.DataPipeline that yields collated batches (dicts of tensors).

    ``source`` is a dataset directory or URL holding index.json, the URL of an index.json, or
    shard URLs / brace patterns. See docs/loader.md for every option and guarantee.
    """
    catalog = open_catalog(source, retry=retry)
    r, w = resolve_world(rank, world_size)
    cfg = Config(
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        shuffle_buffer=shuffle_buffer,
        epochs=epochs,
        resample=resample,
        steps_per_epoch=steps_per_epoch,
        equal_batches=equal_batches,
        drop_last=drop_last,
        max_len=max_len,
        max_len_mode=max_len_mode,
        batching=batching,
        window=window,
        max_tokens=max_tokens,
        seq_len=seq_len,
        pad_id=pad_id,
        pad_to_multiple_of=pad_to_multiple_of,
        boundaries=boundaries,
        max_segments=max_segments,
        docs=docs,
    )
    cfg = resolve_config(cfg, catalog)
    read = read_options(retry, cache_dir, cache_size, on_error)
    return build_pipeline(catalog, cfg, r, w, read, collate=True, end_marker=False)


def read_options(retry, cache_dir: str | None, cache_size: int, on_error: str) -> ReadOptions:
    """How shards are read: retry policy, optional local cache, and what an unreadable shard does."""
    from . import storage

    if on_error not in ("raise", "skip"):
        raise ValueError("on_error must be 'raise' or 'skip'")
    cache = storage.ShardCache(cache_dir, cache_size) if cache_dir else None
    return ReadOptions(retry=retry, cache=cache, on_error=on_error)
