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
import collections
import itertools
import logging
import os
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .. import storage
from ..errors import SourceError
from ..format import FormatError
from . import plan as planmod
from .block import Block, pieces_per_doc, rebase, windows
from .holes import hole_block
from .options import BatchOptions
from .plan import Slice
from .read import ReadOptions
from .slices import Slices
from .sources.protocol import Opening, Source, UnitReader

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
    max_len_mode: str = BatchOptions.max_len_mode
    resample: bool = False

    def splits(self, mode: str) -> bool:
        """Whether documents longer than max_len become several items (pieces) in this stream."""
        return self.max_len is not None and self.max_len_mode == "split" and mode == "docs"


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


def plan_labels(source: Source, slices: list[Slice], spec: StreamSpec) -> np.ndarray | None:
    """A mixture's label of each item of the plan stream (source + sources x part of the epoch:
    what ``mixing.permutation`` orders by); None for one dataset."""
    labels = PlanLabels.of(source, slices, spec)
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
    def of(
        cls, source: Source, slices: Sequence[Slice], spec: StreamSpec, counts: Sequence[int] | None = None
    ) -> PlanLabels | None:
        """``counts``: the slices' item counts, where the caller has them (else counted as asked)."""
        mixing = source.mixing
        if mixing is None:
            return None
        run = Slices.of(slices)
        out = cls(
            mixing.sources_of_shards(run.shards) + mixing.sources * run.group_column(),
            lambda i: slice_item_count(source, slices[i], spec),
        )
        if counts is not None:
            out._counts = [int(n) for n in counts]
            out._ends = np.cumsum(np.asarray(out._counts, np.int64)).tolist()
        return out

    @property
    def window(self) -> _LabelWindow:
        """The labels as an array sliced by ranges of positions (made only for the ranges asked)."""
        return _LabelWindow(self)

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


@dataclass(frozen=True)
class _LabelWindow:
    """``PlanLabels`` as ``labels[a:b]``: what ``inverse_shuffle`` slices a block's labels from."""

    labels: PlanLabels

    def __getitem__(self, at: slice) -> np.ndarray:
        return self.labels.at(at.start or 0, at.stop)


def slice_item_lengths(source: Source, slices: list[Slice], spec: StreamSpec) -> np.ndarray | None:
    """Token lengths of the plan stream's items (pieces after splitting), in plan order; None
    without an index. This is how counts are known before any shard is read (a whole share:
    counting uses ``ShareLengths``, which holds a window at a time)."""
    if not has_lengths(source):
        return None
    parts = [slice_items(source, sl, spec) for sl in slices]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def has_lengths(source: Source) -> bool:
    """Whether items' lengths are known without reading units (packed rows: the index's tokens per
    shard; documents: lengths.npy, or a count sidecar)."""
    if source.mode == "packed":
        return source.tokens_per_shard is not None
    return source.lengths() is not None


def slice_items(source: Source, sl: Slice, spec: StreamSpec) -> np.ndarray:
    """Token lengths of one slice's items, in plan order (int64)."""
    if source.mode == "packed":
        n_rows = int(source.items_per_shard[sl.shard])
        seq_len = source.index.seq_len
        rows = np.full(n_rows, seq_len, np.int64)
        if n_rows:
            rows[-1] = int(source.tokens_per_shard[sl.shard]) - seq_len * (n_rows - 1)
        items = rows[sl.start : sl.stop : sl.stride]
    else:
        items = _max_len_lengths(slice_doc_lengths(source, sl), spec)
    items = items if sl.pick is None else items[sl.pick]
    if sl.lead and len(items):
        items = items.copy()
        items[0] -= sl.lead
    return items


class ShareLengths:
    """One consumer's item lengths as counting needs them (``batching.ItemLengths``), read from
    lengths.npy a slice at a time: a count over a share of any size holds one window.

    Windows of a size that is a multiple of the shuffle buffer are unions of whole shuffle blocks,
    so their multisets are those of plan-order windows and no permutation is drawn; other sizes
    get the stream's own block permutations.
    """

    def __init__(self, source: Source, slices: list[Slice], spec: StreamSpec):
        self.source = source
        self.slices = slices
        self.spec = spec
        self._total: int | None = None
        self._n: int | None = None

    @property
    def n_items(self) -> int:
        """Items of the share (pieces counted)."""
        if self._n is None:
            counts = slice_item_counts(self.source, self.slices, self.spec)
            self._n = int(sum(counts)) if counts is not None else None
        return self._n

    def plan_chunks(self) -> Iterator[np.ndarray]:
        """The items' lengths in plan order, a slice at a time."""
        for sl in self.slices:
            yield slice_items(self.source, sl, self.spec)

    def total(self) -> int:
        if self._total is None:
            self._total = int(sum(int(c.sum()) for c in self.plan_chunks()))
        return self._total

    def windows(self, size: int) -> Iterator[np.ndarray]:
        mixing = self.source.mixing
        buffer = block_size(self.spec, mixing)
        if buffer <= 1 or size % buffer == 0:
            return rechunk(self.plan_chunks(), size)
        if mixing is None:
            blocks = (
                block[block_permutation(self.spec, k, len(block))]
                for k, block in enumerate(rechunk(self.plan_chunks(), buffer))
            )
        else:
            labels = rechunk(iter([plan_labels(self.source, self.slices, self.spec)]), buffer)
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


def slice_doc_lengths(source: Source, sl: Slice) -> np.ndarray:
    """Token counts of the documents a slice covers (int64; read from lengths.npy)."""
    lengths = source.lengths().of_unit(sl.shard, sl.start, sl.stop)
    return lengths if sl.stride == 1 else lengths[:: sl.stride]


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


def slice_item_counts(source: Source, slices: Sequence[Slice], spec: StreamSpec) -> list[int] | None:
    """Items of each slice in the plan stream (pieces counted); None where one is unknown. Plain
    ranges are counted as columns (their pieces in one pass over their lengths), any other
    slice on its own."""
    run = Slices.of(slices)
    counts = np.zeros(len(run), np.int64)
    plain = run.ranges()
    if len(plain):
        shards, starts, stops = run.shards[plain], run.starts[plain], run.stops[plain]
        if spec.splits(source.mode):
            pieces = planmod.piece_counter(source, spec)
            if pieces is None:
                return None
            counts[plain] = pieces.sums(shards, starts, stops)
        else:
            counts[plain] = np.maximum(stops - starts, 0)
    for i, sl in run.special.items():
        n = slice_item_count(source, sl, spec)
        if n is None:
            return None
        counts[i] = n
    return counts.tolist()


def counts_known(source: Source, slices: Sequence[Slice], spec: StreamSpec) -> bool:
    """Whether ``slice_item_counts`` would know every count (asked without counting them)."""
    run = Slices.of(slices)
    if spec.splits(source.mode) and len(run.ranges()) and source.lengths() is None:
        return False
    return all(slice_item_count(source, sl, spec) is not None for sl in run.special.values())


def slice_item_count(source: Source, sl: Slice, spec: StreamSpec) -> int | None:
    if sl.pick is not None:
        return len(sl.pick)
    if not spec.splits(source.mode):
        if sl.stop is None and sl.stride == 1 and sl.start == 0 and source.items_per_shard is not None:
            return int(source.items_per_shard[sl.shard])  # a whole shard (resampled streams)
        return sl.count
    if source.lengths() is None:
        return None
    return int(pieces_per_doc(slice_doc_lengths(source, sl), spec.max_len).sum())


def _docs_before(source: Source, sl: Slice, spec: StreamSpec, item: int) -> tuple[int, int]:
    """(whole documents before in-slice item position ``item``, items those documents make)."""
    if item <= 0:
        return 0, 0
    if not spec.splits(source.mode):
        return item, item
    pieces_through = np.cumsum(pieces_per_doc(slice_doc_lengths(source, sl), spec.max_len))
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
#: a pass of at most this many slices is looked over whole for shards that several of its slices
#: read (an epoch's blocks: ``plan.EPOCH_BLOCKS`` of them where shards are few)
MAX_SHARED_SLICES = 8 * planmod.EPOCH_BLOCKS
#: what a shard read whole must be to be shared: spooled as the stream's prefetcher spools
SHARED_OPTIONS = storage.PrefetchOptions(spool=True)
#: a process that reads epoch after epoch starts the next epoch's first remote shards while it
#: reads this one's last (``WDSLLM_WARM_NEXT_EPOCH=0``: never; docs/remote.md)
WARM_NEXT_EPOCH = os.environ.get("WDSLLM_WARM_NEXT_EPOCH", "1") != "0"


def read_plan_stream(
    source: Source,
    slices: list[Slice] | Iterator[Slice],
    spec: StreamSpec,
    *,
    start: int = 0,
    options: ReadOptions | None = None,
    stats: StreamStats | None = None,
    then: Callable[[], tuple[list[Slice], StreamSpec] | None] | None = None,
    mark: tuple[int, int] | None = None,
    holes: bool = False,
    known: list[Slice] | None = None,
) -> Iterator[Block]:
    """The plan stream from plan position ``start``, read: blocks of items in plan order.

    ``holes``: a unit lost under ``on_error="skip"`` leaves, where its items' lengths are known,
    a hole of each item it did not yield in that item's place (``holes.py``), so that every other
    item keeps its plan position.

    ``mark`` (counts unknown: raw text without a count sidecar): where ``start`` stands in
    documents (``marks.DocMarks``): that many documents are passed by the readers' skip (parsed,
    never tokenized), then that many pieces of the next one dropped.

    With counts from the index, slices before ``start`` are not opened and the slice holding it
    is entered by skipping groups; without them the items before ``start`` are read and dropped.
    The next shard is opened (and, when remote, read ahead) while the current one is consumed.
    ``then``: the slices and spec of the stream read next in this process (the next epoch's),
    asked for once the last shard here has started; storage is then asked to start its first
    remote shards (``storage.Prefetcher.warm``).

    ``known``: the slices known before reading (default: ``slices`` when it is a list; a worker's
    own share where other workers' tails follow, found when reached): a remote shard that several
    of them read is downloaded once (``_planned_work``).
    """
    options = options or ReadOptions()
    known = known if known is not None else slices  # type: ignore[assignment]
    work, shared = _planned_work(source, slices, spec, 0 if mark else start, options, _listed(known))
    work, streams = _opened_ahead(source, work, spec, options, shared)
    warmer = _NextPass(source, then, options) if then is not None and streams is not None else None
    to_drop = _Drop()  # items still to drop when counts are unknown and a slice ran out first
    if mark:
        to_drop.docs, to_drop.items = mark
    passed = _Yielded()
    held: dict = {}  # what readers keep for the pass's next slices (a local shard's mapping)
    for w in work:
        passed.items = 0
        position = _items_of_docs(source, w.sl, spec, w.skip) if w.sl.pick is not None else 0
        skip = to_drop.skip_for(source, w, spec)
        try:
            stream = next(streams) if w.opening is not None else None
            if warmer is not None and streams.all_started:
                warmer.warm(streams)
                warmer = None
            blocks = _Passed(
                w.reader.read(
                    w.local, skip=skip, options=options, opened=w.opening, stream=stream, stats=stats, held=held
                )
            )
            for block in _cut_blocks(source, w, blocks, spec, position, to_drop, stats):
                passed.note(block)
                yield block
            if skip > w.skip and blocks.documents is not None and blocks.documents < skip:
                if mark:  # the slice ran out first: the rest from the next
                    to_drop.docs += skip - blocks.documents
                else:
                    to_drop.items += skip - blocks.documents
        except GeneratorExit:  # closed early (at interpreter exit, module globals may be gone already)
            raise
        except (storage.StorageError, FormatError, SourceError) as exc:
            if options.on_error != "skip":
                raise
            yield from _skipped(source, w, spec, exc, stats, passed if holes else None)


def _skipped(
    source: Source, w: _Work, spec: StreamSpec, exc: Exception, stats: StreamStats | None, passed: _Yielded | None
) -> Iterator[Block]:
    """A unit that could not be read, skipped and counted; with ``passed`` (holes wanted: what
    the stream yielded of it), the holes of the items it did not yield."""
    url = source.urls[w.sl.shard]
    log.warning("skipping unreadable shard %s: %s", storage.redact(url), exc)
    if stats is not None:
        stats.skipped_shards.append(url)
    lost = _lost_items(source, w, spec, passed.items) if passed is not None else None
    if lost is not None and len(lost):
        yield hole_block(lost, passed.dtype_for(source), source.mode == "packed")


class _Yielded:
    """Items a stream yielded of its current slice, and the token dtype it has seen."""

    def __init__(self) -> None:
        self.items = 0
        self.dtype: np.dtype | None = None

    def note(self, block: Block) -> None:
        self.items += len(block)
        self.dtype = block.tokens.dtype

    def dtype_for(self, source: Source) -> np.dtype:
        """The dtype of the stream's tokens (its index's before any block was read)."""
        if self.dtype is not None:
            return self.dtype
        return np.dtype(source.index.dtype if source.index is not None else np.uint32)


def _lost_items(source: Source, w: _Work, spec: StreamSpec, done: int) -> np.ndarray | None:
    """Planned lengths of the items of ``w`` after the first ``done`` it yielded (None: its
    count is unknown)."""
    if slice_item_count(source, w.sl, spec) is None:
        return None
    planned = slice_items(source, w.sl, spec)
    first = 0 if w.sl.pick is not None else _items_of_docs(source, w.sl, spec, w.skip) + w.drop
    return planned[first + done :]


@dataclass(frozen=True)
class _Work:
    """One slice to read: ``skip`` documents skipped by group and ``drop`` items dropped after
    reading; ``reader`` reads it as ``local`` (in its own numbering), opened as ``opening`` says."""

    sl: Slice
    skip: int
    drop: int
    reader: UnitReader
    local: Slice
    opening: Opening | None


class _Passed:
    """A reader's blocks; once they are exhausted, ``documents`` is what the reader returned: how
    many of the slice's documents it parsed, skipped or not (None: a reader that does not say)."""

    def __init__(self, blocks: Iterable[Block]):
        self.blocks = blocks
        self.documents: int | None = None

    def __iter__(self) -> Iterator[Block]:
        self.documents = yield from self.blocks


def _skips_by_documents(source: Source, sl: Slice, spec: StreamSpec) -> bool:
    """Whether items still to drop before a slice of unknown count can be passed to its reader as
    documents to skip: an item is a document (no max_len pieces) and the slice holds every one
    of its documents from its start (no picks). Raw text without a count sidecar: the reader
    parses what it skips, never tokenizes it."""
    return sl.pick is None and not spec.splits(source.mode) and slice_item_count(source, sl, spec) is None


class _Drop:
    """Items still to drop, and documents still to pass (a mark's), carried from slice to slice
    (counts unknown: a slice may run out first)."""

    def __init__(self) -> None:
        self.items = 0
        self.docs = 0

    def skip_for(self, source: Source, w: _Work, spec: StreamSpec) -> int:
        """Documents the reader of ``w`` passes over unread: its own skip, plus a mark's documents
        or the items still to drop where they are whole documents of a slice that holds them."""
        self.items += w.drop
        if self.docs and w.sl.pick is None:  # the documents before a mark: passed over unread
            skip, self.docs = w.skip + self.docs, 0
            return skip
        if self.items and _skips_by_documents(source, w.sl, spec):  # passed over unread, not dropped
            skip, self.items = self.items, 0
            return skip
        return w.skip


def _listed(slices: Iterable[Slice]) -> Sequence[Slice] | None:
    """The slices where they are a sequence (a resampled stream's are endless)."""
    return slices if isinstance(slices, (list, Slices)) else None


def _opened_ahead(
    source: Source, work: Iterator[_Work], spec: StreamSpec, options: ReadOptions, shared: set[str]
) -> tuple[Iterator[_Work], storage.Prefetcher | None]:
    """The work, and the prefetcher that opens its units ahead (remote ones read ahead) where the
    source opens its units."""
    if not source.opens_units:
        return work, None
    work, ahead = itertools.tee(work)
    streams = storage.prefetch_iter(
        _openings(ahead),
        spool=True,  # remote shards of known size are read in place, as mapped local ones are
        ahead_bytes=PREFETCH_AHEAD_BYTES,
        offload=bool(options.fetch_process),  # a fetch process fills the spools (storage/offload.py)
        owner=storage.WarmKey(id(source), (spec.rank, spec.world, spec.worker, spec.workers)),
        shared=shared,
    )
    return work, streams


def _planned_work(
    source: Source,
    slices: Iterable[Slice],
    spec: StreamSpec,
    start: int,
    options: ReadOptions,
    known: list[Slice] | None = None,
) -> tuple[Iterator[_Work], set[str]]:
    """Each slice to read with its reader and where a ranged read can enter its unit; and the
    units read whole, each once for every slice that reads it (``storage.sharing``).

    A pass whose ``known`` slices read several blocks of one remote shard reads it once, where the
    shards so shared fit ``PREFETCH_AHEAD_BYTES`` (the first ones the pass reads): one GET and one
    buffer, where ranged reads would be a GET and a buffer per block, and copies across buffers in
    the shuffle. The shared reads are held until the pass ends."""
    whole: dict[int, str] = {}
    if source.opens_units and known is not None and len(known) <= MAX_SHARED_SLICES:
        whole = _shared_units(source, known, options)
    planned = _slice_work(source, slices, spec, start)
    return (_work(source, sl, skip, drop, options, whole) for sl, skip, drop in planned), set(whole.values())


def _work(source: Source, sl: Slice, skip: int, drop: int, options: ReadOptions, whole: Container[int]) -> _Work:
    reader, unit = source.reader(sl.shard)
    local = sl if unit == sl.shard else replace(sl, shard=unit)
    return _Work(sl, skip, drop, reader, local, reader.opening(local, skip, options, sl.shard in whole))


def _shared_units(source: Source, slices: list[Slice], options: ReadOptions) -> dict[int, str]:
    """The units several slices read, remote and spooled whole, first come first, while their
    bytes fit ``PREFETCH_AHEAD_BYTES`` (unit -> its URL)."""
    counts = collections.Counter(sl.shard for sl in slices)  # first seen first
    chosen: dict[int, str] = {}
    held = 0
    for shard, n in counts.items():  # in the order the pass first reads them
        if n < 2:
            continue
        reader, unit = source.reader(shard)
        opening = reader.opening(Slice(unit, 0, None), 0, options, True)
        if opening is None or not SHARED_OPTIONS.spooled(opening.url, opening.kwargs):
            continue
        size = opening.kwargs.get("expected_size")  # read whole: from byte 0
        if size is None or held + size > PREFETCH_AHEAD_BYTES:
            continue
        held += size
        chosen[shard] = opening.url
    return chosen


def _openings(work: Iterable[_Work]) -> Iterator[tuple[str, dict]]:
    """What the prefetcher opens: the units the stream opens (a mixture's raw units are read by
    their source, not opened here)."""
    for w in work:
        if w.opening is not None:
            yield w.opening.url, w.opening.kwargs


class _NextPass:
    """The next pass's first units, warmed once this pass's last ones have started."""

    def __init__(self, source: Source, then: Callable[[], tuple[list[Slice], StreamSpec] | None], options: ReadOptions):
        self.source = source
        self.then = then
        self.options = options

    def warm(self, streams: storage.Prefetcher) -> None:
        try:
            following = self.then() if WARM_NEXT_EPOCH else None
            if following is not None:
                slices, spec = following
                work, _ = _planned_work(self.source, slices, spec, 0, self.options, _listed(slices))
                streams.warm(itertools.islice(_openings(work), streams.options.most))
        except Exception as exc:  # a guess: the next pass plans and meets it again if it is real
            log.debug("not warming the next pass: %s", exc)


def _cut_blocks(
    source: Source,
    w: _Work,
    blocks: Iterable[Block],
    spec: StreamSpec,
    position: int,
    to_drop: _Drop,
    stats: StreamStats | None,
) -> Iterator[Block]:
    """A slice's blocks numbered as the source's, cut at max_len, its picks kept, the items still
    to drop dropped (``position``: the in-slice item position of the first block)."""
    base = w.sl.shard - w.local.shard
    pick, lead = w.sl.pick, w.sl.lead
    docs = source.mode == "docs"
    for block in blocks:
        block = rebase(block, base)
        if docs:
            block, cut = _apply_max_len(block, spec)
            if stats is not None:
                stats.truncated_tokens += cut
        if pick is not None:
            here = position + np.arange(len(block))
            position += len(block)
            block = block.take(np.nonzero(np.isin(here, pick, assume_unique=True))[0])
        if lead and len(block):  # the first item's first tokens belong to an earlier row
            block = rebase_lead(block, lead)
            lead = 0
        if to_drop.items:
            take = min(to_drop.items, len(block))
            to_drop.items -= take
            block = block.slice(take, len(block))
        if len(block):
            yield block


def rebase_lead(block: Block, lead: int) -> Block:
    """``block`` with its first item's first ``lead`` tokens left out."""
    starts, lengths = block.starts.copy(), block.lengths.copy()
    starts[0] += lead
    lengths[0] -= lead
    return replace(block, starts=starts, lengths=lengths)


def _items_of_docs(source: Source, sl: Slice, spec: StreamSpec, docs: int) -> int:
    """In-slice item position of the first item of document ``docs``."""
    if docs <= 0:
        return 0
    if not spec.splits(source.mode):
        return docs
    lengths = slice_doc_lengths(source, sl)[:docs]
    return int(pieces_per_doc(lengths, spec.max_len).sum())


def _slice_work(
    source: Source, slices: Iterable[Slice], spec: StreamSpec, start: int
) -> Iterator[tuple[Slice, int, int]]:
    """(slice, documents to skip by group, items to drop after reading) for each slice to read."""
    pos = 0  # plan position of the current slice's first item
    remaining = start  # items still to pass when counts are unknown
    for sl in slices:
        n = slice_item_count(source, sl, spec)
        if n is None:
            # Unknown counts: read from the first slice and drop items until ``start``.
            yield sl, 0, remaining
            remaining = 0
            continue
        if pos + n <= start or n == 0:  # passed, or holds nothing (a slice whose picks were all left out)
            pos += n
            continue
        skip_items = max(0, start - pos)
        pos += n
        if sl.pick is not None:
            # keep the picks from skip_items on; read from the document holding the first one
            sl = replace(sl, pick=sl.pick[skip_items:], lead=0 if skip_items else sl.lead)
            skip_docs, _ = _docs_before(source, sl, spec, int(sl.pick[0]))
            yield sl, skip_docs, 0
            continue
        skip_docs, passed = _docs_before(source, sl, spec, skip_items)
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
