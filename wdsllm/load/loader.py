"""``wdsllm.loader``: the DataLoader face — workers, ``set_epoch``, equal batches, state.

Workers batch inside their processes and send compact batches (the items' tokens, no padding,
several per message); the main process collates them into tensors. Sending one sample at a time
between processes, or padded tensors through shared memory, costs far more than the collation.

Batches come out in DataLoader's round-robin order over the workers that still have batches; the
loader keeps that order itself (a worker's batches wait in a small queue until its turn), so the
sequence of batches depends on the configuration alone, also after a resume.

``state_dict()`` records, per worker, the epoch and the number of its batches that were handed
to the caller (not merely prefetched), the round-robin turn, and the rank's batch count; see
``resume.py`` for why that is enough.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError, NotADatasetError, SteeringError, UsageError
from ..observe.observer import Observer, timed
from . import state as statemod
from .agree import agree_on_layout
from .batching import Batch
from .collate import CollateOptions, assemble
from .config import Config, reading_options, resolve_world
from .cpsplit import check_row_length
from .cursor import (
    Cursor,
    EpochTotal,
    Here,
    Progress,
    RoundRobin,
    check_fits,
    restore,
)
from .dataset import CountedBy, DataStats, EndOfWorker, build_pipeline, dataset_tokenizer, open_given
from .describe import describe
from .layout import resolve_layout, world_seat
from .mixstats import MixTally
from .options import (
    AGREE_ALL,
    BatchOptions,
    LayoutOptions,
    ObserveOptions,
    OrderOptions,
    ReadingOptions,
    SteerOptions,
    WorkerOptions,
    split_options,
)
from .plan import torch_seed
from .replicas import replicas_for
from .steer.face import SteeringMethods
from .steer.file import steer_file_of
from .steer.log import Log
from .steer.plans import steer_plans
from .steer.runtime import Replans, Steerer
from .steer.schedule import Schedule
from .tails import TailMerge, merge_key, merges_tails
from .transport import WorkerBatches

log = logging.getLogger(__name__)

#: batches per message from a worker (see transport.bundle_batches)
BUNDLE_BATCHES = 16


def _note_end(loader: weakref.ref, end: EndOfWorker) -> None:
    """A worker's end marker, counted by its loader while there is one."""
    live = loader()
    if live is not None:
        live.stats.add(end.stats)


class _OpenLoaders:
    """Loaders with an iterator handed out and not closed, closed at interpreter exit while the
    modules their iterators' ``finally`` blocks use still exist: an iterator left alive at exit is
    otherwise finalized after module teardown, where its cleanup fails with "Exception ignored
    ... 'NoneType' object has no attribute ...", and its workers are left to DataLoader's own."""

    def __init__(self) -> None:
        self.live: weakref.WeakSet = weakref.WeakSet()
        atexit.register(self.close_all)

    def add(self, loader: Loader) -> None:
        self.live.add(loader)

    def discard(self, loader: Loader) -> None:
        self.live.discard(loader)

    def close_all(self) -> None:
        for loader in list(self.live):
            try:
                loader.close()
            except Exception as exc:  # at exit: say it, never raise
                log.debug("closing a loader at exit: %s", exc)
        self.live.clear()


_OPEN = _OpenLoaders()


class Loader(SteeringMethods):
    """Iterate batches for this rank; call ``set_epoch(e)`` before each epoch (see docs/loader.md).

    A cursor (``cursor.Cursor``: the epoch, the pass, each worker's position; its get/set is the
    state dict's position) over stages: the workers' pipeline (``dataset.build_pipeline``), the
    transport of their batches (``transport.WorkerBatches``), DataLoader's round-robin order, and
    collation here (``collate.assemble``).
    """

    def __init__(
        self,
        source: Any,
        *,
        order: OrderOptions | None = None,
        batch: BatchOptions | None = None,
        workers: WorkerOptions | None = None,
        reading: ReadingOptions | None = None,
        layout: LayoutOptions | None = None,
        observe: ObserveOptions | None = None,
        steer: SteerOptions | None = None,
        _in_process: bool = False,
        **options: Any,
    ):
        #: the iterators handed out and not finished (``close()`` ends them)
        self._iterators: weakref.WeakSet = weakref.WeakSet()
        records = {"order": order, "batch": batch, "workers": workers, "reading": reading, "layout": layout}
        records.update(observe=observe, steer=steer)
        face = split_options(source, records, options, face="wdsllm.loader")
        self.catalog, batch = open_given(face)
        #: rank and world size given, or found (torch.distributed, RANK/WORLD_SIZE); found ones are
        #: looked up again when iteration starts, in case the process group came up after this
        self._explicit_world = face.explicit_world
        self.cfg = Config.of(face.order, batch).resolved(self.catalog)
        if self.cfg.unbatched:
            raise ConfigError(
                "the loader yields batches: pass batch_size (or max_tokens with batching='bucket'); "
                "for one document at a time use wdsllm.dataset(..., batch_size=None)"
            )
        #: tests (``_in_process``): the workers' streams run here, one after another, in DataLoader's order
        self._transport = WorkerBatches.of(face.workers, self.catalog.reads_remote, in_process=_in_process)
        #: every setting that shapes this loader's batches or collectives (describe.py): compared
        #: over the layout's ranks before its first collective, then with every checked batch
        self.description = describe(face, vars(self.cfg), {"dataset": (AGREE_ALL, self.catalog.fingerprint())})
        #: the parallel layout (layout.py): the data-parallel coordinates are this loader's rank
        #: and world size; replica peers yield the same batches, cut to a CP slice or a PP stage
        self.layout = resolve_layout(face.layout, functools.partial(agree_on_layout, self.description))
        self.rank, self.world_size = self.layout.dp_rank, self.layout.dp_size
        self.pin_memory = face.workers.pin_memory
        self.read_options = reading_options(face.reading)
        self._tokenizer: Any = None
        self._build()
        self.collate_options = CollateOptions.for_config(self.cfg, self.catalog)
        if self.layout.cp is not None:
            opts = self.collate_options
            check_row_length(self.layout.cp, seq_len=opts.width, multiple=opts.pad_to_multiple_of, rows=opts.rows)
        #: the schedule in planned steps, the run's changes, where the run stands (steering.md)
        self.steering = self._steerer()
        self._steer_url = steer_file_of(face)
        self.steering.reload_every = face.steer.reload_every
        self.steering.horizon = face.steer.steer_horizon
        self._replans = Replans()
        self._replicas = replicas_for(self.layout, self.description.settings())
        #: a mixture's delivered tokens and items per source (``mix_stats``)
        self._mix = MixTally(self.catalog) if self.catalog.mixing is not None else None
        self.cursor = Cursor(self.workers)
        self._stream: Iterator | None = None  # the endless stream of an infinite loader
        self._pass: Iterator | None = None  # the epoch in progress of an endless stream of whole epochs
        self._warned_per_rank = False  # a rank's own state was saved and said so (state_dict)
        self._started = False  # whether any iteration has begun (rank and world are then fixed)
        self._total = EpochTotal()
        #: the equal-batches decision of the current epoch: dropped batches of this rank etc.
        self.limits = None
        self.dropped_batches = 0
        #: what the stages counted beside the batches (truncated tokens, skipped shards and documents, refills)
        self.stats = DataStats()
        #: the data path measured: the wait on the trainer's thread, the workers, the stores (observe/)
        self.observer = Observer(face.observe, self._transport.tally, self._mix)
        self.observer.group = self.layout.dp_group  # the wait is reduced across data-parallel ranks
        self._transport.timeout = self.observer.dataloader_timeout()

    def _build(self) -> None:
        self.pipeline = build_pipeline(
            self.catalog,
            self.cfg,
            self.rank,
            self.world_size,
            self.read_options,
            collate=False,
            end_marker=True,
            bundle=BUNDLE_BATCHES if self._transport.bundled else 0,
            ring=self._transport.ring,
            passes=True,
        )
        self.source = self.pipeline.source
        #: what loaded states and batch counts are checked against
        self.here = Here(self.catalog, self.cfg, self.rank, self.world_size, self.workers, self.source)

    def _steerer(self) -> Steerer:
        return self._scheduled(self.cfg.schedule)

    def _reschedule(self) -> None:
        """The schedule in force (set while the run trained, else declared) resolved again: for
        another world size, or a restored log."""
        logged = self.steering.log.schedule
        made = self._scheduled(Schedule.from_json(logged) if logged is not None else self.cfg.schedule)
        self.steering.phases, self.steering.rows = made.phases, made.rows

    def _scheduled(self, schedule: Schedule | None) -> Steerer:
        """A steerer of ``schedule`` resolved for this loader (its batches, rows and world size)."""
        opts = self.collate_options
        return Steerer.of(schedule, self.cfg, opts.rows, opts.seq_len, self.world_size)

    @property
    def num_workers(self) -> int:
        return self._transport.num_workers

    @property
    def workers(self) -> int:
        """Streams per rank: the DataLoader workers, or this process alone."""
        return max(1, self.num_workers)

    @property
    def persistent_workers(self) -> bool:
        return self._transport.persistent

    @property
    def _dataloader(self) -> Any:
        return self._transport.dataloader

    @_dataloader.setter
    def _dataloader(self, value: Any) -> None:
        self._transport.dataloader = value

    #: what the stages counted, as in ``self.stats`` (``DataStats`` says what each counts)
    truncated_tokens: int = CountedBy()
    skipped_shards: list[str] = CountedBy()
    skipped_docs: int = CountedBy()
    refilled_batches: int = CountedBy()

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` the dataset was packed with, from the tokenizer.json it
        carries: to decode batches, or for ``PreTrainedTokenizerFast(tokenizer_object=...)``."""
        if self._tokenizer is None:
            self._tokenizer = dataset_tokenizer(self.catalog)
        return self._tokenizer

    # -- what trainers ask of a DataLoader ------------------------------------------------------
    @property
    def dataset(self) -> Any:
        """Not there on purpose: trainers that resume by skipping batches read ``loader.dataset``
        (accelerate's ``skip_first_batches``), and replaying batches is not how this loader resumes."""
        raise NotADatasetError(
            "wdsllm.Loader has no .dataset: it resumes from its own state_dict(), never by skipping batches. With the "
            "Hugging Face Trainer use wdsllm.integrations.hf.Trainer(train_loader=loader); elsewhere call "
            "loader.load_state_dict(...) yourself (docs/integrations.md)"
        )

    def __getitem__(self, index: Any) -> Any:
        raise UsageError(
            "wdsllm.Loader yields whole batches and cannot be indexed: do not pass it as a dataset (train_dataset=); "
            "iterate it, or give it to wdsllm.integrations.hf.Trainer(train_loader=...) (docs/integrations.md)"
        )

    def _settle_world(self) -> None:
        """Look up a rank and world size that were found, not given, again: a launcher that
        starts the process group after the loader was built (accelerate's ``Accelerator()`` under
        mpirun) would otherwise leave every process believing it is rank 0 of 1, and each would
        read the whole epoch."""
        if self._explicit_world:
            return
        rank, world = resolve_world(None, None)
        if (rank, world) == (self.rank, self.world_size):
            return
        if self._started:
            raise UsageError(
                f"this process became rank {rank} of {world} after the loader started iterating as rank {self.rank} "
                f"of {self.world_size}: initialise torch.distributed (or create the Accelerator) before iterating, "
                "or pass rank= and world_size="
            )
        log.info(
            "rank and world size changed since the loader was built (%d of %d -> %d of %d): the process group came up "
            "later; using the new ones",
            self.rank,
            self.world_size,
            rank,
            world,
        )
        self.rank, self.world_size = rank, world
        self._build()
        self._reschedule()
        self._total.forget()
        self._transport.forget()

    # -- epochs ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next pass runs (or the one in progress)."""
        self._settle_epoch()
        return self.cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shuffle the next iteration uses (as DistributedSampler does).

        Without calls the epoch advances by one after every completed pass.
        """
        self._settle_epoch()
        cursor = self.cursor
        if self._pass is not None:  # an endless stream of whole epochs runs on: its epochs are its own
            log.debug("set_epoch(%d) while the endless stream is in epoch %d: the stream goes on", epoch, cursor.epoch)
            return
        if cursor.restored is not None and int(epoch) != cursor.epoch:
            log.warning("set_epoch(%d) after load_state_dict: the restored epoch %d is abandoned", epoch, cursor.epoch)
            self._drop_resume()
        cursor.epoch = int(epoch)
        cursor.auto_epoch = False

    def _settle_epoch(self) -> None:
        """Close a pass whose last batch was handed out but whose iterator was never exhausted.

        Trainers (Lightning) stop after ``len(loader)`` batches without asking for one more, so
        the generator never reaches its end; without this the next pass would repeat the epoch.
        """
        cursor = self.cursor
        if cursor.order is None or self.infinite or not cursor.yielded or not self._epoch_done(cursor.yielded):
            return
        self._finish_pass(cursor.epoch)

    def _finish_pass(self, epoch: int) -> None:
        """The pass over ``epoch`` is complete: its generator, if resumed or collected later, does nothing."""
        self._skip_rest(epoch)
        if self.source.resume_positions or self.cursor.restored is not None:
            self._drop_resume()
        self.cursor.finish(epoch)

    @property
    def infinite(self) -> bool:
        return self.cfg.infinite

    @property
    def one_state_for_all(self) -> bool:
        """Whether any data-parallel rank's state resumes every rank, so a checkpointer may keep one
        copy for all (``Config.one_state_for_all``); else keep each rank's own."""
        return self.cfg.one_state_for_all(self.catalog, self.world_size)

    @property
    def _by_epochs(self) -> bool:
        """Whether this endless loader runs whole epochs one after another (``Config.endless_by_epochs``)."""
        return self.cfg.endless_by_epochs(self.world_size)

    @property
    def _streamed(self) -> bool:
        """Whether this loader's workers stream on across epochs (an endless stream without equal batches)."""
        return self.infinite and not self._by_epochs

    def at_end_of_pass(self) -> bool:
        """Whether the batch just handed out was the last of this pass (the epoch's, or the
        ``steps_per_epoch`` loop's); never for an endless stream without ``steps_per_epoch``.
        Also right after a resume, where the pass began mid-way."""
        cursor = self.cursor
        if self.cfg.steps_per_epoch is not None:
            return cursor.steps == self.cfg.steps_per_epoch
        if self.infinite or cursor.order is None:
            return False
        return cursor.yielded > 0 and self._epoch_done(cursor.yielded)

    def __len__(self) -> int:
        if self.cfg.steps_per_epoch is not None:
            return self.cfg.steps_per_epoch
        if self.infinite:
            raise TypeError("an endless loader has no length; pass steps_per_epoch= to give it one")
        if not self._started:
            self._settle_world()
        self._settle_epoch()
        total = self._epoch_total()
        if total is None:
            raise TypeError("the number of batches is unknown without an index")
        steer = self.steering
        if steer.plain:
            return total
        start = steer.epoch_start if self.cursor.order is not None or self.cursor.restored else steer.planned
        return steer.yielded_steps(start, total)

    def _epoch_total(self) -> int | None:
        """Batches this rank yields in the current epoch, from the index (None without one)."""
        return self._total.of(self.here, self.cursor.epoch)

    def _epoch_done(self, yielded: int) -> bool:
        """Whether ``yielded`` batches are the whole epoch (without waiting for a count that is
        still being made while fewer batches than its lower bound are out)."""
        limits = self.limits
        if limits is not None and not limits.ready() and yielded < limits.per_rank_bound:
            return False
        total = self._epoch_total()
        if yielded == total:
            return True
        steer = self.steering  # or the rest of the epoch is skipped
        target = None if steer.plain or total is None else steer.skip_target()
        return target is not None and yielded + steer.phases.batches_between(steer.planned, target) >= total

    def _note_limits(self, epoch: int) -> None:
        """Log and keep this rank's dropped batches once the equal-batches decision is known."""
        self.dropped_batches = self.limits.dropped_batches
        if self.dropped_batches:
            log.warning(
                "rank %d: epoch %d yields %d batches; %d batches beyond the smallest rank's count are dropped "
                "(equal batches; uneven='repeat' repeats items of the shorter ranks instead)",
                self.rank,
                epoch,
                self.limits.per_rank,
                self.dropped_batches,
            )

    # -- iteration ------------------------------------------------------------------------------
    def _hand_out(self, batch: Batch) -> dict:
        if self._mix is not None:
            self._mix.add(batch.mix, batch.epoch)
        began = time.perf_counter()
        out = assemble(batch.items, batch.epoch, self.collate_options)
        self.observer.handed(batch.worker, time.perf_counter() - began)
        if batch.stats:
            self.stats.add(batch.stats)
        if batch.tail:  # merged from the workers' tails (tails.py)
            self.cursor.merged_out()
        else:
            self.cursor.handed_out(batch.worker, batch.epoch, batch.index, batch.hint)
        return self._pinned(out)

    def _pinned(self, out: dict) -> dict:
        if self.pin_memory and torch.cuda.is_available():
            out = {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
        return out

    def close(self) -> None:
        """Stop what was started for this loader: its iterators (a held one then ends), its
        DataLoader workers, its endless stream, and what storage started for it
        (``storage.release``). Also on ``with`` exit, on collection and at interpreter exit."""
        from .. import storage

        for iterator in list(self._iterators):
            with contextlib.suppress(ValueError):  # running in another thread: it ends with its workers
                iterator.close()
        for stream in (self._stream, self._pass):
            if stream is not None:
                stream.close()
        self._stream = self._pass = None
        self._close_steering()
        self._transport.close()
        self.observer.close()
        storage.release(id(self.catalog))
        _OPEN.discard(self)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # not contextlib.suppress: at interpreter exit this module's globals may already be gone
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    def __iter__(self) -> Iterator[dict]:
        self._settle_world()
        self._settle_epoch()
        if not self._started:
            self._agree_on_reduction()
        self._started = True
        if self._by_epochs:
            own = self._iter_passes()
        else:
            own = self._iter_infinite() if self.infinite else self._iter_epoch()
        if not self.layout.alone:
            own = self._replicas.batches(own, self._progress, self._follow)
        iterator = timed(own, self.observer)
        self._iterators.add(iterator)
        _OPEN.add(self)
        return iterator

    def _agree_on_reduction(self) -> None:
        """Plain data parallel (the global rank) with ``reduce_every``: the wait's reduction is a
        collective of the loader too, so the ranks compare their descriptions before the first one
        (a rank with another ``reduce_every`` or batch count would leave the others waiting)."""
        if self.layout.roster is not None or self._explicit_world or self.observer.options.reduce_every is None:
            return
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            agree_on_layout(self.description, world_seat(self.rank, self.world_size))

    def _progress(self) -> Progress:
        return self.cursor.progress()._replace(steer=self.steering.where())

    def _follow(self, progress: Progress, ended: bool) -> None:
        """A receiver of a broadcast (or a middle pipeline stage) mirrors its reader's cursor, so
        that ``epoch``, ``len()``, ``set_epoch`` and ``state_dict()`` answer as the reader's do;
        it finishes an epoch where the reader's last batch came, as the reader does
        (``_settle_epoch``) when the trainer asks for no more."""
        cursor = self.cursor
        cursor.mirror(progress)
        self.steering.mirror(progress.steer)
        if self.steering.due() and not self._epoch_done(cursor.yielded):  # as the reader took it
            self._take_due()
        if not ended and not self._streamed and self._epoch_done(cursor.yielded):
            cursor.finish(cursor.epoch)

    def _begin(self) -> RoundRobin:
        """The turns of a pass that starts now (from a restored position if one is waiting)."""
        return self.cursor.begin(self.source.resume_positions)

    def _iter_epoch(self) -> Iterator[dict]:
        cursor = self.cursor
        this_pass = cursor.new_pass()
        epoch = cursor.epoch
        self.source.set_epoch(epoch)
        steer = self.steering
        if steer.due():  # a change made for this step (``at=``, ``steer_horizon``)
            self._take_due()
        self.limits = self.source.limits(epoch, self.workers)
        noted = self.limits is not None and self.limits.ready()  # else once the count is done
        if noted:
            self._note_limits(epoch)
        if cursor.restored is None:  # a fresh epoch: its planned steps begin here
            steer.epoch_start = steer.planned
        resumed = False
        try:
            while True:
                if steer.restart:  # re-planned by a change: the rest of the epoch is a pass of its own
                    steer.restart = False
                    self.limits = self.source.limits(epoch, self.workers)
                    noted = self.limits is not None and self.limits.ready()
                    if noted:
                        self._note_limits(epoch)
                order = self._begin()
                if steer.pending:  # a change made for a later step, maybe of this epoch
                    self._prepare()
                resumed = resumed or bool(self.source.resume_positions)
                batches = order.run(self._pass_stream(epoch), self._note_end)
                if merges_tails(self.source.catalog, self.cfg, self.workers):
                    batches = self._tail_merge(epoch).run(batches)
                try:
                    yield from self._steps(batches)
                except BaseException:
                    batches.close()
                    raise
                self._end_stream(batches)
                if cursor.pass_no != this_pass:
                    break
                if steer.due() and not self._epoch_done(cursor.yielded):  # else at the next epoch's start
                    self._take_due()
                if steer.restart:
                    continue
                target = steer.skip_target()
                if target is None or not self._seek(epoch, target):
                    break
        finally:
            if resumed and cursor.pass_no == this_pass:
                self._drop_resume()
        if self.limits is not None and not noted:
            self._note_limits(epoch)
        if cursor.pass_no == this_pass:  # the epoch is complete (unless a later pass took over)
            self._finish_pass(epoch)

    def _steps(self, batches: Iterator[Batch]) -> Iterator[dict]:
        """The loader's batches as the run's steps: one each, or grouped by the schedule, up to a
        skipped step (``Steerer.steps``)."""
        steer = self.steering
        if steer.plain:
            changes, pending = steer.log.changes, steer.pending  # a change made meanwhile leaves this path
            for batch in batches:
                steer.planned += 1
                out = self._hand_out(batch)
                if self.limits is not None:  # its exact count begins once a first batch is out
                    self.limits.start_count()
                yield out
                if changes or pending:
                    break
            else:
                return
        for group in steer.steps(batches, self._reload if steer.reload_every else None):
            out = self._hand_out_group(group)
            if self.limits is not None:
                self.limits.start_count()
            yield out
            if self._ahead is not None:  # a change's pass may start its workers now
                self._prestart_workers()

    def _tail_merge(self, epoch: int) -> TailMerge:
        """The stage that holds the workers' epoch-final batches and merges them (``tails.py``),
        leaving out the merged batches handed out before a resume."""
        catalog = self.source.catalog
        mix = (catalog.mixing, catalog.mode) if catalog.mixing is not None else None
        key = merge_key(self.cfg, epoch, self.rank, self.world_size, self.workers)
        return TailMerge(self.cfg, key, self.cursor.tails, self.stats.add, mix)

    def _note_end(self, end: EndOfWorker) -> None:
        self.stats.add(end.stats)

    def _iter_infinite(self) -> Iterator[dict]:
        cursor = self.cursor
        if self._stream is None:
            self.source.set_epoch(cursor.epoch)
            order = self._begin()
            # The loader keeps its endless stream between iterations; a stream that held the loader
            # too would make a cycle, so a dropped loader would keep its DataLoader workers and
            # downloads running until a garbage collection, which may come in a process forked later.
            on_end = functools.partial(_note_end, weakref.ref(self))
            self._stream = order.run(
                self._transport.stream(self.pipeline, torch_seed(self.cfg.seed, cursor.epoch)), on_end
            )
        steps = self.cfg.steps_per_epoch
        steer = self.steering
        if steer.reload_every is not None or steer.log.changes:
            raise SteeringError(
                "steering an endless stream needs its epochs whole, one after another, to say where a planned step "
                "is: pass equal_batches=True (docs/steering.md)"
            )
        while steps is None or cursor.steps < steps:
            group = list(itertools.islice(self._stream, steer.group_at(steer.planned)))
            if not group:
                return
            cursor.steps += 1
            steer.planned += 1
            yield self._hand_out_group(group)
        cursor.steps = 0

    def _iter_passes(self) -> Iterator[dict]:
        """An endless stream of whole epochs (``Config.endless_by_epochs``): each a finite pass
        with the finite run's equal batch counts, the next epoch after it. A ``steps_per_epoch``
        loop ends after its steps; the next loop goes on in the same pass."""
        cursor = self.cursor
        steps = self.cfg.steps_per_epoch
        empty = 0  # passes in a row that yielded nothing: an epoch with no batch would loop forever
        while steps is None or cursor.steps < steps:
            if self._pass is None:
                self._pass = self._iter_epoch()
            batch = next(self._pass, None)
            if batch is None:
                self._pass = None
                cursor.epoch = (cursor.completed if cursor.completed is not None else cursor.epoch) + 1
                empty += 1
                if empty > 1:
                    raise ConfigError(
                        f"epoch {cursor.epoch - 1} yields no batch on rank {self.rank}: an endless stream of such "
                        "epochs would never yield (fewer items than ranks x batch_size?)"
                    )
                continue
            empty = 0
            cursor.steps += 1
            yield batch
        cursor.steps = 0

    def _drop_resume(self) -> None:
        """Forget a restored position once it has been used (or abandoned): later epochs start
        fresh, and persistent workers, which hold a copy of it, are restarted once."""
        self.source.resume_from({})
        self.cursor.restored = None
        self._transport.forget()

    def mix_stats(self) -> dict[str, dict]:
        """A mixture's realized mix on this rank: per source, tokens and items delivered so far
        (``tokens``, ``items``) and in this epoch (``epoch_tokens``, ``epoch_items``), this epoch's
        share in the mixture's unit next to the planned ones (``share``; ``target_share``: the
        weights of the schedule's phase in force now; ``epoch_target_share``: the epoch's average,
        its quotas' shares), and the epoch's quota in the unit (``epoch_quota`` over all ranks,
        ``rank_quota`` this rank's)."""
        if self._mix is None:
            raise ConfigError("mix_stats() reports a mixture; this loader reads one dataset")
        return self._mix.report(self.world_size)

    def metrics(self) -> dict[str, float]:
        """What this loader measured of its data path, as a flat dict of numbers any logger takes
        (the data wait on this thread, and over the ranks where ``reduce_every`` is set); the keys
        are listed in docs/observability.md."""
        out = self.observer.metrics(self.stats.skipped_shards, self.world_size)
        out.update(self._steer_metrics())
        return out

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self, *, kept_per_rank: bool = False) -> dict[str, str]:
        """Where this rank's stream stands, as ``{"format": "wdsllm.loader/8", "state": JSON}``:
        two strings that every checkpointer keeps whole (see docs/loader.md and state.py). Replica
        peers (docs/parallel.md) hold one state, each its own copy (a receiver's is its reader's,
        mirrored with every batch): no collective, so one rank alone may save
        (``if rank == 0: save(loader.state_dict())``).

        A state that only this rank can resume from (ranks yield different numbers of batches) is
        a warning, once, unless ``kept_per_rank`` says the caller keeps every rank's state apart:
        a checkpointer that keeps one copy for all ranks would lose the others'."""
        sealed = self._own_state()
        warn = not kept_per_rank and not self._warned_per_rank
        if warn and self.here.rank_specific(statemod.LoaderState.load(sealed)):
            self._warned_per_rank = True
            log.warning(
                "rank %d's loader state holds a position only this rank can resume from (ranks yield different "
                "numbers of batches: equal_batches is off, or the batches cannot be counted before reading): keep "
                "each rank's state apart (torch.save per rank, a key per rank); a checkpointer that keeps one copy "
                "for every rank, as torch.distributed.checkpoint does under one key, loses the other ranks' "
                "(docs/loader.md, 'Checkpoints and resumption')",
                self.rank,
            )
        return sealed

    def _own_state(self) -> dict[str, str]:
        self._settle_epoch()
        cursor = self.cursor
        if cursor.restored is not None:
            return cursor.restored.state.sealed()
        in_epoch = cursor.order is not None or (self._streamed and self._stream is not None)
        if in_epoch and not self._streamed and cursor.yielded and self._epoch_done(cursor.yielded):
            # The last batch is out: a resume starts the next epoch, not an empty rest of this one.
            self._skip_rest(cursor.epoch)
            in_epoch = False
            cursor.completed = cursor.epoch
        position = cursor.get(in_epoch)
        position["steering"] = self.steering.saved()
        return self.here.state(position).sealed()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state saved by ``state_dict`` (on any rank when batches were equal).

        Everything in it is checked before anything changes (types, fingerprints, and the
        positions against the epoch's batch counts); a state that does not fit is refused with a
        StateError naming the field. Another world size or worker count is accepted for finite
        epochs: the rest of the saved epoch is re-planned for this layout (every unconsumed
        document once, in another order).
        """
        if not self._started:
            self._settle_world()
        st = statemod.LoaderState.load(state)
        # the run's changes shape its plans (exclusions, a mixture's weights): checked under them
        steer_plans(st.steering.log if st.steering else Log(), self.catalog, self.source)
        try:
            check_fits(st, self.here, exact_order=self.read_options.on_error == "raise")
        except Exception:
            steer_plans(self.steering.log, self.catalog, self.source)
            raise
        # The state fits: from here on nothing is refused.
        self._total.forget()
        self._stream = self._pass = None
        self._transport.forget()
        restore(self.cursor, st, self.here)
        same_layout = (st.world_size, st.num_workers) == (self.world_size, self.workers)
        self.steering.restore(st.steering, same_layout)
        self._reschedule()


def loader(
    source: Any,
    *,
    order: OrderOptions | None = None,
    batch: BatchOptions | None = None,
    workers: WorkerOptions | None = None,
    reading: ReadingOptions | None = None,
    layout: LayoutOptions | None = None,
    observe: ObserveOptions | None = None,
    steer: SteerOptions | None = None,
    **options: Any,
) -> Loader:
    """Batches of ``source`` for this rank, with DataLoader workers, ``set_epoch`` and an exact
    ``state_dict``. The options are the fields of the records (``OrderOptions``, ``BatchOptions``,
    ``WorkerOptions``, ``ReadingOptions``, ``LayoutOptions``, ``ObserveOptions``), as keywords
    (``batch_size=32``) or whole (``batch=BatchOptions(...)``); each is described in docs/loader.md."""
    return Loader(
        source,
        order=order,
        batch=batch,
        workers=workers,
        reading=reading,
        layout=layout,
        observe=observe,
        steer=steer,
        **options,
    )
