"""One worker's item stream for one epoch: plan -> read -> split long documents -> shuffle.

Positions are what make resumption exact and cheap. The *plan stream* is the worker's items in
plan order (after load-time splitting, pieces count as items), numbered 0, 1, ...; the *shuffled
stream* permutes consecutive blocks of ``shuffle_buffer`` plan positions with a generator keyed by
(seed, epoch, rank, worker, block). Position p of the shuffled stream therefore depends only on
block p // shuffle_buffer, and a stream can start at any p by reading from that block's first
plan position: no state but an integer, and at most one buffer re-read.

The shuffle is blockwise (as infinibatch's): each buffer of items is drawn in a random order.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from .. import storage
from ..errors import SourceError
from ..format import FormatError
from . import plan as planmod
from .block import Block, rebase, windows
from .catalog import Catalog
from .plan import Slice
from .read import ReadOptions, open_kwargs, ranged_start, read_slice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSpec:
    """Everything that decides a worker's stream in one epoch."""

    seed: int
    epoch: int
    rank: int
    world: int
    worker: int
    workers: int
    shuffle: bool = True  # shuffle the shard order
    shuffle_buffer: int = 0  # items per shuffled block; 0 or 1 keeps plan order
    max_len: int | None = None
    max_len_mode: str = "split"  # or "truncate"
    resample: bool = False

    def splits(self, mode: str) -> bool:
        """Whether documents longer than max_len become several items (pieces) in this stream."""
        return self.max_len is not None and self.max_len_mode == "split" and mode == "docs"


def pieces_per_doc(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Items each document becomes when split at ``max_len`` tokens."""
    return (lengths + max_len - 1) // max_len


def block_permutation(spec: StreamSpec, block: int, n: int) -> np.ndarray:
    """The order of the ``n`` items of shuffle block ``block`` of (seed, epoch, rank, worker)."""
    return planmod.rng(spec.seed, planmod.STREAM_SAMPLE_SHUFFLE, spec.epoch, spec.rank, spec.worker, block).permutation(
        n
    )


def block_order(spec: StreamSpec, block: int, n: int, mixing=None, labels: np.ndarray | None = None) -> np.ndarray:
    """The order of shuffle block ``block``: ``block_permutation``, or for a mixture
    (``mixing``, with the block's items' sources as ``labels``) its interleaving order."""
    if mixing is None:
        return block_permutation(spec, block, n)
    return mixing.permutation(spec, block, labels)


def block_size(spec: StreamSpec, mixing=None) -> int:
    """Items per shuffle block (a mixture always interleaves in blocks, shuffled or not)."""
    return spec.shuffle_buffer if mixing is None else mixing.block_size(spec)


def plan_labels(catalog: Catalog, slices: list[Slice], spec: StreamSpec) -> np.ndarray | None:
    """A mixture's label of each item of the plan stream (source + sources x part of the epoch:
    what ``mixing.permutation`` orders by); None for one dataset."""
    labels = PlanLabels.of(catalog, slices, spec)
    return None if labels is None else labels.at(0, labels.total)


class PlanLabels:
    """A mixture's plan-stream labels, made for a range of positions at a time (memory: one
    entry per slice). Slices are counted (their lengths read, where documents split) only as far
    as a range asks: the first block needs the first slices, not the whole share."""

    def __init__(self, per_slice: np.ndarray, count: Callable[[int], int]):
        self.per_slice = per_slice
        self._count = count
        self._counts: list[int] = []
        self._ends: list[int] = []

    @classmethod
    def of(cls, catalog: Catalog, slices: list[Slice], spec: StreamSpec) -> PlanLabels | None:
        mixing = catalog.mixing
        if mixing is None:
            return None
        shards = np.asarray([sl.shard for sl in slices], np.int64)
        groups = np.asarray([sl.group for sl in slices], np.int64)
        return cls(
            mixing.sources_of_shards(shards) + mixing.sources * groups,
            lambda i: slice_item_count(catalog, slices[i], spec),
        )

    def _counted(self, upto: int | None) -> None:
        """Count slices until their items reach position ``upto`` (None: all of them)."""
        while len(self._counts) < len(self.per_slice) and (upto is None or not self._ends or self._ends[-1] < upto):
            n = int(self._count(len(self._counts)))
            self._counts.append(n)
            self._ends.append((self._ends[-1] if self._ends else 0) + n)

    @property
    def total(self) -> int:
        self._counted(None)
        return self._ends[-1] if self._ends else 0

    def at(self, a: int, b: int) -> np.ndarray:
        """Labels of plan positions [a, b)."""
        self._counted(b)
        ends = self._ends
        b = min(b, ends[-1] if ends else 0)
        if b <= a:
            return np.zeros(0, np.int64)
        i, j = bisect.bisect_right(ends, a), bisect.bisect_right(ends, b - 1)
        counts = np.asarray(self._counts[i : j + 1], np.int64)
        counts[0] -= a - (ends[i] - self._counts[i])
        counts[-1] -= ends[j] - b
        return np.repeat(self.per_slice[i : j + 1], counts)


def epoch_slices(catalog: Catalog, spec: StreamSpec) -> list[Slice]:
    return planmod.plan_epoch(
        catalog.items_per_shard,
        len(catalog.urls),
        seed=spec.seed,
        epoch=spec.epoch,
        rank=spec.rank,
        world=spec.world,
        worker=spec.worker,
        workers=spec.workers,
        shuffle=spec.shuffle,
    )


def slice_item_lengths(catalog: Catalog, slices: list[Slice], spec: StreamSpec) -> np.ndarray | None:
    """Token lengths of the plan stream's items (pieces after splitting), in plan order; None
    without an index. This is how counts are known before any shard is read (a whole share:
    counting uses ``ShareLengths``, which holds a window at a time)."""
    if not has_lengths(catalog):
        return None
    parts = [slice_items(catalog, sl, spec) for sl in slices]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def has_lengths(catalog: Catalog) -> bool:
    """Whether items' lengths are known without reading shards (an index; docs mode: lengths.npy)."""
    if catalog.mode == "packed":
        return catalog.shard_entries is not None
    return catalog.lengths_file() is not None


def slice_items(catalog: Catalog, sl: Slice, spec: StreamSpec) -> np.ndarray:
    """Token lengths of one slice's items, in plan order (int64)."""
    if catalog.mode == "packed":
        e = catalog.shard_entries[sl.shard]
        seq_len = catalog.index.seq_len
        rows = np.full(e.rows, seq_len, np.int64)
        if e.rows:
            rows[-1] = e.tokens - seq_len * (e.rows - 1)
        items = rows[sl.start : sl.stop : sl.stride]
    else:
        items = _max_len_lengths(slice_doc_lengths(catalog, sl), spec)
    return items if sl.pick is None else items[sl.pick]


class ShareLengths:
    """One consumer's item lengths as counting needs them (``batching.ItemLengths``), read from
    lengths.npy a slice at a time: a count over a share of any size holds one window.

    Windows of a size that is a multiple of the shuffle buffer are unions of whole shuffle blocks,
    so their multisets are those of plan-order windows and no permutation is drawn; other sizes
    get the stream's own block permutations.
    """

    def __init__(self, catalog: Catalog, slices: list[Slice], spec: StreamSpec):
        self.catalog = catalog
        self.slices = slices
        self.spec = spec
        self._total: int | None = None
        self._n: int | None = None

    @property
    def n_items(self) -> int:
        """Items of the share (pieces counted)."""
        if self._n is None:
            counts = slice_item_counts(self.catalog, self.slices, self.spec)
            self._n = int(sum(counts)) if counts is not None else None
        return self._n

    def plan_chunks(self) -> Iterator[np.ndarray]:
        """The items' lengths in plan order, a slice at a time."""
        for sl in self.slices:
            yield slice_items(self.catalog, sl, self.spec)

    def total(self) -> int:
        if self._total is None:
            self._total = int(sum(int(c.sum()) for c in self.plan_chunks()))
        return self._total

    def windows(self, size: int) -> Iterator[np.ndarray]:
        mixing = self.catalog.mixing
        buffer = block_size(self.spec, mixing)
        if buffer <= 1 or size % buffer == 0:
            return rechunk(self.plan_chunks(), size)
        if mixing is None:
            blocks = (
                block[block_permutation(self.spec, k, len(block))]
                for k, block in enumerate(rechunk(self.plan_chunks(), buffer))
            )
        else:
            labels = rechunk(iter([plan_labels(self.catalog, self.slices, self.spec)]), buffer)
            blocks = (
                block[mixing.permutation(self.spec, k, lab)]
                for k, (block, lab) in enumerate(zip(rechunk(self.plan_chunks(), buffer), labels))
            )
        return rechunk(blocks, size)


def rechunk(chunks: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The concatenation of ``chunks`` cut into arrays of ``size`` (the last one shorter)."""
    held: list[np.ndarray] = []
    have = 0
    for chunk in chunks:
        while len(chunk):
            take = min(size - have, len(chunk))
            held.append(chunk[:take])
            have += take
            chunk = chunk[take:]
            if have == size:
                yield held[0] if len(held) == 1 else np.concatenate(held)
                held, have = [], 0
    if have:
        yield held[0] if len(held) == 1 else np.concatenate(held)


def slice_doc_lengths(catalog: Catalog, sl: Slice) -> np.ndarray:
    """Token counts of the documents a slice covers (int64; read from lengths.npy)."""
    if sl.stride == 1:
        return catalog.shard_lengths(sl.shard, sl.start, sl.stop)
    return catalog.shard_lengths(sl.shard, sl.start, sl.stop)[:: sl.stride]


def _max_len_lengths(lengths: np.ndarray, spec: StreamSpec) -> np.ndarray:
    """Documents' lengths as items: split into pieces, or truncated, at max_len."""
    m = spec.max_len
    if m is None:
        return lengths
    if spec.max_len_mode == "split":
        counts = pieces_per_doc(lengths, m)
        reps = np.repeat(lengths, counts)
        piece = np.arange(len(reps)) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.minimum(m, reps - piece * m)
    return np.minimum(lengths, m)


def shuffle_lengths(lengths: np.ndarray, spec: StreamSpec, mixing=None, labels: np.ndarray | None = None) -> np.ndarray:
    """Plan-order lengths in shuffled-stream order: the same block permutations as the stream
    (a mixture's: ``labels`` are the items' sources, ``plan_labels``)."""
    size = block_size(spec, mixing)
    if size <= 1 or len(lengths) == 0:
        return lengths
    out = np.empty_like(lengths)
    for k, a in enumerate(range(0, len(lengths), size)):
        block = lengths[a : a + size]
        lab = None if labels is None else labels[a : a + size]
        out[a : a + len(block)] = block[block_order(spec, k, len(block), mixing, lab)]
    return out


def slice_item_counts(catalog: Catalog, slices: list[Slice], spec: StreamSpec) -> list[int] | None:
    """Items of each slice in the plan stream (pieces counted)."""
    counts = [slice_item_count(catalog, sl, spec) for sl in slices]
    return None if any(c is None for c in counts) else counts


def slice_item_count(catalog: Catalog, sl: Slice, spec: StreamSpec) -> int | None:
    if sl.pick is not None:
        return len(sl.pick)
    if not spec.splits(catalog.mode):
        if sl.stop is None and sl.stride == 1 and sl.start == 0 and catalog.items_per_shard is not None:
            return int(catalog.items_per_shard[sl.shard])  # a whole shard (resampled streams)
        return sl.count
    if catalog.lengths_file() is None:
        return None
    return int(pieces_per_doc(slice_doc_lengths(catalog, sl), spec.max_len).sum())


def _docs_before(catalog: Catalog, sl: Slice, spec: StreamSpec, item: int) -> tuple[int, int]:
    """(whole documents before in-slice item position ``item``, items those documents make)."""
    if item <= 0:
        return 0, 0
    if not spec.splits(catalog.mode):
        return item, item
    pieces_through = np.cumsum(pieces_per_doc(slice_doc_lengths(catalog, sl), spec.max_len))
    docs = int(np.searchsorted(pieces_through, item, side="right"))
    return docs, int(pieces_through[docs - 1]) if docs else 0


def _apply_max_len(block: Block, spec: StreamSpec) -> tuple[Block, int]:
    """Split (or truncate) items longer than max_len; returns the block and truncated tokens."""
    m = spec.max_len
    if m is None or len(block) == 0 or int(block.lengths.max()) <= m:
        return block, 0
    if spec.max_len_mode == "truncate":
        cut = int(np.maximum(block.lengths - m, 0).sum())
        out = replace(block, lengths=np.minimum(block.lengths, m))
        return out, cut
    counts = pieces_per_doc(block.lengths, m)
    item = np.repeat(np.arange(len(block)), counts)
    piece = np.arange(len(item)) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = block.starts[item] + piece * m
    lengths = np.minimum(m, block.lengths[item] - piece * m)
    base_piece = block.pieces[item] if block.pieces is not None else 0
    return Block(block.tokens, starts, lengths, block.ids[item], (base_piece + piece).astype(np.int64)), 0


class StreamStats:
    """Tallies a worker reports with its batches: tokens cut by max_len='truncate', and shards
    skipped as unreadable (on_error='skip')."""

    def __init__(self) -> None:
        self.truncated_tokens = 0
        self.skipped_shards: list[str] = []
        self.skipped_docs = 0  # raw text: bad lines or rows skipped (on_error="skip")


#: remote shards started behind the one being read, up to this many bytes (at least the next one):
#: a small shard is read faster than the next one's first bytes take to arrive
PREFETCH_AHEAD_BYTES = 64 << 20
#: a process that reads epoch after epoch starts the next epoch's first remote shards while it
#: reads this one's last (``WDSLLM_WARM_NEXT_EPOCH=0``: never; docs/remote.md)
WARM_NEXT_EPOCH = os.environ.get("WDSLLM_WARM_NEXT_EPOCH", "1") != "0"


def plan_items(
    catalog: Catalog,
    slices: list[Slice] | Iterator[Slice],
    spec: StreamSpec,
    *,
    start: int = 0,
    options: ReadOptions | None = None,
    stats: StreamStats | None = None,
    then: Callable[[], tuple[list[Slice], StreamSpec] | None] | None = None,
) -> Iterator[Block]:
    """The plan stream from plan position ``start``: blocks of items in plan order.

    With counts from the index, slices before ``start`` are not opened and the slice holding it
    is entered by skipping groups; without them the items before ``start`` are read and dropped.
    The next shard is opened (and, when remote, read ahead) while the current one is consumed.
    ``then``: the slices and spec of the stream read next in this process (the next epoch's),
    asked for once the last shard here has started; its first remote shards start then too
    (``storage.prefetch_iter``'s ``then``).
    """
    options = options or ReadOptions()
    raw = getattr(catalog, "read_unit", None)  # raw text: units read and tokenized here (load/raw.py)

    def is_raw(sl: Slice) -> bool:  # a unit of raw text (one raw source, or a mixture's raw source)
        return raw is not None or hasattr(catalog.owner(sl.shard)[0], "read_unit")

    def with_starts(slices, spec: StreamSpec, start: int) -> Iterator[tuple]:
        """Each slice with where a ranged read can enter its shard (remote shards, groups.npy)."""
        for sl, skip, drop in _slice_work(catalog, slices, spec, start):
            yield sl, skip, drop, None if is_raw(sl) else ranged_start(*_reader(catalog, sl), skip, options)

    def opened(work: Iterable[tuple]) -> Iterator[tuple[str, dict]]:
        """What prefetch_iter opens for each slice."""
        for sl, _, _, at in work:
            if not is_raw(sl):  # a mixture's raw units are read by their source, not opened here
                yield catalog.urls[sl.shard], open_kwargs(*_reader(catalog, sl, shard=True), options, at)

    def next_pass() -> Iterator[tuple[str, dict]]:
        following = then() if then is not None and WARM_NEXT_EPOCH else None
        if following is not None:
            yield from opened(with_starts(*following, 0))

    work = with_starts(slices, spec, start)
    if options.prefetch and not raw:
        work, ahead = itertools.tee(work)
        streams = storage.prefetch_iter(
            opened(ahead),
            spool=True,  # remote shards of known size are read in place, as mapped local ones are
            ahead_bytes=PREFETCH_AHEAD_BYTES,
            offload=bool(options.fetch_process),  # a fetch process fills the spools (storage/offload.py)
            then=next_pass(),
            owner=(id(catalog), spec.rank, spec.world, spec.worker, spec.workers),  # whose warmed shards
        )
    else:
        streams = None
    leftover = 0  # items still to drop when counts are unknown and a slice ran out first
    for sl, skip_docs, drop, at in work:
        drop += leftover
        position = _items_of_docs(catalog, sl, spec, skip_docs) if sl.pick is not None else 0
        try:
            owner, local = _reader(catalog, sl)
            base = sl.shard - local.shard
            read_unit = getattr(owner, "read_unit", None)  # raw text: read and tokenized here (load/raw.py)
            stream = next(streams) if streams is not None and read_unit is None else None
            if read_unit is not None:
                blocks = read_unit(local.shard, local.start, local.stop, local.stride, skip_docs, stats)
            else:
                blocks = read_slice(owner, local, skip=skip_docs, options=options, stream=stream, start=at)
            for block in blocks:
                block = rebase(block, base)
                if catalog.mode == "docs":
                    block, cut = _apply_max_len(block, spec)
                    if stats is not None:
                        stats.truncated_tokens += cut
                if sl.pick is not None:
                    here = position + np.arange(len(block))
                    position += len(block)
                    block = block.take(np.nonzero(np.isin(here, sl.pick, assume_unique=True))[0])
                if drop:
                    take = min(drop, len(block))
                    drop -= take
                    block = block.slice(take, len(block))
                if len(block):
                    yield block
        except GeneratorExit:  # closed early (at interpreter exit, module globals may be gone already)
            raise
        except (storage.StorageError, FormatError, SourceError) as exc:
            if options.on_error != "skip":
                raise
            url = catalog.urls[sl.shard]
            log.warning("skipping unreadable shard %s: %s", storage.redact(url), exc)
            if stats is not None:
                stats.skipped_shards.append(url)
        leftover = drop


def _reader(catalog: Catalog, sl: Slice, shard: bool = False) -> tuple[Catalog, Slice | int]:
    """The catalog that reads a slice's shard and the slice in its numbering (a mixture's source;
    one dataset reads its own), or with ``shard`` the shard's number there."""
    owner, local, _ = catalog.owner(sl.shard)
    if shard:
        return owner, local
    return owner, (sl if owner is catalog else replace(sl, shard=local))


def _items_of_docs(catalog: Catalog, sl: Slice, spec: StreamSpec, docs: int) -> int:
    """In-slice item position of the first item of document ``docs``."""
    if docs <= 0:
        return 0
    if not spec.splits(catalog.mode):
        return docs
    lengths = slice_doc_lengths(catalog, sl)[:docs]
    return int(pieces_per_doc(lengths, spec.max_len).sum())


def _slice_work(
    catalog: Catalog, slices: Iterable[Slice], spec: StreamSpec, start: int
) -> Iterator[tuple[Slice, int, int]]:
    """(slice, documents to skip by group, items to drop after reading) for each slice to read."""
    pos = 0  # plan position of the current slice's first item
    remaining = start  # items still to pass when counts are unknown
    for sl in slices:
        n = slice_item_count(catalog, sl, spec)
        if n is None:
            # Unknown counts: read from the first slice and drop items until ``start``.
            yield sl, 0, remaining
            remaining = 0
            continue
        if pos + n <= start:
            pos += n
            continue
        skip_items = max(0, start - pos)
        pos += n
        if sl.pick is not None:
            # keep the picks from skip_items on; read from the document holding the first one
            sl = Slice(sl.shard, sl.start, sl.stop, sl.stride, sl.pick[skip_items:])
            skip_docs, _ = _docs_before(catalog, sl, spec, int(sl.pick[0]))
            yield sl, skip_docs, 0
            continue
        skip_docs, passed = _docs_before(catalog, sl, spec, skip_items)
        yield sl, skip_docs, skip_items - passed


def shuffled_items(
    blocks_from: Callable[[int], Iterator[Block]],
    spec: StreamSpec,
    *,
    start: int = 0,
    mixing=None,
    labels: PlanLabels | None = None,
) -> Iterator[tuple[int, Block]]:
    """(shuffled position of the block's first item, block) from shuffled position ``start``.

    ``blocks_from(plan_position)`` opens the plan stream at a plan position. A mixture's
    ``mixing`` orders each block by its items' ``labels`` (``PlanLabels``).
    """
    size = block_size(spec, mixing)
    if size <= 1:
        pos = start
        for block in blocks_from(start):
            yield pos, block
            pos += len(block)
        return
    k = start // size
    skip = start - k * size
    for window in windows(blocks_from(k * size), size):
        lab = None if mixing is None else labels.at(k * size, k * size + len(window))
        out = window.take(block_order(spec, k, len(window), mixing, lab))
        if skip < len(out):
            yield k * size + skip, out.slice(skip, len(out)) if skip else out
        skip = 0
        k += 1


def inverse_shuffle(
    shuffled_positions: np.ndarray, n: int, spec: StreamSpec, mixing=None, labels: np.ndarray | None = None
) -> np.ndarray:
    """Plan positions of the given shuffled-stream positions of a stream of ``n`` items (a
    mixture's: ``labels`` are the plan stream's sources)."""
    size = block_size(spec, mixing)
    if size <= 1 or len(shuffled_positions) == 0:
        return shuffled_positions
    out = np.empty_like(shuffled_positions)
    blocks = shuffled_positions // size
    for k in np.unique(blocks):
        k = int(k)
        m = min(size, n - k * size)
        perm = block_order(spec, k, m, mixing, None if labels is None else labels[k * size : k * size + m])
        sel = blocks == k
        out[sel] = k * size + perm[shuffled_positions[sel] - k * size]
    return out
