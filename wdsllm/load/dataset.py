"""``wdsllm.dataset``: a webdataset.DataPipeline of epoch source -> worker batches -> collate.

The first stage (``EpochSource``) knows the rank, finds its DataLoader worker and says which
epoch, where to resume and how many batches the worker may yield (``counts.epoch_limits``); the
second reads, shuffles and batches that worker's stream; the third collates. A plain
``torch.utils.data.DataLoader`` over this pipeline keeps every guarantee (see counts.py);
``wdsllm.loader`` adds bundled transfer, the round-robin order and ``state_dict``.
"""

from __future__ import annotations

import copy
import functools
import logging
import multiprocessing as mp
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import ConfigError, ShardError, StateError, WdsllmError
from ..format.tar import changed_file
from ..observe.report import timed_reads
from . import resume as resumemod
from . import state as statemod
from .batching import Batch
from .collate import CollateOptions, assemble
from .config import Config, reading_options, resolve_world
from .counts import EpochLimits, EpochPlan, WorkerLimit, epoch_limits
from .guard import refuse_rewrapping
from .handoff import StreamSlices, batcher_for, stream_slices
from .holes import LOST_KEY, HoleCut, lost_batches, with_lost, without_lost
from .layout import resolve_layout
from .marks import MARK_KEY, TaskMarks, batcher_hint
from .mixstats import mix_counts
from .options import (
    BatchOptions,
    FaceOptions,
    LayoutOptions,
    OrderOptions,
    RawTextSource,
    ReadingOptions,
    split_options,
)
from .plan import count_ahead, resampled_slices
from .raw import open_raw
from .read import ReadOptions
from .sources.open import open_source
from .sources.protocol import Source
from .stream import (
    PlanLabels,
    StreamSpec,
    StreamStats,
    block_size,
    counts_known,
    plan_labels,
    read_plan_stream,
    shuffle_lengths,
    shuffled_items,
    slice_item_lengths,
)
from .tails import StreamEnd, merges_tails, worker_batcher
from .transport import BUNDLE_TOKENS, RingHolder, bundle_batches, send_bundles

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Stages


#: where a worker resumes: (epoch, batches it had yielded, the batcher's hint for the next one)
WorkerPosition = tuple


@dataclass
class EpochTask:
    """What a worker streams: one epoch of its plan, possibly resuming and possibly capped."""

    spec: StreamSpec
    first_batch: int = 0
    limit: WorkerLimit | None = None  # batches this worker may yield this epoch
    plan: EpochPlan | None = None  # replaces the normal epoch plan (the remainder of an interrupted epoch)
    hint: dict | None = None  # the batcher's own note of where first_batch starts (same layout)
    #: the stream this process likely reads next (the next epoch's), whose first remote shards
    #: start while this one's last are read; None: this process may read no further pass
    following: StreamSpec | None = None


@dataclass
class DataStats:
    """What the stages count beside the batches: tokens cut by ``max_len_mode="truncate"``,
    shards skipped as unreadable and bad raw documents skipped (``on_error="skip"``), and batches
    repeated to keep counts equal after shards were skipped. A worker sends what it counted with
    its next batch (mostly nothing, so mostly no record) and with its end marker; the loader adds
    them up in one record of its own."""

    truncated_tokens: int = 0
    skipped_shards: list[str] = field(default_factory=list)
    skipped_docs: int = 0
    refilled_batches: int = 0

    @classmethod
    def of(cls, stream: StreamStats, refilled: int = 0) -> DataStats:
        return cls(stream.truncated_tokens, list(stream.skipped_shards), stream.skipped_docs, refilled)

    def add(self, other: DataStats) -> None:
        self.truncated_tokens += other.truncated_tokens
        self.skipped_shards.extend(other.skipped_shards)
        self.skipped_docs += other.skipped_docs
        self.refilled_batches += other.refilled_batches


class CountedBy:
    """A count of an owner's ``stats`` record read as the owner's own attribute (``loader.skipped_docs``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.stats, self.name)


@dataclass
class EndOfWorker:
    """Marks the end of a worker's batches (the loader uses it to keep the round-robin order)."""

    worker: int
    epoch: int
    stats: DataStats = field(default_factory=DataStats)


class EpochSource(IterableDataset):
    """First stage: knows the rank, finds its worker, reads the current epoch, emits EpochTasks.

    The epoch lives in shared memory so that ``set_epoch`` reaches persistent DataLoader workers.
    What a resume changes (worker positions, an epoch's replacement plan) is set through methods,
    and the batch limits that depend on them are recomputed when they change."""

    def __init__(self, catalog: Source, cfg: Config, rank: int, world: int, passes: bool = False):
        super().__init__()
        self.catalog = catalog
        self.cfg = cfg
        self.rank = rank
        self.world = world
        #: the loader's iterations are passes that an endless stream of whole epochs runs one at a time
        self.passes = passes
        self._epoch = mp.get_context().Value("q", 0, lock=False)
        self._resume: dict[int, WorkerPosition] = {}  # worker -> position for the next iteration
        self._plans: dict[int, EpochPlan] = {}  # epoch -> the plan that replaces its normal one
        self._limits: dict = {}  # (epoch, workers) -> EpochLimits | None, for the last key asked
        self._passes: dict[tuple[int, int], int] = {}  # (worker, workers) -> passes begun in this process
        #: what the run excludes from the epochs it plans afresh (a steered run's log: steering.md)
        self.excluding: Any = None
        self._excluded: tuple[int, EpochPlan] | None = None  # (epoch, its plan less the exclusions)

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = int(epoch)

    @property
    def resume_positions(self) -> dict[int, WorkerPosition]:
        """Where each worker resumes on the next iteration (empty: from the epoch's start)."""
        return dict(self._resume)

    def resume_from(self, positions: dict[int, WorkerPosition]) -> None:
        self._resume = {int(w): tuple(p) for w, p in positions.items()}

    @property
    def one_epoch_a_pass(self) -> bool:
        """Whether an iteration reads one epoch: a finite stream, or the loader's endless stream of
        whole epochs (``Config.endless_by_epochs``); else each worker streams on across epochs."""
        return not self.cfg.infinite or (self.passes and self.cfg.endless_by_epochs(self.world))

    def set_world(self, rank: int, world: int) -> None:
        """Another rank and world size (found again once the process group was up)."""
        self.rank, self.world = rank, world
        self._limits = {}

    def plan_for(self, epoch: int) -> EpochPlan | None:
        plan = self._plans.get(epoch)
        if plan is not None or self.excluding is None:
            return plan
        if self._excluded is None or self._excluded[0] != epoch:
            self._excluded = (epoch, self.excluding(epoch))
        return self._excluded[1]

    def exclude_from(self, excluding: Any) -> None:
        """Plan every epoch without a replacement plan as ``excluding(epoch)`` (None: normally)."""
        self.excluding, self._excluded = excluding, None
        self._limits = {}

    def set_plan(self, epoch: int | None, plan: EpochPlan | None) -> None:
        """Replace epoch ``epoch``'s plan (None: every epoch follows the normal plan)."""
        self._plans = {} if plan is None else {epoch: plan}
        self._limits = {}

    def with_plan(self, epoch: int, plan: EpochPlan) -> EpochSource:
        """A copy that reads ``epoch`` by ``plan`` from its start, this source left as it is: the
        stream of a change's re-plan, started before its step (steer/prestart.py)."""
        other = copy.copy(self)
        other._plans, other._resume, other._limits, other._passes = {epoch: plan}, {}, {}, dict(self._passes)
        return other

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_limits"] = {}  # recomputed where needed, not shipped to workers
        state["_passes"] = {}  # a fresh worker has begun none
        return state

    def count_ahead(self, workers: int) -> None:
        """Before ``workers`` workers start on the epoch: what each would count (``plan.count_ahead``)."""
        spec = self.cfg.spec(self.epoch, self.rank, self.world, 0, workers)
        count_ahead(self.catalog, self.cfg, spec, self.plan_for(spec.epoch))

    def limits(self, epoch: int, workers: int) -> EpochLimits | None:
        """The equal-batches decision of ``epoch`` with ``workers`` workers per rank."""
        key = (epoch, workers)
        if key not in self._limits:
            limits = None
            if self.cfg.keeps_equal_batches(self.world):
                limits = epoch_limits(
                    self.catalog, self.cfg, epoch, self.rank, self.world, workers, self.plan_for(epoch)
                )
                if limits is None:
                    log.warning(
                        "equal_batches needs an index with counts; ranks may yield different numbers of batches"
                    )
            self._limits = {key: limits}
        return self._limits[key]

    def __iter__(self) -> Iterator[EpochTask]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.tasks(worker, workers)

    def tasks(self, worker: int, workers: int) -> Iterator[EpochTask]:
        """The tasks of DataLoader worker ``worker`` of ``workers`` (what ``__iter__`` yields there)."""
        cfg = self.cfg
        epoch = self.epoch
        first_batch, hint = 0, None
        if worker in self._resume:
            epoch, first_batch, hint = ((*tuple(self._resume[worker]), None))[:3]
        # a process that has read a pass before will likely read the next epoch after this one
        # (0 workers, persistent workers); a fresh DataLoader worker ends with its epoch
        passes = self._passes.get((worker, workers), 0)
        self._passes[(worker, workers)] = passes + 1
        warm = not self.one_epoch_a_pass or passes > 0
        while True:
            limits = self.limits(epoch, workers)
            yield EpochTask(
                spec=cfg.spec(epoch, self.rank, self.world, worker, workers),
                first_batch=first_batch,
                limit=limits.worker_limit(worker) if limits is not None else None,
                plan=self.plan_for(epoch),
                hint=hint,
                following=cfg.spec(epoch + 1, self.rank, self.world, worker, workers) if warm else None,
            )
            if self.one_epoch_a_pass:
                break
            epoch += 1
            first_batch, hint = 0, None


class WorkerBatcher:
    """Second stage, in a worker: read, shuffle and batch each task's stream.

    A batch made in a DataLoader worker is sent to the main process, so it gets its own compact
    token buffer: here (``compact``), or in ``transport.send_bundles``, which compacts into shared
    memory. What the reads count (``StreamStats``) travels with the next batch.
    """

    def __init__(self, catalog: Source, cfg: Config, read: ReadOptions, compact: bool, merge_tails: bool = False):
        self.catalog, self.cfg, self.read, self.compact = catalog, cfg, read, compact
        #: the loader merges the workers' epoch-final batches where lengths are unknown (tails.py)
        self.merge_tails = merge_tails
        self.stats = StreamStats()

    def emit(
        self, spec: StreamSpec, index: int, items: Any, hint: Any, refill: bool = False, tail: bool = False
    ) -> Batch:
        changed = changed_file(items.tokens)
        if changed is not None:  # its groups were checked when read; views of it now show other bytes
            raise ShardError(
                f"{changed} changed while it was being read (rewritten in place); replace shards atomically "
                "(write a new file, then rename it over the old one) and restart from the last checkpoint"
            )
        batch = Batch(
            items=items.compact() if self.compact else items,
            index=index,
            epoch=spec.epoch,
            worker=spec.worker,
            hint=hint,
            tail=tail,
        )
        catalog, stats = self.catalog, self.stats
        if catalog.mixing is not None:  # the realized mix, counted here (in the worker), not in the main process
            batch.mix = mix_counts(items, catalog.mixing, catalog.mode)
        if stats.truncated_tokens or stats.skipped_shards or stats.skipped_docs or refill:  # mostly nothing
            batch.stats = DataStats.of(stats, refilled=int(refill))
            stats.truncated_tokens = 0
            stats.skipped_shards = []
            stats.skipped_docs = 0
        return batch

    def following(self, next_spec: StreamSpec | None) -> tuple[list, StreamSpec] | None:
        """The next epoch's slices, asked for once this one's last shards have started."""
        if next_spec is None:
            return None
        return task_slices(self.catalog, self.cfg, next_spec, None).own, next_spec

    def blocks(
        self,
        slices: list,
        spec: StreamSpec,
        next_spec: StreamSpec | None,
        marks: TaskMarks | None,
        holes: bool,
        position: int,
    ) -> Iterator:
        then = functools.partial(self.following, next_spec)
        mark = marks.start if marks is not None else None
        stream = read_plan_stream(
            self.catalog,
            slices,
            spec,
            start=position,
            options=self.read,
            stats=self.stats,
            then=then,
            mark=mark,
            holes=holes,
            known=slices.own,
        )
        stream = timed_reads(stream)  # observe/stages.py
        return stream if marks is None else marks.wrap(position, stream)

    def task_marks(self, task: EpochTask, batcher: Any, slices: list) -> TaskMarks | None:
        """Where the stream stands in documents, noted as it goes (counts unknown: raw text
        without a count sidecar), so that a resume passes over documents by parsing only."""
        spec = task.spec
        if spec.resample or counts_known(self.catalog, slices, spec):
            return None
        size = block_size(spec, self.catalog.mixing)
        return TaskMarks(task.hint, batcher, size, keep=4 * (max(size, 1) + (self.cfg.window or 0)))

    def task_batches(self, task: EpochTask) -> Iterator[Batch]:
        """One task's batches: from its first batch (a resume) to its limit (equal batches)."""
        catalog, cfg, spec, limit = self.catalog, self.cfg, task.spec, task.limit
        reading = task_slices(catalog, cfg, spec, task.plan)  # the tails handed to it: found when reached
        merging = self.merge_tails and merges_tails(catalog, cfg, spec.workers)
        # one that hands its tail over makes full batches; one whose tail the loader merges keeps it
        batcher = worker_batcher(cfg) if merging else batcher_for(catalog, cfg, spec, reading.own)
        replans = batcher.needs_lengths and not spec.resample and task.hint is None and task.first_batch
        slices = reading.whole() if replans or catalog.mixing is not None else reading.own
        lengths = None  # a share's lengths: only to find where a resume without a hint starts
        if replans:
            lengths = slice_item_lengths(catalog, slices, spec)
            if lengths is not None:
                lengths = shuffle_lengths(lengths, spec, catalog.mixing, plan_labels(catalog, slices, spec))
        hint = batcher_hint(without_lost(task.hint))
        start = batcher.start_position(task.first_batch, lengths, hint)
        failed: set[str] = set()
        marks = self.task_marks(task, batcher, slices)
        # a lost unit's items stay as holes (holes.py): batches stay the planned ones (a handed tail
        # is found from them) and positions stay plan positions (a resume finds them again)
        holes = self.read.on_error == "skip"
        blocks = functools.partial(self.blocks, reading, spec, task.following, marks, holes)
        labels = PlanLabels.of(catalog, slices, spec)
        items_stream = StreamEnd(shuffled_items(blocks, spec, start=start, mixing=catalog.mixing, labels=labels))
        index = task.first_batch
        emptied = lost_batches(task.hint)  # batches of holes only: numbered, not sent
        cut = HoleCut()
        # resumed among the refills that follow a worker's planned batches: none of those to make
        refilling = limit is not None and limit.reached(index)
        planned = () if refilling else batcher.batches(items_stream, task.first_batch, spec, lengths, hint)
        for index, items, after in planned:
            if limit is not None and limit.reached(index):
                break
            failed.update(self.stats.skipped_shards)
            if cfg.unbatched:  # a chunk of single items: `index` counts items
                if limit is not None and limit.reached(index + len(items)):
                    items = items.slice(0, limit.value() - index)
                following = index + len(items)
            else:
                following = index + 1
            if failed and holes:
                items = cut.cut(items)
                if not len(items):
                    emptied += 1
                    index = following
                    continue
            note = with_lost(after if marks is None else marks.hint(following, after), emptied)
            yield self.emit(spec, index, items, note, tail=merging and items_stream.ended)
            if index == task.first_batch and limit is not None and limit.start is not None:
                limit.start()  # the exact count, from now on: never beside the first batch
            index = following
        failed.update(self.stats.skipped_shards)
        cut.report(spec.worker, spec.rank, spec.epoch)
        end = limit.value() + emptied if limit is not None else None  # numbered on from the planned batches
        if end is not None and (failed or emptied or cfg.uneven == "repeat") and index < end:
            refill = _Refill(catalog, batcher, reading.whole(), spec, self.read, self.stats, failed, emptied)
            yield from refill.batches(index, min(index, limit.value()), end, self.emit)


def _epoch_batches(
    tasks: Iterator[EpochTask], catalog: Source, cfg: Config, read: ReadOptions, end_marker: bool, shared: bool = False
) -> Iterator:
    """Second stage: each task's batches (``WorkerBatcher``), then this worker's end marker."""
    if read.fetch_process is None:  # in the training process itself: its GIL is spared the receiving
        read = replace(read, fetch_process=get_worker_info() is None)
    # the loader's pipeline (end markers) merges its workers' tails where lengths are unknown
    stage = WorkerBatcher(
        catalog, cfg, read, compact=get_worker_info() is not None and not shared, merge_tails=end_marker
    )
    last = None
    for task in tasks:
        last = task.spec
        if task.limit is not None and task.limit.reached(task.first_batch - lost_batches(task.hint)):
            continue  # every batch it owes was sent (its numbers also count batches of holes only)
        yield from stage.task_batches(task)
    if end_marker and last is not None:
        yield EndOfWorker(worker=last.worker, epoch=last.epoch, stats=DataStats.of(stage.stats))


def task_slices(catalog: Source, cfg: Config, spec: StreamSpec, plan: EpochPlan | None) -> StreamSlices:
    """The slices a stream reads: resampled (endless), or its epoch's plan (``plan``: one that
    replaces it) with, for a rank's last worker, the tails the others hand to it."""
    if spec.resample:
        return StreamSlices(resampled_slices(len(catalog.urls), spec.seed, spec.epoch, spec.rank, spec.worker))
    return stream_slices(catalog, cfg, spec, plan)


class _Refill:
    """Top up a worker that lost shards (on_error='skip'), or of a rank with fewer batches than
    the largest (uneven='repeat'), to its share of the equal batch count.

    Every rank must take part in every step, so a short worker repeats its own readable documents
    of the epoch (logged, counted in ``loader.refilled_batches``) rather than end early and leave
    the other ranks waiting in a collective. Refill j is batch ``first + j`` of the worker's
    epoch (after its planned batches), so a resume among them passes the ones sent before.
    """

    def __init__(self, catalog, batcher, slices, spec, read, stats, failed, lost):
        self.catalog, self.batcher, self.spec, self.read, self.stats = catalog, batcher, spec, read, stats
        self.readable = [sl for sl in slices if catalog.urls[sl.shard] not in failed]
        self.failed, self.lost = failed, lost

    def _cycle(self) -> Iterator:
        """The batches of one pass over the worker's readable documents."""
        catalog, spec = self.catalog, self.spec

        def blocks_from(position: int):
            return read_plan_stream(catalog, self.readable, spec, start=position, options=self.read, stats=self.stats)

        labels = PlanLabels.of(catalog, self.readable, spec)
        shuffled = shuffled_items(blocks_from, spec, start=0, mixing=catalog.mixing, labels=labels)
        for _, items, _ in self.batcher.batches(shuffled, 0, spec, None, None):
            yield items

    def batches(self, index: int, first: int, end: int, emit) -> Iterator[Batch]:
        spec = self.spec
        if self.failed or self.lost:
            log.warning(
                "worker %d lost %d shard(s) and %d batch(es) of their items; repeating its other documents for %d "
                "batch(es) to keep batch counts equal",
                spec.worker,
                len(self.failed),
                self.lost,
                end - index,
            )
        else:
            log.info("worker %d repeats its items for %d batch(es) (uneven='repeat')", spec.worker, end - index)
        number = first
        while index < end:
            made = False
            for items in self._cycle():
                if index >= end:
                    return
                made = True
                if number >= index:
                    yield emit(spec, index, items, with_lost(None, self.lost), refill=True)
                    index += 1
                number += 1
            if not made:
                raise WdsllmError(
                    f"worker {spec.worker} of rank {spec.rank} has no readable shard left to fill its batches; "
                    "the ranks cannot keep equal batch counts"
                )


class Tracker:
    """Where the batches this process handed out stand: (epoch, batches or items of the worker's
    epoch, the batcher's hint), updated before each one is yielded (what ``state_dict`` saves)."""

    def __init__(self) -> None:
        self.position: tuple | None = None


def _items_one_by_one(batches: Iterator, rows: bool, tracker: Tracker | None = None) -> Iterator[dict]:
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
        epoch, first = batch.epoch, batch.index
        if items.pieces is None:
            for i, ((a, b), item) in enumerate(zip(bounds, items.ids.tolist())):
                if tracker is not None:
                    tracker.position = (epoch, first + i + 1, None)
                yield {"input_ids": tokens[a:b], name: item, "epoch": epoch}
        else:
            for i, ((a, b), item, piece) in enumerate(zip(bounds, items.ids.tolist(), items.pieces.tolist())):
                if tracker is not None:
                    tracker.position = (epoch, first + i + 1, None)
                yield {"input_ids": tokens[a:b], name: item, "piece": piece, "epoch": epoch}


def _collate(batches: Iterator, opts: CollateOptions, tracker: Tracker | None = None) -> Iterator[dict]:
    """Third stage: compact batches to dicts of tensors."""
    for batch in batches:
        if isinstance(batch, EndOfWorker):
            continue
        out = assemble(batch.items, batch.epoch, opts)
        if tracker is not None:
            tracker.position = (batch.epoch, batch.index + 1, batch.hint)
        yield out


def dataset_tokenizer(catalog: Source) -> Any:
    """The ``tokenizers.Tokenizer`` the dataset was packed with, from the tokenizer.json it carries
    (checked against the index's sha256)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(catalog.tokenizer_json())


class WdsPipeline(wds.DataPipeline):
    """A webdataset.DataPipeline that also has ``set_epoch``, ``state_dict`` and
    ``load_state_dict`` (per DataLoader worker, as torchdata's StatefulDataLoader asks), and what
    the loader needs."""

    source: EpochSource
    catalog: Source
    cfg: Config
    #: rank and world size were found, not given: looked up again when iteration starts
    implicit_world: bool = False
    #: where this process's batches stand (None: the loader keeps the state, not the pipeline)
    tracker: Tracker | None = None
    _pending: statemod.DatasetState | None = None
    _here: tuple[int, int] = (0, 1)

    def set_epoch(self, epoch: int) -> None:
        self.source.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.source.epoch

    def with_source(self, source: EpochSource) -> WdsPipeline:
        """The same stages after another first stage (``EpochSource.with_plan``)."""
        other = copy.copy(self)
        other.pipeline = [source, *self.pipeline[1:]]
        other.source = source
        return other

    @property
    def tokenizer(self) -> Any:
        """The tokenizers.Tokenizer the dataset was packed with (its own tokenizer.json)."""
        return dataset_tokenizer(self.catalog)

    def __iter__(self) -> Iterator:
        refuse_rewrapping()
        if self.implicit_world:
            rank, world = resolve_world(None, None)
            if (rank, world) != (self.source.rank, self.source.world):
                log.info("rank and world size are now %d of %d (the process group came up later)", rank, world)
                self.source.set_world(rank, world)
        if self.tracker is not None:
            self._start_pass()
        return super().__iter__()

    # -- state, per worker (torchdata's StatefulDataLoader) ---------------------------------------
    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def _start_pass(self) -> None:
        """Where this worker's pass starts: a restored position, or its epoch's beginning."""
        self._here = self._worker()
        pending, self._pending = self._pending, None
        worker = self._here[0]
        if pending is not None and (self.cfg.infinite or pending.position.epoch == self.source.epoch):
            self.source.resume_from({worker: pending.position.as_tuple()})
            self.tracker.position = pending.position.as_tuple()
            return
        if pending is not None:
            log.warning(
                "the restored position is in epoch %d but this pass runs epoch %d (set_epoch): starting epoch %d "
                "from its beginning",
                pending.position.epoch,
                self.source.epoch,
                self.source.epoch,
            )
        self.source.resume_from({})
        self.tracker.position = (self.source.epoch, 0, None)

    def state_dict(self) -> dict[str, str]:
        """Where this worker's batches stand (call it in the worker, as StatefulDataLoader does):
        ``{"format": "wdsllm.dataset/4", "state": JSON}``."""
        if self.tracker is None:
            raise ConfigError("this pipeline belongs to a wdsllm.loader: use loader.state_dict()")
        if self._pending is not None:
            return self._pending.sealed()
        worker, workers = self._here if self.tracker.position is not None else self._worker()
        position = self.tracker.position or (self.source.epoch, 0, None)
        return statemod.DatasetState(
            dataset=self.catalog.fingerprint(),
            settings=resumemod.settings_fingerprint(self.cfg),
            rank=self.source.rank,
            world_size=self.source.world,
            worker=worker,
            num_workers=workers,
            position=statemod.Position(*position),
        ).sealed()

    def load_state_dict(self, state: dict) -> None:
        """Resume this worker's next pass where ``state`` (from ``state_dict`` in the same worker
        of the same layout) stood; checked now, refused with a StateError if it does not fit."""
        if self.tracker is None:
            raise ConfigError("this pipeline belongs to a wdsllm.loader: use loader.load_state_dict()")
        st = statemod.DatasetState.load(state)
        worker, workers = self._worker()
        if (st.worker, st.num_workers) != (worker, workers):
            raise StateError(
                f"the dataset state is DataLoader worker {st.worker} of {st.num_workers}'s; it is being loaded into "
                f"worker {worker} of {workers}: resume with the same num_workers"
            )
        if self.implicit_world:
            self.source.set_world(*resolve_world(None, None))
        st.check(
            self.catalog,
            self.cfg,
            dataset=self.catalog.fingerprint(),
            settings=resumemod.settings_fingerprint(self.cfg),
            rank=self.source.rank,
            world=self.source.world,
        )
        keys = self.cfg.mode.hint_keys
        hint = st.position.hint
        if hint is not None and set(hint) - {MARK_KEY, LOST_KEY} != keys:
            raise StateError(f"the dataset state's batcher hint has keys {sorted(hint)}; expected {sorted(keys)}")
        self._pending = st

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
    catalog: Source,
    cfg: Config,
    rank: int,
    world: int,
    read: ReadOptions,
    *,
    collate: bool,
    end_marker: bool,
    bundle: int = 0,
    ring: RingHolder | None = None,
    implicit_world: bool = False,
    passes: bool = False,
) -> WdsPipeline:
    cfg.check(catalog)
    catalog.side_cache = read.cache  # remote lengths.npy and groups.npy: fetched once per node, mapped
    catalog.bind(cfg, world)  # a mixture: its seed, stratified groups, the units of a step
    cfg.check_equal_batches(catalog, world)
    # Packed shards: what each row holds is worked out only as far as the batches show it.
    read = replace(read, row_docs=cfg.docs, segments=cfg.boundaries)
    source = EpochSource(catalog, cfg, rank, world, passes)
    stages = [source, wds.filters.pipelinefilter(_epoch_batches)(catalog, cfg, read, end_marker, shared=bool(bundle))]
    if bundle:
        stages.append(wds.filters.pipelinefilter(bundle_batches)(bundle, BUNDLE_TOKENS))
        stages.append(wds.filters.pipelinefilter(send_bundles)(ring or RingHolder()))
    tracker = Tracker() if collate else None
    if collate and cfg.unbatched:
        stages.append(wds.filters.pipelinefilter(_items_one_by_one)(cfg.rows_out(catalog), tracker))
    elif collate:
        stages.append(wds.filters.pipelinefilter(_collate)(CollateOptions.for_config(cfg, catalog), tracker))
    pipe = WdsPipeline(*stages)
    pipe.source = source
    pipe.catalog = catalog
    pipe.cfg = cfg
    pipe.tracker = tracker
    pipe.implicit_world = implicit_world
    return pipe


def open_given(face: FaceOptions) -> tuple[Source, BatchOptions]:
    """The catalog of a face's source, and its batch options with what the source decides by
    default (a raw source's pad id: its tokenizer's pad, else EOS)."""
    given, reading, batch = face.source, face.reading, face.batch
    if isinstance(given, RawTextSource):
        text = {k: v for k, v in given.items() if k not in ("raw", "on_error")}
        catalog = open_raw(given.raw, on_error=given.on_error or reading.on_error, **text)
        if batch.pad_id is None:
            batch = replace(batch, pad_id=catalog.text.pad_id)
        return catalog, batch
    return open_source(given, retry=reading.retry, on_error=reading.on_error), batch


def dataset(
    source: Any,
    *,
    order: OrderOptions | None = None,
    batch: BatchOptions | None = None,
    reading: ReadingOptions | None = None,
    layout: LayoutOptions | None = None,
    **options: Any,
) -> WdsPipeline:
    """A webdataset.DataPipeline that yields collated batches (dicts of tensors).

    ``source`` is a dataset directory or URL holding index.json, the URL of an index.json, shard
    URLs / brace patterns, a mixture, or a :class:`RawTextSource` (raw text tokenized in the
    workers). The options are the fields of the records, as keywords (``batch_size=32``) or whole
    (``batch=BatchOptions(...)``); see docs/loader.md for every option and guarantee.
    """
    records = {"order": order, "batch": batch, "reading": reading, "layout": layout}
    face = split_options(source, records, options, face="wdsllm.dataset")
    if face.workers.changed():
        raise ConfigError(
            f"{', '.join(face.workers.changed())}: wdsllm.dataset has no workers of its own; pass them to the "
            "DataLoader you wrap it in, or use wdsllm.loader"
        )
    if face.observe.changed():
        raise ConfigError(f"{', '.join(face.observe.changed())}: what wdsllm.loader observes (use wdsllm.loader)")
    if face.steer.changed():
        raise ConfigError(f"{', '.join(face.steer.changed())}: what wdsllm.loader steers by (use wdsllm.loader)")
    catalog, batch = open_given(face)
    layout = resolve_layout(face.layout)
    if layout.cp is not None or layout.pp is not None or layout.broadcasts:
        raise ConfigError("context-parallel slices, pipeline stages and broadcast replicas are wdsllm.loader's")
    r, w = layout.dp_rank, layout.dp_size
    cfg = Config.of(face.order, batch)
    return build_pipeline(
        catalog,
        cfg.resolved(catalog),
        r,
        w,
        reading_options(face.reading),
        collate=True,
        end_marker=False,
        implicit_world=not face.explicit_world,
    )
