"""Moving batches from DataLoader workers to the main process through shared memory.

A packed batch of 64 rows of 2,048 tokens carries 256 KiB of tokens. Pickled through
DataLoader's queue it is copied four times, and the pipe's 64 KiB capacity makes a worker and the
main process take turns: with 2 workers that cost the packed loader two thirds of its rate.

Instead, with fork-started workers, the loader maps a shared anonymous region (a ``TokenRing``)
before the workers start. Each worker compacts a bundle's tokens straight into the next slot of
its own ring of slots and sends only their place (``RingBundle``); the main process copies them
out while it unpickles the message and then acknowledges it, so a worker reuses a slot only
after its contents were taken. DataLoader keeps at most ``prefetch_factor`` messages of a worker
outstanding, so with a few more slots than that a worker never waits; the wait is a safety net.
Under spawn or forkserver, or for a bundle larger than a slot, batches are pickled whole through
the DataLoader's queue.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import signal
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from .. import storage
from ..errors import ConfigError, WdsllmError
from ..observe import stages
from ..observe.board import WorkerBoard
from ..observe.report import Reporter, WorkerReport, timed_stream
from ..observe.watchdog import process_state
from ..observe.workers import WorkerTally
from .batching import Batch

HEADER = 4096  # one int64 acknowledgement counter per worker
SLOT_BYTES = 4 << 20  # a bundle holds at most 1M tokens (BUNDLE_TOKENS) of at most 4 bytes

#: rings of this process by key, so that an unpickled message finds its ring
_RINGS: weakref.WeakValueDictionary[str, TokenRing] = weakref.WeakValueDictionary()
_keys = itertools.count()


class TokenRing:
    """Per-worker rings of token slots in memory shared with forked DataLoader workers."""

    def __init__(self, workers: int, slots: int, slot_bytes: int = SLOT_BYTES):
        if workers * 8 > HEADER:
            raise ConfigError(f"at most {HEADER // 8} workers")
        self.key = f"{os.getpid()}-{next(_keys)}"
        self.workers, self.slots, self.slot_bytes = workers, slots, slot_bytes
        self.mm = mmap.mmap(-1, HEADER + workers * slots * slot_bytes)  # MAP_SHARED | MAP_ANONYMOUS
        # messages of each worker the main process has taken; written by it, read by the worker
        self.taken = np.frombuffer(self.mm, np.int64, count=workers)
        self.sent = [0] * workers  # each worker process advances only its own entry
        self.owner = os.getpid()
        _RINGS[self.key] = self

    def __getstate__(self):
        # Spawned workers get no ring (an anonymous mapping does not survive pickling): they
        # fall back to pickled batches.
        return {"key": self.key, "workers": self.workers}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.mm = None

    @property
    def usable(self) -> bool:
        """True in the process that made the ring and in workers forked from it."""
        return self.mm is not None

    def pack(self, worker: int, bundle: list) -> RingBundle | None:
        """The bundle with its batches' tokens compacted into this worker's next slot, or None
        when they do not fit one (the caller then pickles the batches)."""
        batches = [b for b in bundle if isinstance(b, Batch)]
        if not batches:
            return None
        dtype = batches[0].items.tokens.dtype
        sizes = [b.items.n_tokens if isinstance(b, Batch) else 0 for b in bundle]
        if sum(sizes) * dtype.itemsize > self.slot_bytes or any(b.items.tokens.dtype != dtype for b in batches):
            return None
        seq = self.sent[worker]
        self._wait_for_slot(worker, seq)
        offset = HEADER + (worker * self.slots + seq % self.slots) * self.slot_bytes
        flat = np.frombuffer(self.mm, dtype, count=sum(sizes), offset=offset)
        ranges, at = [], 0
        for batch, size in zip(bundle, sizes):
            if not isinstance(batch, Batch):
                ranges.append(None)
                continue
            batch.items = batch.items.compact(into=flat[at : at + size])
            batch.items.tokens = None  # travels in the ring
            ranges.append((at, at + size))
            at += size
        self.sent[worker] = seq + 1
        return RingBundle(self.key, worker, seq, offset, dtype.str, at, ranges, bundle)

    def _wait_for_slot(self, worker: int, seq: int) -> None:
        """Until the message that last used the slot of message ``seq`` has been taken."""
        delay = 1e-4
        while int(self.taken[worker]) <= seq - self.slots:
            if os.getppid() != self.owner:  # the main process is gone
                raise WdsllmError("the loader's process exited")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def take(self, msg: RingBundle) -> np.ndarray:
        """Copy a message's tokens out of its slot and free the slot (main process)."""
        began = time.perf_counter()
        tokens = np.frombuffer(self.mm, np.dtype(msg.dtype), count=msg.count, offset=msg.offset).copy()
        self.taken[msg.worker] = msg.seq + 1
        stages.add("transport", time.perf_counter() - began)
        return tokens


@dataclass
class RingBundle:
    """A bundle whose batches' tokens wait in a ring slot; unpickling takes them out."""

    key: str
    worker: int
    seq: int
    offset: int
    dtype: str
    count: int
    token_ranges: list  # (start, stop) per batch in the slot, None for an end marker
    batches: list  # Batch (items.tokens None in transit) or EndOfWorker
    tokens: np.ndarray | None = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "tokens"}

    def __setstate__(self, state: dict) -> None:
        # Runs in the main process as DataLoader reads the message, whether or not the batches
        # are used (a reset discards them): the slot is freed here, never left waiting.
        self.__dict__.update(state)
        ring = _RINGS.get(self.key)
        if ring is None:
            raise WdsllmError(f"a worker's batches refer to token ring {self.key}, which this process does not hold")
        self.tokens = ring.take(self)

    def unpack(self) -> list:
        for batch, span in zip(self.batches, self.token_ranges):
            if span is not None:
                batch.items.tokens = self.tokens[span[0] : span[1]]
        return self.batches


class RingHolder:
    """The ring a loader's workers write into; the loader swaps in a new ring for each set of
    workers it starts (they are forked with the holder, so they see the ring current then)."""

    def __init__(self) -> None:
        self.ring: TokenRing | None = None
        #: the workers' pids, progress and messages sent (observe/board.py), made with the ring
        self.board: WorkerBoard | None = None


#: tokens per DataLoader message at most (unless one batch holds more)
BUNDLE_TOKENS = 1 << 20


def bundle_batches(batches: Iterator, max_batches: int, max_tokens: int) -> Iterator[list]:
    """Lists of consecutive batches: one DataLoader message per list instead of per batch.

    DataLoader's per-message cost (queues, pickling threads, wake-ups) is several hundred
    microseconds; a bundle amortises it. The first bundle holds one batch so the first batch
    arrives as soon as it is made. A bundle holds at most ``max_tokens`` tokens unless one batch
    alone holds more (so that it fits a slot of the worker's TokenRing).
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


def send_bundles(bundles: Iterable[list], holder: RingHolder) -> Iterator[Any]:
    """Stage after ``bundle_batches`` in DataLoader workers: bundles through the ring where
    possible, else as they are (then compacted, to be pickled). Each bundle ends with the
    worker's report (``observe.report``): what its stages took since its previous one."""
    info = get_worker_info()
    ring = holder.ring
    reporter = Reporter(info.id if info is not None else 0, holder.board)
    for bundle in timed_stream(iter(bundles), "batch"):
        bundle.append(reporter.report())
        began = time.perf_counter()
        out = packed(bundle, ring, info)
        stages.add("transport", time.perf_counter() - began)
        yield out


def packed(bundle: list, ring: Any, info: Any) -> Any:
    """The bundle through the ring where this worker has a part of it, else compacted (pickled)."""
    msg = None
    if ring is not None and ring.usable and info is not None and info.id < ring.workers:
        msg = ring.pack(info.id, bundle)
    if msg is None:
        for batch in bundle:
            if isinstance(batch, Batch):
                batch.items = batch.items.compact()
    return bundle if msg is None else msg


def received(bundle: Any) -> list:
    """The batches of a message from a worker (main process)."""
    return bundle.unpack() if isinstance(bundle, RingBundle) else bundle


def _identity(x: Any) -> Any:
    return x


def _arrivals(messages: Iterable[Any], tally: WorkerTally) -> Iterator:
    """The batches and end markers of the workers' messages; their reports go to ``tally``."""
    for message in messages:
        for item in received(message):
            if isinstance(item, WorkerReport):
                tally.add(item)
            else:
                yield item


class WorkerBatches:
    """The stage between a loader's workers and its round-robin: compact batches and end markers
    as they arrive, from DataLoader workers (kept between passes, or forked afresh for each with a
    ring of their own) or, for tests, from the workers' streams run here one after another."""

    def __init__(
        self, num_workers: int, prefetch_factor: int | None, persistent: bool, context: Any, in_process: bool = False
    ):
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.persistent = persistent
        self.context = context
        self.in_process = in_process
        self.ring = RingHolder()  # shared memory the workers send tokens through
        #: what the workers reported with their messages (observe/workers.py)
        self.tally = WorkerTally()
        #: DataLoader's wait for one message before it raises (0: forever; the watchdog's raise)
        self.timeout = 0.0
        self.dataloader: Any = None
        #: every DataLoader iterator started and the worker processes it started: what ``close()``
        #: stops, whoever still holds an iterator (a trainer's ``it = iter(loader)``)
        self._iterators: weakref.WeakSet = weakref.WeakSet()
        self._processes: dict[int, Any] = {}
        #: what DataLoader draws its workers' base seed from (never torch's global RNG, which a
        #: trainer restores from its checkpoint and expects untouched: dropout, init)
        self.generator = torch.Generator()

    @classmethod
    def of(cls, options: Any, reads_remote: Callable[[], bool], in_process: bool = False) -> WorkerBatches:
        """The transport a ``WorkerOptions`` record asks for. Kept workers by default where any
        shard is remote: from a store, a worker forked afresh each epoch builds its clients and
        connections again and cannot start the next epoch's first shards (docs/remote.md)."""
        workers = options.num_workers
        persistent = options.persistent_workers
        if persistent is None:
            persistent = workers > 0 and reads_remote()
        prefetch = options.prefetch_factor if workers > 0 else None
        return cls(workers, prefetch, bool(persistent) and workers > 0, options.multiprocessing_context, in_process)

    @property
    def bundled(self) -> bool:
        """Whether workers send bundles of batches (through the ring): real worker processes."""
        return self.num_workers > 0 and not self.in_process

    def close(self) -> None:
        """Stop every worker this transport started, kept between passes or a pass's own, also
        while an iterator over them is still held: a worker stopped by a signal (SIGSTOP) is
        continued first, for a stopped process never sees the SIGTERM that DataLoader sends; one
        that still does not exit is killed."""
        self.dataloader = None
        processes, self._processes = list(self._processes.values()), {}
        iterators = list(self._iterators)
        self._iterators = weakref.WeakSet()
        for process in processes:
            if process.pid is not None and process_state(process.pid) == "T":
                with contextlib.suppress(OSError):  # it exited meanwhile
                    os.kill(process.pid, signal.SIGCONT)
        for iterator in iterators:
            iterator._shutdown_workers()
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)

    def _started(self, iterator: Any) -> Any:
        """Note a DataLoader iterator and its workers (kept workers: the same ones again)."""
        self._iterators.add(iterator)
        self._processes = {pid: p for pid, p in self._processes.items() if p.is_alive()}  # earlier passes' ended
        for process in iterator._workers:
            self._processes.setdefault(process.pid, process)
        return iterator

    def forget(self) -> None:
        """The next pass starts workers afresh (a new plan or position to ship to them)."""
        self.dataloader = None

    def stream(self, pipeline: Any, seed: int = 0) -> Iterator:
        """One pass of ``pipeline``'s batches and end markers from the workers (or this process);
        ``seed`` seeds the generator DataLoader draws from when the pass starts (``plan.torch_seed``)."""
        self.generator.manual_seed(seed)
        if self.num_workers == 0:
            return timed_stream(iter(pipeline), "batch")
        if self.in_process:
            streams = [pipeline.worker_iter(w, self.num_workers) for w in range(self.num_workers)]
            return timed_stream(_interleave(streams), "batch")
        if self.dataloader is None or not self.persistent:
            # workers about to be forked get a ring of their own (an abandoned iterator's workers
            # may still be writing into the old one)
            self.ring.ring = TokenRing(self.num_workers, slots=(self.prefetch_factor or 2) + 2)
            self.ring.board = self.tally.new_board(self.num_workers)
            storage.prepare_workers()  # what each worker would build again (an S3 client), built once here
            pipeline.source.count_ahead(self.num_workers)  # ... and count again (pieces of documents)
        if self.dataloader is None:
            self.dataloader = DataLoader(
                pipeline,
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=_identity,
                prefetch_factor=self.prefetch_factor,
                persistent_workers=self.persistent,
                multiprocessing_context=self.context,
                generator=self.generator,
                timeout=self.timeout,
            )
        return _arrivals(self._started(iter(self.dataloader)), self.tally)


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
