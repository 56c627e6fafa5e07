"""Batch counts from the index alone: per worker, per rank, and the equal-batches decision.

Everything a worker does in an epoch is decided by (seed, epoch, rank, worker) and the index, so
the number of batches every (rank, worker) will produce is known before any shard is read. With
equal batches each rank stops after the same count N, and because each worker knows how many of
the rank's first N batches are its own (DataLoader takes them round-robin), the cap works inside
the workers: a plain ``torch.utils.data.DataLoader`` also yields exactly N batches per rank, and
no rank waits on another. No torch.

What it costs does not grow with the corpus on the way to the first batch (docs/loader.md,
"Scale"). Every consumer's share comes from one permutation and one running sum over the shards
(``plan.epoch_layout``). Then, by what the mode's count needs (``Batcher.count_by``):

- the number of items (fixed batches, buckets of a batch size): exact at once, closed form;
- the tokens (concat): exact at once, from the index's per-shard tokens and, for each share
  boundary inside a shard, a partial sum read from lengths.npy;
- each window's lengths (token budgets, pack), or items after splitting: an exact lower bound at
  once (from the tokens: a batch holds at most the budget, a row at most seq_len), and the exact
  table from a pass over the lengths in a background thread, shared by the processes of a node
  through a small cache file. A worker streams freely up to its bound and asks for the exact
  count only there; by then the pass is long done.

A mixture's epoch (a ``SizedPlan``) takes the same path: its shares' items and tokens come from
the plan's stretches and the sources' indexes (``MixPlanner.share_sizes``), no consumer's slices
made. Other plans (the remainder of an interrupted epoch) are counted share by share at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from . import plan as planmod
from .batching import COUNT_BY_ITEMS, COUNT_BY_TOKENS, Batcher
from .config import Config
from .handoff import batcher_for, hands_tails, slices_for, with_tails
from .plan import EpochLayout, Slice, source_layout
from .sources.protocol import Source
from .stream import ShareLengths, StreamSpec, has_lengths, slice_item_counts

log = logging.getLogger(__name__)


class EpochPlan(Protocol):
    """A plan that replaces an epoch's normal one: the remainder of an interrupted epoch, or a
    mixture's epoch (``Source.default_plan``)."""

    #: the rest of an interrupted epoch re-planned for a new layout: a loader's state carries it,
    #: and its shares are counted one by one (it has no ``share_sizes``: a ``SizedPlan`` has)
    remainder: bool

    def slices_for(self, catalog: Source, cfg: Config, rank: int, world: int, worker: int, workers: int) -> list[Slice]:
        """The slices (rank, worker) reads, in reading order."""
        ...


class RemainderItems(Protocol):
    """A remainder plan that knows every new consumer's items without making its slices
    (``resume.RemainderPlan``), so that a count by items needs no consumer's slices."""

    def share_items(self, catalog: Source, cfg: Config, world: int, workers: int) -> np.ndarray:
        """[world, workers] items of every consumer's share."""
        ...


class SizedPlan(Protocol):
    """A plan that knows every consumer's items and tokens without making their slices (a
    mixture's: ``mixplan.MixturePlan``), so that its counts need no pass before the first batch."""

    remainder: bool

    def slices_for(
        self, catalog: Source, cfg: Config, rank: int, world: int, worker: int, workers: int
    ) -> list[Slice]: ...

    def share_sizes(
        self, world: int, workers: int, head_tokens: list[Callable[[np.ndarray, np.ndarray], np.ndarray]] | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """([world, workers] items, tokens or None without ``head_tokens``): ``head_tokens[s]``
        gives the tokens of the first k items of source s's shards."""
        ...

    def identity(self) -> list:
        """What decides the shares beside the catalog's fingerprint and the settings (a cache key)."""
        ...


def share_count(catalog: Source, cfg: Config, slices: list[Slice], spec: StreamSpec) -> int | None:
    """Batches a stream of these slices makes; None when the index cannot say. Reads lengths.npy
    a slice at a time when the mode needs lengths (memory: one window)."""
    batcher = batcher_for(catalog, cfg, spec)
    if batcher.count_by == COUNT_BY_ITEMS:
        counts = slice_item_counts(catalog, slices, spec)
        return None if counts is None else batcher.count(int(sum(counts)), None)
    if not has_lengths(catalog):
        return None
    return batcher.count(None, ShareLengths(catalog, slices, spec))


def worker_batch_count(catalog: Source, cfg: Config, spec: StreamSpec, plan: EpochPlan | None = None) -> int | None:
    """Batches (rank, worker) yields in the epoch, from the index alone; None if unknown."""
    return share_count(catalog, cfg, slices_for(catalog, cfg, spec, plan), spec)


def batch_counts(
    catalog: Source, cfg: Config, epoch: int, world: int, workers: int, plan: EpochPlan | None = None
) -> np.ndarray | None:
    """[world, workers] batch counts for a finite epoch, or None when the index cannot say (waits
    for a pass over the lengths where the mode needs one)."""
    counts = EpochCounts.create(catalog, cfg, epoch, world, workers, plan)
    return None if counts is None else counts.exact()


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


def equal_total(counts: np.ndarray, uneven: str = "drop") -> int:
    """Batches every rank yields: the smallest rank's total, or (``uneven="repeat"``) the largest's."""
    per_rank = counts.sum(axis=1)
    return int(per_rank.max() if uneven == "repeat" else per_rank.min())


def padded_share(counts: np.ndarray, total: int) -> np.ndarray:
    """Each worker's share of ``total`` batches: ``round_robin_share`` of its own, and where the
    rank has fewer, the missing ones (repeats) each to the worker with the fewest so far."""
    share = round_robin_share(counts, total)
    for _ in range(total - int(share.sum())):
        share[int(np.argmin(share))] += 1
    return share


def equalised(counts: np.ndarray, uneven: str = "drop") -> np.ndarray:
    """[world, workers] counts made equal per rank: capped at the smallest rank's total, or
    (``uneven="repeat"``) topped up to the largest's."""
    per_rank = equal_total(counts, uneven)
    return np.stack([padded_share(c, per_rank) for c in counts])


# ----------------------------------------------------------------------------------------------
# Counts of every consumer: exact at once, or a bound at once and exact in the background


class _Background:
    """A computation started in a thread of the process that asks first: a forked child (whose
    copy has no thread) starts its own, a pickled copy keeps only a finished result."""

    def __init__(self, fn: Callable[[], np.ndarray]):
        self.fn = fn
        self.result: np.ndarray | None = None
        self._error: BaseException | None = None
        self._pid: int | None = None
        self._done: threading.Event | None = None

    def start(self) -> None:
        if self.result is not None or self._pid == os.getpid():
            return
        self._pid, self._error, self._done = os.getpid(), None, threading.Event()
        threading.Thread(target=self._run, args=(self._done,), name="wdsllm-counts", daemon=True).start()

    def _run(self, done: threading.Event) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the thread that waits for it
            self._error = exc
        finally:
            done.set()

    def ready(self) -> bool:
        return self.result is not None

    def get(self) -> np.ndarray:
        if self.result is None:
            self.start()
            self._done.wait()
            if self._error is not None:
                raise self._error
        return self.result

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pid"] = state["_done"] = state["_error"] = None
        return state


class EpochCounts:
    """The [world, workers] batch counts of one epoch: ``bound`` (a lower bound on every entry)
    at once, and ``exact()``, at once where a closed form or the index gives it, else from a pass
    over lengths.npy run in the background (``ready()`` says whether it is done). The pass
    begins when asked (``start``: once a first batch is out, so that it never competes with
    it), or when ``exact()`` is first asked."""

    def __init__(self, bound: np.ndarray, exact: np.ndarray | None = None, job: _Background | None = None):
        self.bound = bound
        self._exact = exact
        self._job = job

    def start(self) -> None:
        """Begin the background pass in this process, unless it is done or running."""
        if self._exact is None and self._job is not None:
            self._job.start()

    @classmethod
    def create(
        cls,
        catalog: Source,
        cfg: Config,
        epoch: int,
        world: int,
        workers: int,
        plan: EpochPlan | None = None,
        ranks: list[int] | None = None,
    ) -> EpochCounts | None:
        """The counts of ``epoch`` for ``world`` x ``workers`` (only the rows of ``ranks``, when
        given, are exact: one rank's own total needs no other rank's share); None when the
        index cannot count."""
        workers = max(1, workers)
        batcher = cfg.make_batcher()
        if not cfg.can_count(catalog):
            return None
        if plan is None:
            plan = catalog.default_plan(epoch)
        spec = cfg.spec(epoch, 0, world, 0, workers)
        splits = spec.splits(catalog.mode)
        # documents' tokens per share (splitting keeps them all; truncation does not), from
        # lengths read now and checked in the background: nothing acts on them before that
        truncates = spec.max_len is not None and spec.max_len_mode == "truncate"
        want_tokens = not truncates and not (batcher.count_by == COUNT_BY_ITEMS and not splits)
        if plan is not None and plan.remainder:
            # a re-planned remainder (made by a pass over the old shares): by its shares' items where
            # batches count items, else counted share by share; at once
            if batcher.count_by == COUNT_BY_ITEMS and not splits:
                items = cast(RemainderItems, plan).share_items(catalog, cfg, world, workers)
                exact = _handed_table(batcher, items, hands_tails(catalog, cfg, spec), cfg.batch_size or 1, lambda n: n)
            else:
                exact = _shares_exact(catalog, cfg, epoch, world, workers, plan, ranks)
            return cls(exact, exact)
        if plan is not None:  # a mixture's epoch: shares from its stretches, exact counts from their slices
            items, tokens, check = _plan_sizes(catalog, cast(SizedPlan, plan), world, workers, want_tokens)
            identity = plan.identity()
            exact_table = lambda: _shares_exact(catalog, cfg, epoch, world, workers, plan, ranks)  # noqa: E731
        else:
            items, tokens, check, exact_table = _layout_sizes(
                catalog, cfg, epoch, world, workers, spec, ranks, want_tokens
            )
            identity = None
        hands = hands_tails(catalog, cfg, spec)
        if batcher.count_by == COUNT_BY_ITEMS and not splits:
            exact = _handed_table(batcher, items, hands, cfg.batch_size or 1, lambda n: n)
            return cls(exact, exact)
        if batcher.count_by == COUNT_BY_TOKENS and tokens is not None:
            exact = _handed_table(batcher, tokens, hands, cfg.batch_size * cfg.row_len, _Tokens)
            return cls(exact, None, _Background(lambda: _checked(check, exact)))
        bound = _lower_bound(catalog, cfg, batcher, items, tokens, hands)
        # the cache file's name is made here, not in the thread: a fork while the thread holds a
        # module's lock (tempfile's, finding the temporary directory) would leave it held in the child
        key = _cache_key(catalog, cfg, epoch, world, workers, ranks, identity)
        path = os.path.join(counts_cache_dir(catalog), f"counts-{key}.npy")
        return cls(bound, None, _Background(lambda: _checked(check, _cached(path, exact_table))))

    def ready(self) -> bool:
        return self._exact is not None or self._job.ready()

    def exact(self) -> np.ndarray:
        """The exact table (waits for the background pass if it is still running)."""
        if self._exact is None:
            self._exact = self._job.get()
        return self._exact


def _layout_sizes(
    catalog: Source,
    cfg: Config,
    epoch: int,
    world: int,
    workers: int,
    spec: Any,
    ranks: list[int] | None,
    want_tokens: bool,
) -> tuple[np.ndarray, np.ndarray | None, Callable[[], None], Callable[[], np.ndarray]]:
    """A single dataset's epoch by its layout: items and tokens per share, the check of the
    lengths read for them, and how to count the exact table."""
    layout = source_layout(catalog, cfg, spec)
    items = layout.stops - layout.starts
    tokens, read = _share_tokens(catalog, layout, spec.max_len) if want_tokens else (None, [])
    check = lambda: catalog.lengths().check(read)  # noqa: E731
    exact_table = lambda: _layout_exact(catalog, cfg, epoch, layout, ranks)  # noqa: E731
    return items, tokens, check, exact_table


def _checked(check: Callable[[], None], table: np.ndarray) -> np.ndarray:
    """``table`` once the lengths it was counted from (read unchecked) are checked by ``check``."""
    check()
    return table


def _table(count: Callable[[Any], int], per_share: np.ndarray) -> np.ndarray:
    return np.array([[count(int(x)) for x in row] for row in per_share], np.int64)


def _handed_table(
    batcher: Batcher, per_share: np.ndarray, hands: bool, span: int, sizes: Callable[[int], Any]
) -> np.ndarray:
    """Counts of shares known by their items (``sizes``: as ``count`` takes them) or tokens, a
    batch holding ``span`` of them: where workers hand their tails over (``handoff``), every
    worker but a rank's last counts its full batches, and the last counts its share with the
    others' tails (what is left beyond their last full batch)."""
    by_items = batcher.count_by == COUNT_BY_ITEMS
    count = (lambda b, x: b.count(x, None)) if by_items else (lambda b, x: b.count(None, x))
    if not hands:
        return _table(lambda x: count(batcher, sizes(x)), per_share)
    per_share = np.asarray(per_share, np.int64)
    handing = batcher.handing()
    out = _table(lambda x: count(handing, sizes(x)), per_share)
    for r, row in enumerate(per_share):
        out[r, -1] = count(batcher, sizes(int(row[-1] + (row[:-1] % span).sum())))
    return out


@dataclass(frozen=True)
class _Tokens:
    """ItemLengths of a share known by its token total alone (what concat counts need)."""

    tokens: int

    def total(self) -> int:
        return self.tokens

    def windows(self, size: int) -> Iterator[np.ndarray]:
        raise NotImplementedError("only the token total of this share is known")


def _shares_exact(
    catalog: Source,
    cfg: Config,
    epoch: int,
    world: int,
    workers: int,
    plan: EpochPlan | None,
    ranks: list[int] | None,
) -> np.ndarray:
    """Every consumer's count from its own slices (a pass over its lengths each)."""
    out = np.zeros((world, workers), np.int64)
    for r in range(world) if ranks is None else ranks:
        for w in range(workers):
            spec = cfg.spec(epoch, r, world, w, workers)
            count = share_count(catalog, cfg, slices_for(catalog, cfg, spec, plan), spec)
            if count is None:
                raise ValueError("the index cannot count these batches")
            out[r, w] = count
    return out


def _layout_exact(catalog: Source, cfg: Config, epoch: int, layout: EpochLayout, ranks: list[int] | None) -> np.ndarray:
    """Every consumer's exact count of a normal epoch: one pass over lengths.npy, a share at a
    time, a window at a time (ranks not asked for keep 0)."""
    world, workers = layout.starts.shape
    out = np.zeros((world, workers), np.int64)
    for r in range(world) if ranks is None else ranks:
        for w in range(workers):
            spec = cfg.spec(epoch, r, world, w, workers)
            slices = with_tails(catalog, cfg, spec, lambda s, r=r: layout.slices(r, s.worker))
            out[r, w] = share_count(catalog, cfg, slices, spec)
    return out


def _share_tokens(
    catalog: Source, layout: EpochLayout, max_len: int | None
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """([world, workers] tokens of every share (documents, before any truncation at max_len),
    the ranges of lengths.npy read for them, unchecked): the index's tokens per shard (or per
    block of a shard: the sum of its lengths), and for each share boundary inside one the
    documents' lengths from the nearer end of its shard (a boundary inside a document split at
    ``max_len``: its pieces before the boundary hold ``max_len`` tokens each)."""
    read: list = []
    if layout.firsts is None or layout.whole:
        firsts, tokens = np.zeros(len(layout.order), np.int64), catalog.tokens_per_shard[layout.order]
    else:
        firsts = layout.firsts
        tokens, read = _block_tokens(catalog, layout.order, firsts, layout.counts)
    token_ends = np.concatenate([[0], np.cumsum(tokens)])
    cuts = np.unique(np.concatenate([layout.starts.reshape(-1), layout.stops.reshape(-1)]))
    points, pieces_in = layout.in_documents(cuts)
    at = np.searchsorted(layout.ends, points, side="right")  # the shard (in epoch order) holding each
    before = np.full(len(points), token_ends[-1], np.int64)  # points past the last shard
    inside = at < len(layout.order)
    i = at[inside]
    k = points[inside] - (layout.ends[i] - layout.counts[i])  # documents of the block before the point
    part, head_read = _block_tokens(catalog, layout.order[i], firsts[i], k)
    before[inside] = token_ends[i] + part
    before += pieces_in * (max_len or 0)
    starts = before[np.searchsorted(cuts, layout.starts)]
    stops = before[np.searchsorted(cuts, layout.stops)]
    return stops - starts, read + head_read


def _block_tokens(
    catalog: Source, shards: np.ndarray, firsts: np.ndarray, k: np.ndarray
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(tokens of items [firsts[i], firsts[i] + k[i]) of shard ``shards[i]``, ranges read):
    ``head_tokens`` where a run starts its shard, else the lengths' sum (rows: seq_len each)."""
    firsts, k = np.asarray(firsts, np.int64), np.asarray(k, np.int64)
    if not firsts.any():
        return head_tokens(catalog, shards, k)
    if catalog.mode == "packed":
        heads = [head_tokens(catalog, shards, firsts + k)[0], head_tokens(catalog, shards, firsts)[0]]
        return heads[0] - heads[1], []
    return catalog.lengths().sums(shards, firsts, firsts + k)


def head_tokens(catalog: Source, shards: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(tokens of the first ``k[i]`` items of catalog shard ``shards[i]``, the ranges of
    lengths.npy read for them, unchecked): the index's shard tokens, less the lengths of the
    shard's other end when that is nearer. Packed rows hold seq_len tokens each but the last."""
    shards = np.asarray(shards, np.int64)
    k = np.asarray(k, np.int64)
    n = catalog.items_per_shard[shards].astype(np.int64)
    tokens = catalog.tokens_per_shard[shards].astype(np.int64)
    if catalog.mode == "packed":
        return np.where(k >= n, tokens, k * int(catalog.index.seq_len)), []
    out = np.where(k <= 0, 0, tokens)
    inside = np.flatnonzero((k > 0) & (k < n))  # only these read lengths: mostly the few cut by a share's edge
    shards, k, n = shards[inside], k[inside], n[inside]
    head = k <= n - k  # read the nearer end: the first k documents, else the last n - k
    part, read = catalog.lengths().sums(shards, np.where(head, 0, k), np.where(head, k, n))
    out[inside] = np.where(head, part, tokens[inside] - part)
    return out, read


def _readers(catalog: Source) -> list[Source]:
    """The sources whose lengths are read: a mixture's (in its order), or the source itself."""
    return list(catalog.components())


def _plan_sizes(
    catalog: Source, plan: SizedPlan, world: int, workers: int, want_tokens: bool
) -> tuple[np.ndarray, np.ndarray | None, Callable[[], None]]:
    """A mixture's [world, workers] items and (``want_tokens``) tokens per share, and the check of
    the sources' lengths read for them (each source's reader counts its own shards' tokens)."""
    readers = _readers(catalog)
    reads: list[list[tuple[int, int]]] = [[] for _ in readers]

    def counter(s: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        def count(shards: np.ndarray, k: np.ndarray) -> np.ndarray:
            sums, read = head_tokens(readers[s], shards, k)
            reads[s].extend(read)
            return sums

        return count

    heads = [counter(s) for s in range(len(readers))] if want_tokens else None
    items, tokens = plan.share_sizes(world, workers, heads)

    def check() -> None:
        for reader, read in zip(readers, reads):
            if read:
                reader.lengths().check(read)

    return items, tokens, check


def _lower_bound(
    catalog: Source, cfg: Config, batcher: Batcher, items: np.ndarray, tokens: np.ndarray | None, hands: bool
) -> np.ndarray:
    """[world, workers] lower bounds on the counts, from the shares' items and tokens alone
    (``Batcher.lower_bound``). Items after splitting are at least the documents; without the
    tokens (documents truncated at max_len) every item still holds a token. Workers that hand
    their tails over count their full batches (``handing``); the tails only add to the last's."""
    bound = batcher.lower_bound(items, tokens, _longest(catalog, cfg))
    if hands:
        handing = batcher.handing().lower_bound(items, tokens, _longest(catalog, cfg))
        bound[:, :-1] = handing[:, :-1]
    return bound


def _longest(catalog: Source, cfg: Config) -> int:
    """Tokens of the longest item: the index's longest document, or the count sidecar's, at most max_len."""
    if catalog.index is not None:
        longest = int((catalog.index.doc_lengths or {}).get("max", 0) or 0)
    else:
        lengths = catalog.lengths()
        whole = lengths.whole() if lengths is not None else np.zeros(0, np.int64)
        longest = int(whole.max()) if len(whole) else 0
    return longest if cfg.max_len is None else min(longest, cfg.max_len)


# ----------------------------------------------------------------------------------------------
# A node-local cache of counts that took a pass: the first process of a node to need a table
# computes it under a lock; the others (its workers, the other ranks of the node) read it.


#: bumped whenever a count could come out differently: cached tables of another version are not read
COUNTS_VERSION = 7


def counts_cache_dir(catalog: Source) -> str:
    """Beside the shard cache when there is one, else in the temporary directory."""
    cache = catalog.side_cache
    if cache is not None:
        return os.path.join(cache.directory, "counts")
    return os.path.join(tempfile.gettempdir(), f"wdsllm-{os.getuid()}", "counts")


def _cache_key(
    catalog: Source,
    cfg: Config,
    epoch: int,
    world: int,
    workers: int,
    ranks: list[int] | None,
    plan: list | None = None,
) -> str:
    """The table's identity: the data (a mixture's fingerprint covers its sources and weights;
    ``plan``, its plan's identity, the schedule's position), every setting, the epoch, the layout."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("equal_batches", "docs")}
    lengths = [c.index.lengths_file.sha256 if c.index and c.index.lengths_file else None for c in _readers(catalog)]
    blocks = [planmod.EPOCH_BLOCKS, planmod.MIN_BLOCK_TOKENS]  # what cuts shards into the epoch's blocks
    what = [COUNTS_VERSION, catalog.fingerprint(), lengths, fields, epoch, world, workers, ranks, plan, blocks]
    body = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def _cached(path: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The table in ``path`` if a process of this node made it, else computed here (under a lock
    that makes the node's other processes wait for it rather than count too) and kept there."""
    directory = os.path.dirname(path)
    found = _load(path)
    if found is not None:
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the last to be evicted
        return found
    try:
        os.makedirs(directory, exist_ok=True)
        lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.debug("no counts cache in %s (%s): counting in this process", directory, exc)
        return compute()
    try:
        # a POSIX lock: owned by this process, so a forked worker never inherits it (flock's
        # would stay held by the worker's copy of the descriptor)
        fcntl.lockf(lock, fcntl.LOCK_EX)
        found = _load(path)
        if found is not None:
            return found
        table = compute()
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with contextlib.suppress(OSError):
            with open(tmp, "wb") as f:
                np.save(f, table, allow_pickle=False)
            os.replace(tmp, path)
        evict_counts(directory, keep=path)
        return table
    finally:
        os.close(lock)


#: the counts cache's bounds: beyond them its least recently used tables go (``evict_counts``)
COUNTS_KEEP = 256
COUNTS_KEEP_BYTES = 256 << 20
#: a temporary table older than this was left by a process that died while writing it (seconds)
_STALE_TMP = 3600.0


def evict_counts(directory: str, keep: str = "") -> None:
    """Remove the least recently used tables of ``directory`` (by mtime: a hit touches its table)
    beyond :data:`COUNTS_KEEP` tables or :data:`COUNTS_KEEP_BYTES` bytes, never ``keep``, with
    their lock files; and temporary tables that a dead process left."""
    tables, now = [], time.time()
    with contextlib.suppress(OSError), os.scandir(directory) as found:
        for entry in found:
            with contextlib.suppress(OSError):
                st = entry.stat()
                if entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP:
                    os.remove(entry.path)
                elif entry.name.startswith("counts-") and entry.name.endswith(".npy"):
                    tables.append((st.st_mtime, st.st_size, entry.path))
    tables.sort(reverse=True)
    total = 0
    for n, (_, size, path) in enumerate(tables):
        total += size
        if path != keep and (n >= COUNTS_KEEP or total > COUNTS_KEEP_BYTES):
            for name in (path, path + ".lock"):
                with contextlib.suppress(OSError):
                    os.remove(name)


def _load(path: str) -> np.ndarray | None:
    try:
        table = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return table if table.dtype == np.int64 and table.ndim == 2 else None


# ----------------------------------------------------------------------------------------------
# The equal-batches decision


@dataclass
class WorkerLimit:
    """How many batches a worker may yield: ``bound`` at once (a lower bound of its share); past
    it, the exact share (``value()``, which may wait for the count; ``start``: begin counting it
    in the background, once the worker's first batch is out)."""

    bound: int
    resolve: Callable[[], int] | None = None
    start: Callable[[], None] | None = None

    def value(self) -> int:
        return self.bound if self.resolve is None else self.resolve()

    def reached(self, index: int) -> bool:
        """Whether batch ``index`` is beyond the worker's share."""
        return index >= self.bound and (self.resolve is None or index >= self.resolve())


class EpochLimits:
    """The equal-batches decision for one epoch of one rank: every rank yields ``per_rank``
    batches, the smallest rank's total (or the largest's, ``uneven="repeat"``), and
    ``per_worker`` is this rank's round-robin share of them (``padded_share``). Known at once
    where the counts are; else the workers stream up to ``worker_limit``'s bound and the decision
    waits for the background count."""

    def __init__(self, counts: EpochCounts, rank: int, workers: int, uneven: str = "drop"):
        self.counts = counts
        self.rank = rank
        self.workers = workers
        self.uneven = uneven
        bound = counts.bound
        #: a lower bound on per_rank, the same on every rank
        self.per_rank_bound = int(bound.sum(axis=1).min())

    def ready(self) -> bool:
        return self.counts.ready()

    def start_count(self) -> None:
        """Begin the exact count in the background (once this process's first batch is out)."""
        self.counts.start()

    @property
    def per_rank(self) -> int:
        """Batches every rank yields."""
        return equal_total(self.counts.exact(), self.uneven)

    @property
    def per_worker(self) -> np.ndarray:
        """[workers] of this rank's share."""
        return padded_share(self.counts.exact()[self.rank], self.per_rank)

    @property
    def dropped_batches(self) -> int:
        """This rank's batches beyond per_rank."""
        return max(0, int(self.counts.exact()[self.rank].sum()) - self.per_rank)

    @property
    def repeated_batches(self) -> int:
        """Batches this rank repeats to reach per_rank (``uneven="repeat"``)."""
        return max(0, self.per_rank - int(self.counts.exact()[self.rank].sum()))

    def worker_limit(self, worker: int) -> WorkerLimit:
        """Worker ``worker``'s cap. Its round-robin share of N batches is at least
        min(its count, N // workers), so min(its bound, per_rank_bound // workers) is safe."""
        if self.counts.ready():
            return WorkerLimit(int(self.per_worker[worker]))
        safe = min(int(self.counts.bound[self.rank, worker]), self.per_rank_bound // self.workers)
        return WorkerLimit(safe, lambda: int(self.per_worker[worker]), self.counts.start)


def epoch_limits(
    catalog: Source, cfg: Config, epoch: int, rank: int, world: int, workers: int, plan: EpochPlan | None = None
) -> EpochLimits | None:
    """Where this rank's workers stop so that every rank yields the same count; None when the
    index cannot count the batches."""
    counts = EpochCounts.create(catalog, cfg, epoch, world, max(1, workers), plan)
    return None if counts is None else EpochLimits(counts, rank, max(1, workers), cfg.uneven)
