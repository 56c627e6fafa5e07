"""One short batch per rank where items' lengths are unknown: the loader merges the workers' tails.

Raw text without a count sidecar has no lengths before it is read, so no worker can find from
lengths which items the other workers' full batches leave out (``handoff.py`` does that where
lengths are known). Here every worker batches its whole share with its mode's batcher, never
dropping a short batch, and flags the batches it made after its item stream ended
(``StreamEnd``): its last batch, a bucket mode's final window(s), pack's rows of its last windows.
The loader holds the flagged batches as they arrive (``TailMerge``) and, once every worker has
ended, re-batches their items by the same rules (``batch_size``, token budgets, pack, concat; one
window wide enough for all of them) into full batches and at most one short one, which
``drop_last`` drops.

Resume stays exact without holding anything across a save: the flagged batches are a suffix of
each worker's batches and are never handed out, so a saved worker position never passes the first
of them and a resumed worker makes them again. The state counts the merged batches handed out
(``Cursor.tails``), and a resumed merge skips that many: the merge is a pure function of the
flagged batches, taken in (worker, batch) order whatever order they arrived in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .batching import Batch, Batcher
from .block import Block, concat_blocks
from .mixstats import mix_counts
from .stream import StreamSpec, has_lengths

if TYPE_CHECKING:
    from .config import Config
    from .sources.protocol import Source


def merges_tails(source: Source, cfg: Config, workers: int) -> bool:
    """Whether a loader with ``workers`` workers per rank merges their tails: a finite, batched
    epoch of several workers whose items' lengths are unknown before reading (else the workers
    hand their tails over themselves, ``handoff.hands_tails``, or the stream has no end)."""
    return workers > 1 and not cfg.unbatched and not cfg.infinite and not has_lengths(source)


def worker_batcher(cfg: Config) -> Batcher:
    """The batcher of a worker whose tail the loader merges: the mode's, keeping its short batch
    (``drop_last`` applies once, to the merge)."""
    return replace(cfg, drop_last=False).make_batcher()


class StreamEnd:
    """A worker's shuffled item stream, noting when it ran out: a batch made after that is one of
    the worker's epoch-final batches. A batcher asks for items only when it needs them, so which
    batches come after the end depends on the stream's item count alone, also after a resume."""

    def __init__(self, shuffled: Iterable[tuple[int, Block]]):
        self.shuffled = shuffled
        self.ended = False

    def __iter__(self) -> Iterator[tuple[int, Block]]:
        yield from self.shuffled
        self.ended = True


def tail_items(items: Block, joins_rows: bool) -> Block:
    """The items a held batch was made of: itself (documents, pieces), or its rows' segments
    (pack, concat), where ``joins_rows`` joins the two parts of a document cut at a row's end
    (concat's rows cut documents anywhere; pack's items stay whole, at most a row long)."""
    if items.seg_lo is None:
        return items
    counts, src = items.segments()
    if not len(src):
        return Block(items.tokens[:0], *(np.zeros(0, np.int64),) * 3)
    row = np.repeat(np.arange(len(items)), counts)
    seg_start = items.seg_starts[src]
    ends = np.cumsum(counts)
    seg_end = np.append(seg_start[1:], 0)
    held = counts > 0
    seg_end[ends[held] - 1] = items.lengths[held]
    seg_len = seg_end - seg_start
    ids = items.seg_ids[src]
    at = items.starts[row] + seg_start
    tokens = items.tokens[np.repeat(at - (np.cumsum(seg_len) - seg_len), seg_len) + np.arange(int(seg_len.sum()))]
    first = np.ones(len(src), bool)
    if joins_rows and len(src) > 1:
        opens_row = np.zeros(len(src), bool)
        opens_row[(ends - counts)[held]] = True
        ends_row = np.zeros(len(src), bool)
        ends_row[ends[held] - 1] = True
        cont = opens_row[1:] & (seg_start[1:] == 0) & ends_row[:-1] & (ids[1:] == ids[:-1])
        first[1:] = ~cont
    group = np.cumsum(first) - 1
    lengths = np.bincount(group, weights=seg_len, minlength=int(group[-1]) + 1).astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    return Block(tokens, starts, lengths, ids[first])


def merged_batches(held: list[Batch], cfg: Config, spec: StreamSpec) -> Iterator[Block]:
    """The batches the items of ``held`` (the workers' flagged batches) make by the mode's rules,
    with one window over all of them: full batches and at most one short one (none with
    ``drop_last``). ``spec``: the random key of the merge (batch order, pack's rows)."""
    parts = [b.items for b in sorted(held, key=lambda b: (b.worker, b.index)) if len(b.items)]
    if not parts:
        return
    items = tail_items(concat_blocks(parts), joins_rows=cfg.mode.rows and not cfg.mode.pieces_at_seq_len)
    if not len(items):
        return
    rules = replace(cfg, window=max(cfg.window, len(items))) if cfg.window else cfg
    for _, block, _ in rules.make_batcher().batches(iter([(0, items)]), 0, spec):
        yield block


class TailMerge:
    """The loader's stage after DataLoader's round robin: the workers' flagged batches held (what
    they counted passed to ``on_stats``), the others passed on, then the merge of the held ones,
    its first ``skip`` batches left out (handed out before a resume). Merged batches come out
    flagged ``tail``, numbered from 0, with the merge's key as their worker."""

    def __init__(self, cfg: Config, spec: StreamSpec, skip: int, on_stats: Callable[[Any], None], mix=None):
        self.cfg, self.spec, self.skip, self.on_stats = cfg, spec, skip, on_stats
        #: (mixing, mode) where batches count their sources (a mixture): the merge counts its own
        self.mix = mix

    def run(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        held: list[Batch] = []
        for batch in batches:
            if not batch.tail:
                yield batch
                continue
            held.append(batch)
            if batch.stats:
                self.on_stats(batch.stats)
        for index, block in enumerate(merged_batches(held, self.cfg, self.spec)):
            if index < self.skip:
                continue
            out = Batch(block, index=index, epoch=self.spec.epoch, worker=self.spec.worker, tail=True)
            if self.mix is not None:
                out.mix = mix_counts(block, *self.mix)
            yield out


def merge_key(cfg: Config, epoch: int, rank: int, world: int, workers: int) -> StreamSpec:
    """The random key of a rank's merge in ``epoch``: its own (worker ``workers``, which no
    DataLoader worker is), so its batch order is drawn apart from every worker's."""
    return cfg.spec(epoch, rank, world, workers, workers)
