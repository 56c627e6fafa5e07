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

import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .. import storage
from ..errors import ConfigError, NotADatasetError, StateError, UsageError
from ..inputs.sources import DEFAULT_MAX_DOC_BYTES
from . import resume as resumemod
from . import state as statemod
from .batching import Batch
from .catalog import open_catalog
from .collate import CollateOptions, collate_docs, collate_rows
from .config import Config, read_options, resolve_world
from .counts import EpochCounts, EpochPlan, batch_counts, equalised, round_robin_share
from .dataset import EndOfWorker, build_pipeline, dataset_tokenizer
from .mixcatalog import MixTally
from .raw import check_world, take_raw_options
from .transport import RingHolder, TokenRing, received

log = logging.getLogger(__name__)

#: batches per message from a worker (see pipeline._bundle)
BUNDLE_BATCHES = 16


def _identity(x: Any) -> Any:
    return x


class RoundRobin:
    """DataLoader's order: turns over the workers that still have batches, starting at ``turn``."""

    def __init__(self, workers: int, turn: int = 0, active: list[int] | None = None):
        self.queues = [deque() for _ in range(workers)]
        self.active = list(range(workers)) if active is None else list(active)
        self.turn = turn

    def _advance(self) -> None:
        if self.active:
            self.turn = min((w for w in self.active if w > self.turn), default=self.active[0])

    def run(self, raw: Iterator, on_end: Callable[[EndOfWorker], None]) -> Iterator[Batch]:
        while self.active:
            if self.turn not in self.active:
                self._advance()
            while not self.queues[self.turn]:
                item = next(raw, None)
                if item is None:
                    break
                self.queues[item.worker].append(item)
            if not self.queues[self.turn]:  # DataLoader ended without this worker's end marker
                self.active.remove(self.turn)
                continue
            item = self.queues[self.turn].popleft()
            if isinstance(item, EndOfWorker):
                on_end(item)
                self.active.remove(self.turn)
                continue
            self._advance()
            yield item


def _note_end(loader: weakref.ref, end: EndOfWorker) -> None:
    """A worker's end marker, counted by its loader while there is one."""
    live = loader()
    if live is not None:
        live._note_stats(end.stats)


class Loader:
    """Iterate batches for this rank; call ``set_epoch(e)`` before each epoch (see docs/loader.md)."""

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int | None = 32,
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
        num_workers: int = 0,
        prefetch_factor: int | None = 2,
        persistent_workers: bool | None = None,
        pin_memory: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        retry: storage.RetryPolicy | None = None,
        cache_dir: str | None = None,
        cache_size: int = 64 << 30,
        on_error: str = "raise",
        check_groups: bool = True,
        multiprocessing_context: Any = None,
        workers_in_process: bool = False,
        fetch_process: bool | None = None,
    ):
        options = dict(
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
        self.catalog = open_catalog(source, retry=retry, on_error=on_error)
        #: rank and world size given, or found (torch.distributed, RANK/WORLD_SIZE); found ones are
        #: looked up again when iteration starts, in case the process group came up after this
        self._explicit_world = rank is not None or world_size is not None
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.cfg = Config(**options).resolved(self.catalog)
        if self.cfg.unbatched:
            raise ConfigError(
                "the loader yields batches: pass batch_size (or max_tokens with batching='bucket'); "
                "for one document at a time use wdsllm.dataset(..., batch_size=None)"
            )
        self.num_workers = int(num_workers)
        if self.num_workers < 0:
            raise ConfigError(f"num_workers must be 0 or more, not {num_workers}")
        self.prefetch_factor = prefetch_factor if self.num_workers > 0 else None
        if persistent_workers is None:
            # from a store, a worker forked afresh each epoch builds its clients and connections
            # again and cannot start the next epoch's first shards (docs/remote.md)
            persistent_workers = self.num_workers > 0 and any(storage.is_remote(u) for u in self.catalog.urls)
        self.persistent_workers = bool(persistent_workers) and self.num_workers > 0
        self.pin_memory = pin_memory
        self.multiprocessing_context = multiprocessing_context
        #: run the workers' streams in this process, one after another (debugging and tests)
        self.workers_in_process = workers_in_process
        self.read_options = read_options(retry, cache_dir, cache_size, on_error, check_groups, fetch_process)
        self._ring = RingHolder()  # shared memory the workers send tokens through (transport.py)
        self._tokenizer: Any = None
        self._build()
        self.collate_options = CollateOptions.for_config(self.cfg, self.catalog)
        self._collate = collate_rows if self.cfg.rows_out(self.catalog) else collate_docs
        #: a mixture's delivered tokens and items per source (``mix_stats``)
        self._mix = MixTally(self.catalog) if self.catalog.mixing is not None else None
        self._epoch = 0
        self._auto_epoch = True  # until set_epoch is called, each completed pass advances the epoch
        self._completed: int | None = None  # the last epoch iterated to its end
        self._dataloader: DataLoader | None = None
        self._stream: Iterator | None = None  # the endless stream of an infinite loader
        self._rr: RoundRobin | None = None
        self._started = False  # whether any iteration has begun (rank and world are then fixed)
        self._pass = 0  # the current pass; a pass abandoned by its caller must not touch a later one
        self._positions: dict[int, tuple] = {}  # worker -> (epoch, batches handed out, batcher hint)
        self._yielded = 0  # batches handed out this epoch (finite) or since the stream began
        self._steps = 0  # batches handed out in the current steps_per_epoch loop
        self._pending_resume: dict | None = None
        self._total_key, self._total = None, None  # cached batch count of the current epoch
        #: the equal-batches decision of the current epoch: dropped batches of this rank etc.
        self.limits = None
        self.dropped_batches = 0
        #: tokens cut by max_len_mode="truncate", and shards skipped as unreadable (on_error="skip")
        self.truncated_tokens = 0
        self.skipped_shards: list[str] = []
        #: raw text: bad lines or rows skipped (on_error="skip"), counted once each
        self.skipped_docs = 0
        #: batches repeated to keep counts equal after shards were skipped (on_error="skip")
        self.refilled_batches = 0

    def _build(self) -> None:
        self.pipeline = build_pipeline(
            self.catalog,
            self.cfg,
            self.rank,
            self.world_size,
            self.read_options,
            collate=False,
            end_marker=True,
            bundle=BUNDLE_BATCHES if self.num_workers > 0 and not self.workers_in_process else 0,
            ring=self._ring,
        )
        self.source = self.pipeline.source

    @property
    def workers(self) -> int:
        return max(1, self.num_workers)

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
        self._total_key, self._total = None, None
        self._dataloader = None

    # -- epochs ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next pass runs (or the one in progress)."""
        self._settle_epoch()
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shuffle the next iteration uses (as DistributedSampler does).

        Without calls the epoch advances by one after every completed pass.
        """
        self._settle_epoch()
        if self._pending_resume is not None and int(epoch) != self._epoch:
            log.warning("set_epoch(%d) after load_state_dict: the restored epoch %d is abandoned", epoch, self._epoch)
            self._drop_resume()
        self._epoch = int(epoch)
        self._auto_epoch = False

    def _settle_epoch(self) -> None:
        """Close a pass whose last batch was handed out but whose iterator was never exhausted.

        Trainers (Lightning) stop after ``len(loader)`` batches without asking for one more, so
        the generator never reaches its end; without this the next pass would repeat the epoch.
        """
        if self._rr is None or self.infinite or not self._yielded or not self._epoch_done(self._yielded):
            return
        self._finish_pass(self._epoch)

    def _finish_pass(self, epoch: int) -> None:
        self._pass += 1  # the finished pass's generator, if resumed or collected later, does nothing
        self._rr = None
        self._completed = epoch
        if self.source.resume_positions or self._pending_resume is not None:
            self._drop_resume()
        if self._auto_epoch:
            self._epoch = epoch + 1

    @property
    def infinite(self) -> bool:
        return self.cfg.infinite

    def at_end_of_pass(self) -> bool:
        """Whether the batch just handed out was the last of this pass (the epoch's, or the
        ``steps_per_epoch`` loop's); never for an endless stream without ``steps_per_epoch``.
        Also right after a resume, where the pass began mid-way."""
        if self.cfg.steps_per_epoch is not None:
            return self._steps == self.cfg.steps_per_epoch
        if self.infinite or self._rr is None:
            return False
        return self._yielded > 0 and self._epoch_done(self._yielded)

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
        return total

    def _epoch_total(self) -> int | None:
        """Batches this rank yields in the current epoch, from the index (None without one)."""
        plan = self.source.plan_for(self._epoch)
        key = (self._epoch, id(plan), self.world_size)
        if self._total_key != key:
            limits = self.source.limits(self._epoch, self.workers)
            if limits is not None:
                total = limits.per_rank
            else:  # this rank's own batches: its own shares alone
                counts = EpochCounts.create(
                    self.catalog, self.cfg, self._epoch, self.world_size, self.workers, plan, ranks=[self.rank]
                )
                total = None if counts is None else int(counts.exact()[self.rank].sum())
            self._total_key, self._total = key, total
        return self._total

    def _epoch_done(self, yielded: int) -> bool:
        """Whether ``yielded`` batches are the whole epoch (without waiting for a count that is
        still being made while fewer batches than its lower bound are out)."""
        limits = self.limits
        if limits is not None and not limits.ready() and yielded < limits.per_rank_bound:
            return False
        return yielded == self._epoch_total()

    def _note_limits(self, epoch: int) -> None:
        """Log and keep this rank's dropped batches once the equal-batches decision is known."""
        self.dropped_batches = self.limits.dropped_batches
        if self.dropped_batches:
            log.info(
                "rank %d: epoch %d yields %d batches; %d batches beyond the smallest rank's count are dropped",
                self.rank,
                epoch,
                self.limits.per_rank,
                self.dropped_batches,
            )

    # -- iteration ------------------------------------------------------------------------------
    def _worker_batches(self) -> Iterator:
        """Compact batches and end markers from the workers (or this process)."""
        if self.num_workers == 0:
            return iter(self.pipeline)
        if self.workers_in_process:
            return self._interleave([self.pipeline.worker_iter(w, self.num_workers) for w in range(self.num_workers)])
        fresh_workers = self._dataloader is None or not self.persistent_workers
        if fresh_workers:
            # workers about to be forked get a ring of their own (an abandoned iterator's workers
            # may still be writing into the old one)
            self._ring.ring = TokenRing(self.num_workers, slots=(self.prefetch_factor or 2) + 2)
            storage.prepare_workers()  # what each worker would build again (an S3 client), built once here
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
        return (item for bundle in iter(self._dataloader) for item in received(bundle))

    @staticmethod
    def _interleave(streams: list) -> Iterator:
        """One item from each worker's stream in turn, as DataLoader asks its workers."""
        live = list(streams)
        while live:
            for stream in list(live):
                item = next(stream, None)
                if item is None:
                    live.remove(stream)
                else:
                    yield item

    def _note_stats(self, stats: dict) -> None:
        self.truncated_tokens += stats.get("truncated_tokens", 0)
        self.skipped_shards.extend(stats.get("skipped_shards", ()))
        self.skipped_docs += stats.get("skipped_docs", 0)
        self.refilled_batches += stats.get("refilled", 0)

    def _hand_out(self, batch: Batch) -> dict:
        if self._mix is not None:
            self._mix.add(batch.mix, batch.epoch)
        out = self._collate(batch.items, self.collate_options)
        out["epoch"] = batch.epoch
        if batch.stats:
            self._note_stats(batch.stats)
        self._positions[batch.worker] = (batch.epoch, batch.index + 1, batch.hint)
        self._yielded += 1
        if self.pin_memory and torch.cuda.is_available():
            out = {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
        return out

    def __iter__(self) -> Iterator[dict]:
        self._settle_world()
        self._settle_epoch()
        self._started = True
        if self.infinite:
            return self._iter_infinite()
        return self._iter_epoch()

    def _begin(self) -> RoundRobin:
        """Start the stream, from a restored state if one is pending."""
        rr = RoundRobin(self.workers)
        if self._pending_resume is not None:
            st = self._pending_resume
            rr = RoundRobin(self.workers, st["turn"], st["active"])
            self._positions = self.source.resume_positions
            self._yielded = st["yielded"]
            self._steps = st["steps"]
            self._pending_resume = None
        else:
            self._positions = {}
            self._yielded = 0
        self._rr = rr
        return rr

    def _iter_epoch(self) -> Iterator[dict]:
        self._pass += 1
        this_pass = self._pass
        epoch = self._epoch
        self.source.set_epoch(epoch)
        self.limits = self.source.limits(epoch, self.workers)
        noted = self.limits is not None and self.limits.ready()  # else once the count is done
        if noted:
            self._note_limits(epoch)
        rr = self._begin()
        resumed = bool(self.source.resume_positions)
        try:
            for batch in rr.run(self._worker_batches(), lambda end: self._note_stats(end.stats)):
                yield self._hand_out(batch)
        finally:
            if resumed and self._pass == this_pass:
                self._drop_resume()
        if self.limits is not None and not noted:
            self._note_limits(epoch)
        if self._pass == this_pass:  # the epoch is complete (unless a later pass took over)
            self._finish_pass(epoch)

    def _iter_infinite(self) -> Iterator[dict]:
        if self._stream is None:
            self.source.set_epoch(self._epoch)
            rr = self._begin()
            # The loader keeps its endless stream between iterations; a stream that held the loader
            # too would make a cycle, so a dropped loader would keep its DataLoader workers and
            # downloads running until a garbage collection, which may come in a process forked later.
            loader = weakref.ref(self)
            self._stream = rr.run(self._worker_batches(), lambda end: _note_end(loader, end))
        steps = self.cfg.steps_per_epoch
        while steps is None or self._steps < steps:
            try:
                batch = next(self._stream)
            except StopIteration:
                return
            self._steps += 1
            yield self._hand_out(batch)
        self._steps = 0

    def _drop_resume(self) -> None:
        """Forget a restored position once it has been used (or abandoned): later epochs start
        fresh, and persistent workers, which hold a copy of it, are restarted once."""
        self.source.resume_from({})
        self._pending_resume = None
        self._dataloader = None

    def mix_stats(self) -> dict[str, dict]:
        """A mixture's realized mix on this rank: per source, tokens and items delivered so far
        (``tokens``, ``items``) and in this epoch (``epoch_tokens``, ``epoch_items``), this epoch's
        share in the mixture's unit next to the planned one (``share``, ``target_share``), and the
        epoch's quota in the unit (``epoch_quota`` over all ranks, ``rank_quota`` this rank's)."""
        if self._mix is None:
            raise ConfigError("mix_stats() reports a mixture; this loader reads one dataset")
        return self._mix.report(self.world_size)

    # -- state ----------------------------------------------------------------------------------
    def _settings(self) -> str:
        return resumemod.settings_fingerprint(self.cfg)

    def state_dict(self) -> dict[str, str]:
        """Where this rank's stream stands, as ``{"format": "wdsllm.loader/2", "state": JSON}``:
        two strings that every checkpointer keeps whole (see docs/loader.md and state.py)."""
        self._settle_epoch()
        if self._pending_resume is not None:
            return self._pending_resume["state"].sealed()
        in_epoch = self._rr is not None or (self.infinite and self._stream is not None)
        if in_epoch and not self.infinite and self._yielded and self._epoch_done(self._yielded):
            # The last batch is out: a resume starts the next epoch, not an empty rest of this one.
            in_epoch = False
            self._completed = self._epoch
        equal = self.cfg.keeps_equal_batches(self.world_size)
        epoch = self._epoch
        if not in_epoch and self._completed is not None and self._completed == epoch:
            epoch += 1  # saved after a finished epoch: the next one is what a resume runs
        plan = self.source.plan_for(epoch)
        st = statemod.LoaderState(
            dataset=self.catalog.fingerprint(),
            settings=self._settings(),
            config=dict(vars(self.cfg)),
            rank=self.rank,
            world_size=self.world_size,
            num_workers=self.workers,
            equal_batches=bool(equal),
            infinite=self.infinite,
            epoch=epoch,
            yielded=self._yielded if in_epoch else 0,
            steps=self._steps,
            workers={w: statemod.Position(*p) for w, p in sorted(self._positions.items())} if in_epoch else {},
            turn=self._rr.turn if (in_epoch and self._rr is not None) else 0,
            active=list(self._rr.active) if (in_epoch and self._rr is not None) else None,
            plan=plan if isinstance(plan, resumemod.RemainderPlan) else None,
        )
        return st.sealed()

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
        statemod.check_identity(
            st, dataset=self.catalog.fingerprint(), settings=self._settings(), infinite=self.infinite
        )
        mixture = getattr(self.catalog, "mixture", None)
        moved = st.world_size != self.world_size and mixture is not None
        if st.workers and moved and any(p.at_step is not None for p in mixture.phases):
            raise StateError(
                f"the mixture's schedule has at_step points, which are converted with the world size "
                f"({st.world_size} when saved, {self.world_size} now): an elastic resume would move them; "
                "write the points as at_tokens / at_items to resume with another world size"
            )
        statemod.check_positions(st, self.catalog, self.cfg, exact_order=self.read_options.on_error == "raise")
        same_layout = st.world_size == self.world_size and st.num_workers == self.workers
        if st.workers and not same_layout and self.infinite:
            raise StateError("resuming an endless stream with another world size or worker count is not supported")
        if st.workers and same_layout and st.rank != self.rank and not st.equal_batches:
            raise StateError(
                f"this state is rank {st.rank}'s and ranks yielded different numbers of batches; load each rank's own "
                "state"
            )
        if st.workers and not same_layout and st.world_size > 1 and not st.equal_batches:
            raise StateError("an elastic resume needs equal batch counts on the old ranks (equal_batches=True)")
        # The state fits: from here on nothing is refused.
        self._pass += 1  # an iterator of an earlier pass no longer touches this loader
        self._rr = None
        self._total_key = None
        self._stream = None
        self._dataloader = None
        self._epoch = st.epoch
        self._completed = None
        self._pending_resume = None
        self.source.set_plan(st.plan.epoch if st.plan else None, st.plan)
        if not st.workers:
            self.source.resume_from({})
            return  # saved between epochs: the next iteration starts epoch `epoch` afresh
        if not same_layout:
            self._elastic(st)
            return
        if st.rank == self.rank:
            positions = {w: p.as_tuple() for w, p in st.workers.items()}
        else:
            positions = self._positions_from(st)
        if self.infinite:
            turn, active = st.turn, list(range(self.workers))
        else:
            turn, active = self._turn_from(positions)
        self.source.resume_from(positions)
        self._pending_resume = {"turn": turn, "active": active, "yielded": st.yielded, "steps": st.steps, "state": st}

    # -- helpers for loading ----------------------------------------------------------------------
    def _worker_counts(self, epoch: int, world: int, workers: int, plan: EpochPlan | None) -> np.ndarray:
        counts = batch_counts(self.catalog, self.cfg, epoch, world, workers, plan)
        if counts is None:
            raise StateError("this needs the dataset's index (lengths.npy) to recompute other ranks' positions")
        return equalised(counts) if self.cfg.keeps_equal_batches(world) else counts

    def _positions_from(self, st: statemod.LoaderState) -> dict[int, tuple]:
        """This rank's per-worker positions, from another rank's state (equal batch counts)."""
        epoch, k = st.epoch, st.yielded
        counts = self._worker_counts(epoch, self.world_size, self.workers, self.source.plan_for(epoch))[self.rank]
        share = round_robin_share(counts, k)
        return {w: (epoch, int(share[w]), None) for w in range(self.workers)}

    def _turn_from(self, positions: dict) -> tuple[int, list[int]]:
        """The round-robin turn after these per-worker counts: the worker after the last one
        served (the last in worker order among those that served the most rounds). Workers that
        are done stay in the turn order: their end markers are consumed when their turn comes,
        which yields no batch, so the sequence of batches is the same."""
        served = [positions.get(w, (0, 0))[1] for w in range(self.workers)]
        most = max(served) if served else 0
        if most == 0:
            return 0, list(range(self.workers))
        last = max(w for w in range(self.workers) if served[w] == most)
        return (last + 1) % self.workers, list(range(self.workers))

    def _elastic(self, st: statemod.LoaderState) -> None:
        """Re-plan the rest of the saved epoch for this world size and worker count."""
        epoch, plan = st.epoch, st.plan
        old_world, old_workers = st.world_size, st.num_workers
        counts = self._worker_counts(epoch, old_world, old_workers, plan)
        consumed = [[int(x) for x in round_robin_share(counts[r], st.yielded)] for r in range(old_world)]
        if old_world == 1:
            consumed = [[st.workers[w].batches if w in st.workers else 0 for w in range(old_workers)]]
        remainder = resumemod.RemainderPlan(epoch, old_world, old_workers, consumed, base=plan)
        self.source.set_plan(epoch, remainder)
        self.source.resume_from({})
        log.info(
            "resuming epoch %d of a %d x %d layout as %d x %d: the epoch's remainder is re-planned",
            epoch,
            old_world,
            old_workers,
            self.world_size,
            self.workers,
        )


def loader(
    source: Any,
    *,
    batch_size: int | None = 32,
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
    num_workers: int = 0,
    prefetch_factor: int | None = 2,
    persistent_workers: bool | None = None,
    pin_memory: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    retry: storage.RetryPolicy | None = None,
    cache_dir: str | None = None,
    cache_size: int = 64 << 30,
    on_error: str = "raise",
    check_groups: bool = True,
    multiprocessing_context: Any = None,
    workers_in_process: bool = False,
    fetch_process: bool | None = None,
    tokenizer: Any = None,
    text_field: str = "text",
    counts: str | None = None,
    where: str | None = None,
    split: str = "line",
    bos: bool | None = None,
    eos: bool = True,
    input_format: str | None = None,
    unit_bytes: int | None = None,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
) -> Loader:
    """Batches of ``source`` for this rank, with DataLoader workers, ``set_epoch`` and an exact
    ``state_dict``. Every option is described in docs/loader.md; the batching options are those of
    ``wdsllm.dataset``."""
    args = dict(locals())
    source = take_raw_options(args)  # with tokenizer=: raw text, tokenized in the workers (raw.py)
    del args["source"]
    out = Loader(source, **args)
    check_world(out.catalog, out.cfg.keeps_equal_batches(out.world_size), out.cfg.steps_per_epoch)
    return out
