"""The epoch plan: which shards, or parts of shards, each rank and worker reads.

Randomness comes only from (seed, epoch) for the shard order, shared by every rank and worker,
and from (seed, epoch, rank, worker, ...) for per-worker streams (see ``rng``). The order is split
by rank first and then by worker. With an index the split is by what the stream yields (documents,
rows, or the pieces of documents split at max_len, a cut then falling inside a document), so every
rank gets the same count to within one, and shards are cut below shard level whenever a boundary
falls inside one; without an index whole shards are dealt out, and when there are
fewer shards than consumers a shard's items are dealt out by stride.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .block import pieces_per_doc
from .slices import Slice, Slices

if TYPE_CHECKING:
    from .counts import EpochPlan
    from .sources.protocol import Source
    from .stream import StreamSpec

# Independent random streams: the same (seed, epoch) never feeds two different decisions.
STREAM_SHARD_ORDER = 1
STREAM_SAMPLE_SHUFFLE = 2
STREAM_BATCH_ORDER = 3
STREAM_RESAMPLE = 4
STREAM_PACK = 5
STREAM_TORCH = 6
_MASK = (1 << 63) - 1


def rng(seed: int, *key: int) -> np.random.Generator:
    """A generator determined by the seed and the key alone (never by pid, time or urandom)."""
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([int(seed) & _MASK, *[int(k) & _MASK for k in key]]))
    )


#: an epoch of one indexed dataset is cut into about this many blocks (more where shards are more)
EPOCH_BLOCKS = 1024
#: ... of at least this many tokens each (a ranged read of a remote shard per block)
MIN_BLOCK_TOKENS = 1 << 18


def torch_seed(seed: int, epoch: int) -> int:
    """The seed of the torch.Generator handed to DataLoader for ``epoch`` (its workers' base seed):
    drawn from our own stream, so iterating a loader never draws from torch's global RNG."""
    return int(rng(seed, STREAM_TORCH, epoch).integers(0, 1 << 62))


def shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    if not shuffle:
        return np.arange(n_shards)
    return rng(seed, STREAM_SHARD_ORDER, epoch).permutation(n_shards)


@dataclass(frozen=True)
class EpochBlocks:
    """Consecutive runs of items of the shards, each read as one range, in the epoch's order:
    what an epoch of an indexed dataset shuffles, so that it reshuffles at any shard count."""

    shards: np.ndarray  # the shard of each block
    firsts: np.ndarray  # its first item in the shard
    counts: np.ndarray  # its items
    order: np.ndarray | None = None  # block i is block order[i] in the shards' order (None: the same)
    #: (shards, firsts, counts) in the shards' order; None where each block is a whole shard
    natural: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    #: ``piece_ends`` of the last ``DocPieces`` asked: [(weak reference to its lengths, max_len, ends)]
    _piece_ends: list = field(default_factory=list, compare=False, repr=False)

    def pieces_of(self, doc_pieces: DocPieces) -> BlockPieces:
        """Pieces of the documents of block ``i`` (in epoch order), from a shard's ``doc_pieces``."""
        return functools.partial(_block_pieces, self, doc_pieces)

    def piece_ends(self, doc_pieces: DocPieces) -> np.ndarray:
        """The running sum of ``pieces`` (read-only), kept with the blocks (which are kept too:
        ``_RecentBlocks``): a process asks for an epoch's pieces for its counts, then for its plan,
        and a worker forked after that finds them counted."""
        for lengths, max_len, ends in self._piece_ends:
            if lengths() is doc_pieces.lengths and max_len == doc_pieces.max_len:
                return ends
        ends = np.cumsum(self.pieces(doc_pieces))
        ends.flags.writeable = False
        # weakly: the blocks are kept while their dataset's table lives, not the other way round
        self._piece_ends[:] = [(weakref.ref(doc_pieces.lengths), doc_pieces.max_len, ends)]
        return ends

    def pieces(self, doc_pieces: DocPieces) -> np.ndarray:
        """Pieces of each block, in epoch order: counted in the shards' order (one pass along
        the lengths, nothing to sort), then put in the epoch's."""
        if self.order is None:
            return doc_pieces.sums(self.shards, self.firsts, self.firsts + self.counts)
        if self.natural is not None:
            shards, firsts, counts = self.natural
        else:  # whole shards: block order[i] of the shards' order is shard order[i]
            shards, firsts, counts = np.arange(len(self.order), dtype=np.int64), self.firsts, np.empty_like(self.counts)
            counts[self.order] = self.counts
        return doc_pieces.sums(shards, firsts, firsts + counts)[self.order]


def _block_pieces(blocks: EpochBlocks, doc_pieces: DocPieces, i: int) -> np.ndarray:
    first = int(blocks.firsts[i])
    return doc_pieces(int(blocks.shards[i]), first, first + int(blocks.counts[i]))


class _RecentBlocks:
    """The last epoch's blocks, kept for the next ask: a process plans an epoch of a large
    dataset twice (its counts, then its plan), from the same columns of the index. Kept only for
    read-only arrays (a ``ShardTable``'s columns, never changed once made), so the same objects
    mean the same counts, and only while they live (weakly held: a closed loader's dataset is not
    kept by its blocks); the tuple is replaced whole, so threads need no lock."""

    def __init__(self) -> None:
        self.kept: tuple | None = None

    def get(self, items: Any, tokens: Any, key: tuple, make: Callable[[], EpochBlocks]) -> EpochBlocks:
        if not all(isinstance(x, np.ndarray) and not x.flags.writeable for x in (items, tokens) if x is not None):
            return make()
        kept = self.kept
        if kept is not None and kept[0]() is items and (kept[1]() if kept[1] else None) is tokens and kept[2] == key:
            return kept[3]
        blocks = make()
        self.kept = (weakref.ref(items), weakref.ref(tokens) if tokens is not None else None, key, blocks)
        weakref.finalize(items, self._forget, id(blocks))
        return blocks

    def _forget(self, made: int) -> None:
        kept = self.kept
        if kept is not None and id(kept[3]) == made:
            self.kept = None


_recent_blocks = _RecentBlocks()


def epoch_blocks(
    items_per_shard: Sequence[int], tokens_per_shard: Sequence[int] | None, seed: int, epoch: int, shuffle: bool
) -> EpochBlocks:
    """The blocks of the epoch in their order: each shard cut into ``blocks_per_shard`` runs of
    sizes differing by at most one, ordered by (seed, epoch): decided before the split into
    shares, reseeded each epoch, the same for every rank and worker."""
    make = functools.partial(_epoch_blocks, items_per_shard, tokens_per_shard, seed, epoch, shuffle)
    return _recent_blocks.get(items_per_shard, tokens_per_shard, (seed, epoch, shuffle), make)


def _epoch_blocks(
    items_per_shard: Sequence[int], tokens_per_shard: Sequence[int] | None, seed: int, epoch: int, shuffle: bool
) -> EpochBlocks:
    items = np.asarray(items_per_shard, dtype=np.int64)
    per_shard = blocks_per_shard(items, tokens_per_shard)
    order = shard_order(int(per_shard.sum()), seed, epoch, shuffle)
    if len(per_shard) == len(order):  # a block per shard (many shards): each shard whole
        whole = np.broadcast_to(np.zeros(1, np.int64), (len(order),))  # every block from its shard's start
        return EpochBlocks(order, whole, items[order], order)
    shards = np.repeat(np.arange(len(items), dtype=np.int64), per_shard)
    j = np.arange(len(shards), dtype=np.int64) - np.repeat(np.cumsum(per_shard) - per_shard, per_shard)
    n, k = items[shards], per_shard[shards]
    step = _grain(items, tokens_per_shard)[shards]
    grains = -(-n // step)
    firsts = np.minimum(n, step * (grains * j // k))
    stops = np.minimum(n, step * (grains * (j + 1) // k))
    counts = stops - firsts
    return EpochBlocks(shards[order], firsts[order], counts[order], order, (shards, firsts, counts))


def _grain(items: np.ndarray, tokens_per_shard: Sequence[int] | None) -> np.ndarray:
    """Items per ``MIN_BLOCK_TOKENS`` tokens of each shard: blocks are cut at multiples of it, so
    that they fall on group edges where groups hold that many tokens (packed rows at the default
    ``--sample-tokens``): a group is then read, checked and decoded by one block, not two."""
    if tokens_per_shard is None:
        return np.ones(len(items), np.int64)
    tokens = np.maximum(1, np.asarray(tokens_per_shard, dtype=np.int64))
    return np.maximum(1, np.rint(items * MIN_BLOCK_TOKENS / tokens).astype(np.int64))


def blocks_per_shard(items: np.ndarray, tokens_per_shard: Sequence[int] | None) -> np.ndarray:
    """Blocks each shard is cut into: enough for ``EPOCH_BLOCKS`` in the epoch, none under
    ``MIN_BLOCK_TOKENS`` nor under one item; one per shard where tokens are unknown."""
    if tokens_per_shard is None or len(items) == 0:
        return np.ones(len(items), np.int64)
    wanted = -(-EPOCH_BLOCKS // len(items))
    if wanted == 1:  # shards enough for the epoch's blocks: each is one
        return np.ones(len(items), np.int64)
    by_tokens = np.asarray(tokens_per_shard, dtype=np.int64) // MIN_BLOCK_TOKENS
    grains = -(-items // _grain(items, tokens_per_shard))
    return np.maximum(1, np.minimum(np.minimum(wanted, by_tokens), grains))


def block_tokens(source: Source) -> np.ndarray | None:
    """The tokens per unit that cut a source's units into blocks: a source whose units are read by
    range (``opens_units``: shards). Raw text's units are parsed from their start to reach any
    document, so they stay whole (None)."""
    return source.tokens_per_shard if source.opens_units else None


def cuts_shards(items_per_shard: Sequence[int] | None, tokens_per_shard: Sequence[int] | None) -> bool:
    """Whether an epoch's blocks are finer than its shards (else the block order is the shard order)."""
    if items_per_shard is None:
        return False
    return bool((blocks_per_shard(np.asarray(items_per_shard, np.int64), tokens_per_shard) > 1).any())


def split_range(total: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of ``parts`` contiguous ranges of [0, total), sizes differing by at most one."""
    return total * i // parts, total * (i + 1) // parts


def consumer_shares(
    total: int, world: int, workers: int, first: int = 0, ranks: Sequence[int] | None = None, unit: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """[ranks, workers] starts and stops of each consumer's share of the ``total`` items from
    position ``first``: by rank first, then each rank's part by worker (``split_range`` at each
    level, in closed form). The one rule by which an epoch of one dataset, a mixture's stretch
    and the remainder of an interrupted epoch are shared; ``ranks``: only those rows (all: None).
    A rank's part is dealt to its workers in whole ``unit``s (batches), the remainder to its last
    worker: one short batch per rank, not one per worker."""
    r = np.arange(world, dtype=np.int64) if ranks is None else np.asarray(ranks, np.int64)
    rank_start = total * r // world
    rank_size = total * (r + 1) // world - rank_start
    w = np.arange(workers + 1, dtype=np.int64)
    units = rank_size[:, None] // unit
    cuts = first + rank_start[:, None] + unit * (units * w[None, :] // workers)
    cuts[:, -1] = first + rank_start + rank_size
    return cuts[:, :-1], cuts[:, 1:]


def consumer_share(
    total: int, rank: int, world: int, worker: int, workers: int, first: int = 0, unit: int = 1
) -> tuple[int, int]:
    """Consumer (rank, worker)'s share of ``consumer_shares``: [start, stop)."""
    starts, stops = consumer_shares(total, world, workers, first, ranks=[rank], unit=unit)
    return int(starts[0, worker]), int(stops[0, worker])


@dataclass(eq=False)
class EpochLayout:
    """Every consumer's share of an epoch with an index, at once: the shard order, items per shard
    in that order and their running ends, and each (rank, worker)'s item range. O(shards +
    consumers), whatever the number of items. With ``pieces`` (documents split at max_len) the
    shares are ranges of pieces, not documents: a cut may fall inside a document."""

    order: np.ndarray
    counts: np.ndarray
    ends: np.ndarray
    starts: np.ndarray  # [world, workers]: first item (in epoch order) of each consumer
    stops: np.ndarray  # [world, workers]: one past its last
    firsts: np.ndarray | None = None  # blocks of shards (``order``: their shards): first item of each
    pieces: EpochPieces | None = None  # starts and stops count pieces of documents
    whole: bool = False  # each block is a whole shard (``firsts`` all 0, ``counts`` the shards' items)

    def slices(self, rank: int, worker: int) -> Slices:
        """The slices (rank, worker) reads, in reading order."""
        a, b = int(self.starts[rank, worker]), int(self.stops[rank, worker])
        if self.pieces is not None:
            return self.pieces.slices(self, a, b)
        return slices_of_range(self.order, self.counts, self.ends, a, b, self.firsts)

    def in_documents(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(document in epoch order, pieces of it before the point) of each item position."""
        points = np.asarray(points, np.int64)
        if self.pieces is None:
            return points, np.zeros(len(points), np.int64)
        found = [self.pieces.document_of(self, int(p)) for p in points.tolist()]
        return np.array([d for d, _ in found], np.int64), np.array([k for _, k in found], np.int64)


@dataclass(frozen=True)
class DocPieces:
    """Pieces each document of a source's shards becomes in the stream when split at
    ``max_len`` (``block.pieces_per_doc``; ``piece_counter``)."""

    lengths: Any  # the source's DocumentLengths
    max_len: int

    def __call__(self, shard: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Pieces of each document [start, stop) of ``shard``."""
        return pieces_per_doc(self.lengths.of_unit(shard, start, stop).astype(np.int64), self.max_len)

    def sums(self, shards: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """Pieces of documents [starts[i], stops[i]) of each shard ``shards[i]`` (ranges that do not
        overlap), in one pass over the lengths they cover."""
        return self.lengths.pieces(shards, starts, stops, self.max_len)


#: pieces of each document of block ``i`` of an epoch (``EpochBlocks.pieces_of``)
BlockPieces = Callable[[int], np.ndarray]


@dataclass(eq=False)
class EpochPieces:
    """The pieces of an epoch's blocks: ``ends`` their running sum (block order), and
    ``per_doc(i)`` the pieces of each document of block ``i``. What lets a share start or stop
    inside a document: ranks and workers then differ by at most one piece, not one document."""

    ends: np.ndarray
    per_doc: BlockPieces

    @classmethod
    def of(cls, blocks: EpochBlocks, doc_pieces: DocPieces) -> EpochPieces:
        return cls(blocks.piece_ends(doc_pieces), blocks.pieces_of(doc_pieces))

    @property
    def total(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def document_of(self, layout: EpochLayout, point: int) -> tuple[int, int]:
        """(document in epoch order, pieces of it before) at piece position ``point``."""
        if point >= self.total:
            return (int(layout.ends[-1]) if len(layout.ends) else 0), 0
        i = int(np.searchsorted(self.ends, point, side="right"))
        through = np.cumsum(self.per_doc(i))
        within = point - int(self.ends[i - 1] if i else 0)
        doc = int(np.searchsorted(through, within, side="right"))
        return int(layout.ends[i] - layout.counts[i]) + doc, within - int(through[doc - 1] if doc else 0)

    def slices(self, layout: EpochLayout, a: int, b: int) -> Slices:
        """Slices covering pieces [a, b) in epoch order: whole documents as ranges, a document
        cut by a share's edge as a one-document slice that picks its pieces. Only the blocks at
        the edges are looked into; the blocks between are read whole."""
        if b <= a:
            return Slices.of([])
        i = int(np.searchsorted(self.ends, a, side="right"))  # the block of the first piece
        j = int(np.searchsorted(self.ends, b - 1, side="right"))  # ... of the last
        start_i, start_j = (int(self.ends[k - 1]) if k else 0 for k in (i, j))
        if i == j:
            return Slices.of(_block_piece_slices(layout, i, self.per_doc(i), a - start_i, b - start_i))
        head = _block_piece_slices(layout, i, self.per_doc(i), a - start_i, int(self.ends[i]) - start_i)
        tail = _block_piece_slices(layout, j, self.per_doc(j), 0, b - start_j)
        between = i + 1 + np.flatnonzero(np.diff(self.ends[i:j]) > 0)  # the blocks between, with pieces
        first = np.zeros(len(between), np.int64) if layout.firsts is None else layout.firsts[between]
        whole = Slices(layout.order[between], first, first + layout.counts[between])
        return Slices.join([head, whole, tail])


def _block_piece_slices(layout: EpochLayout, i: int, per_doc: np.ndarray, s: int, e: int) -> list[Slice]:
    """Pieces [s, e) of block ``i`` (``per_doc``: the pieces of each of its documents) as slices."""
    shard, first = int(layout.order[i]), 0 if layout.firsts is None else int(layout.firsts[i])
    through = np.cumsum(per_doc)
    lo = int(np.searchsorted(through, s, side="right"))  # the document of the first piece
    hi = int(np.searchsorted(through, e - 1, side="right"))  # ... of the last
    head = s - int(through[lo - 1] if lo else 0)  # pieces of the first document not taken
    tail = e - int(through[hi - 1] if hi else 0)  # pieces of the last document taken
    if lo == hi and (head or tail < per_doc[hi]):
        return [Slice(shard, first + lo, first + lo + 1, pick=np.arange(head, tail))]
    out = []
    whole_from, whole_to = lo, hi + 1
    if head:
        out.append(Slice(shard, first + lo, first + lo + 1, pick=np.arange(head, int(per_doc[lo]))))
        whole_from = lo + 1
    if tail < per_doc[hi]:
        whole_to = hi
    if whole_to > whole_from:
        out.append(Slice(shard, first + whole_from, first + whole_to))
    if tail < per_doc[hi]:
        out.append(Slice(shard, first + hi, first + hi + 1, pick=np.arange(0, tail)))
    return out


def piece_counter(source: Source, spec: StreamSpec) -> DocPieces | None:
    """What weighs a document in the split when the stream splits documents at max_len (each
    becomes ``pieces_per_doc`` items); None where a document is one item."""
    lengths = source.lengths() if spec.splits(source.mode) else None
    if lengths is None:
        return None
    return DocPieces(lengths, spec.max_len)


def epoch_layout(
    items_per_shard: Sequence[int],
    *,
    seed: int,
    epoch: int,
    world: int,
    workers: int,
    shuffle: bool = True,
    doc_pieces: DocPieces | None = None,
    tokens_per_shard: Sequence[int] | None = None,
    unit: int = 1,
) -> EpochLayout:
    """The shares of every (rank, worker): ``consumer_shares`` of the items, or with
    ``doc_pieces`` (documents split at max_len) of their pieces, in whole ``unit``s per worker."""
    blocks = epoch_blocks(items_per_shard, tokens_per_shard, seed, epoch, shuffle)
    counts = blocks.counts
    ends = np.cumsum(counts)
    pieces = None if doc_pieces is None else EpochPieces.of(blocks, doc_pieces)
    total = int(ends[-1]) if len(ends) else 0
    starts, stops = consumer_shares(total if pieces is None else pieces.total, world, workers, unit=unit)
    return EpochLayout(blocks.shards, counts, ends, starts, stops, blocks.firsts, pieces, blocks.natural is None)


def plan_epoch(
    items_per_shard: Sequence[int] | None,
    n_shards: int,
    *,
    seed: int,
    epoch: int,
    rank: int,
    world: int,
    worker: int,
    workers: int,
    shuffle: bool = True,
    doc_pieces: DocPieces | None = None,
    tokens_per_shard: Sequence[int] | None = None,
    unit: int = 1,
) -> Sequence[Slice]:
    """The slices that (rank, worker) reads in this epoch, in reading order (``doc_pieces``:
    documents shared by their pieces, ``unit``: items per batch, ``epoch_layout``)."""
    if items_per_shard is not None:
        layout = epoch_layout(
            items_per_shard,
            seed=seed,
            epoch=epoch,
            world=world,
            workers=workers,
            shuffle=shuffle,
            doc_pieces=doc_pieces,
            tokens_per_shard=tokens_per_shard,
            unit=unit,
        )
        return layout.slices(rank, worker)
    order = shard_order(n_shards, seed, epoch, shuffle)
    consumers = world * workers
    if n_shards >= world:
        mine = order[rank::world]
        if len(mine) >= workers:
            return [Slice(int(s)) for s in mine[worker::workers]]
        # This rank has fewer shards than workers: share them by stride.
        return _stride_share(mine, workers, worker)
    consumer = rank * workers + worker
    return _stride_share(order, consumers, consumer)


def slices_for(source: Source, cfg: Any, spec: StreamSpec, plan: EpochPlan | None = None) -> Sequence[Slice]:
    """The slices (rank, worker) reads in ``spec.epoch``, in reading order: ``plan``'s (the
    remainder of an interrupted epoch), the source's own (a mixture's), or ``plan_epoch``'s. Every
    stage that asks what a consumer reads asks here."""
    if plan is None:
        plan = source.default_plan(spec.epoch)
    if plan is not None:
        return plan.slices_for(source, cfg, spec.rank, spec.world, spec.worker, spec.workers)
    if source.items_per_shard is not None:
        return source_layout(source, cfg, spec).slices(spec.rank, spec.worker)
    return plan_epoch(
        None,
        len(source.urls),
        seed=spec.seed,
        epoch=spec.epoch,
        rank=spec.rank,
        world=spec.world,
        worker=spec.worker,
        workers=spec.workers,
        shuffle=spec.shuffle,
    )


def source_layout(source: Source, cfg: Any, spec: StreamSpec) -> EpochLayout:
    """The ``epoch_layout`` of ``source`` planned normally (it has items per shard) for the epoch,
    world and workers of ``spec``: what each of its consumers' shares is cut from."""
    return epoch_layout(
        source.items_per_shard,
        seed=spec.seed,
        epoch=spec.epoch,
        world=spec.world,
        workers=spec.workers,
        shuffle=spec.shuffle,
        doc_pieces=piece_counter(source, spec),
        tokens_per_shard=block_tokens(source),
        unit=cfg.share_unit(source.mode),
    )


def count_ahead(source: Source, cfg: Any, spec: StreamSpec, plan: EpochPlan | None = None) -> None:
    """Count now, in the process about to start the workers of ``spec``'s rank, what each of them
    would count again to find its share: the pieces of the epoch's documents where the stream
    splits them at max_len, a pass over every document's length. The epoch's blocks keep them
    (``EpochBlocks.piece_ends``; the blocks are kept by ``_recent_blocks``), and so do the source's
    lengths (``IndexLengths.pieces``): a forked worker inherits both, a spawned one gets the
    latter with the pickled source. So the pass is made once a rank and epoch, not once a worker.
    Nothing for an epoch planned otherwise."""
    if plan is None:
        plan = source.default_plan(spec.epoch)
    planned = plan is None and not spec.resample and source.items_per_shard is not None
    if planned and piece_counter(source, spec) is not None:
        source_layout(source, cfg, spec)


def _stride_share(shards: np.ndarray, consumers: int, consumer: int) -> list[Slice]:
    n = len(shards)
    if n == 0:
        return []
    j = consumer % n
    sharing = len(range(j, consumers, n))
    return [Slice(int(shards[j]), start=consumer // n, stop=None, stride=sharing)]


def slices_of_range(
    order: np.ndarray, counts: np.ndarray, ends: np.ndarray, a: int, b: int, firsts: np.ndarray | None = None
) -> Slices:
    """Slices covering items [a, b) of the shards concatenated in ``order`` (blocks of shards:
    ``firsts[i]`` is the first item of block ``i`` in its shard ``order[i]``), as columns."""
    if b <= a or not len(order):
        return Slices(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    i = int(np.searchsorted(ends, a, side="right"))
    j = min(len(order), int(np.searchsorted(ends, b - 1, side="right")) + 1)
    block_end = np.asarray(ends[i:j], np.int64)
    block_start = block_end - np.asarray(counts[i:j], np.int64)
    lo = np.maximum(a, block_start) - block_start
    hi = np.minimum(b, block_end) - block_start
    first = 0 if firsts is None else np.asarray(firsts[i:j], np.int64)
    keep = np.flatnonzero(hi > lo)
    return Slices(np.asarray(order[i:j], np.int64)[keep], (first + lo)[keep], (first + hi)[keep])


def resampled_shards(
    n_shards: int, *, seed: int, epoch: int, rank: int, worker: int, start: int, count: int
) -> np.ndarray:
    """Shard draws ``start .. start+count-1`` of a with-replacement stream for (rank, worker).

    Draws come in blocks of 1024 with their own generator, so any draw can be recomputed without
    replaying the ones before it (resumption).
    """
    out = np.empty(count, np.int64)
    filled = 0
    pos = start
    while filled < count:
        block, within = divmod(pos, 1024)
        draws = rng(seed, STREAM_RESAMPLE, epoch, rank, worker, block).integers(0, n_shards, 1024)
        take = min(1024 - within, count - filled)
        out[filled : filled + take] = draws[within : within + take]
        filled += take
        pos += take
    return out


def resampled_slices(n_shards: int, seed: int, epoch: int, rank: int, worker: int) -> Iterator[Slice]:
    """An endless with-replacement stream of whole shards for (rank, worker)."""
    drawn = 0
    while True:
        for shard in resampled_shards(
            n_shards, seed=seed, epoch=epoch, rank=rank, worker=worker, start=drawn, count=256
        ):
            yield Slice(int(shard))
        drawn += 256
