"""Blocks of items (documents, or packed rows): the unit every stage after reading moves. Pure numpy.

Items move through the pipeline in blocks, never one by one: a block is a token buffer plus
per-item offsets, lengths and identities, so that selecting, permuting and batching are numpy
index operations: per-item Python would cap the loader far below what training consumes.

Identities: an item is ``(shard index << 32) | ordinal within the shard``, where the shard index
is the shard's position in the source (the index order). A document split at load time keeps
its id and gets a piece number.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

ID_SHIFT = 32


def make_id(shard: int, ordinal: np.ndarray | int) -> np.ndarray | int:
    return (np.int64(shard) << ID_SHIFT) | ordinal


def split_id(item_id: int) -> tuple[int, int]:
    """(shard index in the source, ordinal of the item within the shard)."""
    return int(item_id) >> ID_SHIFT, int(item_id) & ((1 << ID_SHIFT) - 1)


@dataclass
class Block:
    """Items over one token buffer, with per-item arrays that selections index together.

    Packed rows carry the documents they hold in one or both of two forms:

    - ``doc_first``/``doc_count`` (rows of a packed dataset): the document holding the row's
      first token and how many documents the row holds. Packing at pack time is sequential, so
      they are that document and the ones after it in shard order (``doc_next`` is the second:
      the shard's first document when the row continues one of the previous shard).
    - a segment table (``seg_starts``: offset within the row, ``seg_ids``: document id), shared
      by selections and never permuted: row ``i``'s segments are entries ``seg_lo[i]:seg_hi[i]``
      (see ``segments`` for them in row order). Batchers that pack documents into rows make it,
      and reading makes it where segment offsets are needed (``boundaries``).
    """

    tokens: np.ndarray
    starts: np.ndarray  # int64 offset of each item in ``tokens``
    lengths: np.ndarray  # int64
    ids: np.ndarray  # int64 item identities
    pieces: np.ndarray | None = None  # docs mode: piece number after a load-time split
    seg_lo: np.ndarray | None = None  # packed rows: first table entry of each row
    seg_hi: np.ndarray | None = None  # packed rows: one past its last
    seg_starts: np.ndarray | None = None  # the segment table: offset of the segment in its row
    seg_ids: np.ndarray | None = None  # the segment table: document id
    doc_first: np.ndarray | None = None  # packed dataset rows: id of the document holding the first token
    doc_next: np.ndarray | None = None  # packed dataset rows: id of the document after that one
    doc_count: np.ndarray | None = None  # packed dataset rows: documents in the row
    seg_lens: np.ndarray | None = None  # the segment table: tokens of the segment (when its maker knew them)
    #: ``segments()``, kept: counting a mixture's sources and collating both ask for it
    _segments: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def set_segments(
        self, seg_ptr: np.ndarray, seg_starts: np.ndarray, seg_ids: np.ndarray, seg_lens: np.ndarray | None = None
    ) -> Block:
        """Segments given in row order: row i's are ``seg_ptr[i]:seg_ptr[i+1]``; ``seg_lens``, their
        token counts, where the maker knows them (what counting a mixture's tokens by source reads)."""
        self.seg_lo, self.seg_hi = seg_ptr[:-1], seg_ptr[1:]
        self.seg_starts, self.seg_ids = seg_starts, seg_ids
        self.seg_lens = seg_lens
        self._segments = None
        return self

    def segments(self) -> tuple[np.ndarray, np.ndarray]:
        """(segments per row, table index of every segment in row order)."""
        return self._segment_layout()[:2]

    def row_last_segments(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows that hold segments, the row-order position of each one's last segment)."""
        counts, _, ends = self._segment_layout()
        rows = np.flatnonzero(counts)
        return rows, ends[rows] - 1

    def _segment_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._segments is None:
            counts = self.seg_hi - self.seg_lo
            ends = np.cumsum(counts)
            total = int(ends[-1]) if len(ends) else 0
            self._segments = counts, np.repeat(self.seg_lo - (ends - counts), counts) + np.arange(total), ends
        return self._segments

    def _select(self, sel: np.ndarray | slice) -> Block:
        # every per-item array, spelled out (not a getattr loop: this runs for every batch)
        return Block(
            self.tokens,
            self.starts[sel],
            self.lengths[sel],
            self.ids[sel],
            None if self.pieces is None else self.pieces[sel],
            None if self.seg_lo is None else self.seg_lo[sel],
            None if self.seg_hi is None else self.seg_hi[sel],
            self.seg_starts,
            self.seg_ids,
            None if self.doc_first is None else self.doc_first[sel],
            None if self.doc_next is None else self.doc_next[sel],
            None if self.doc_count is None else self.doc_count[sel],
            self.seg_lens,
        )

    def take(self, idx: np.ndarray) -> Block:
        """Items ``idx`` (a permutation or a selection), sharing the token buffer and the segment table."""
        return self._select(idx)

    def slice(self, a: int, b: int) -> Block:
        """Items ``a:b`` as views."""
        return self._select(slice(a, b))

    def gather_tokens(self) -> np.ndarray:
        """The items' tokens concatenated in item order (a copy unless already contiguous)."""
        n = len(self)
        if n == 0:
            return self.tokens[:0]
        width = int(self.lengths[0])
        if n > 1 and width and self.lengths.min() == width == self.lengths.max():
            # equal lengths (packed rows): copy whole rows from a strided view, no per-token index
            return row_view(self.tokens, width)[self.starts].reshape(-1)
        first, total = int(self.starts[0]), int(self.lengths.sum())
        if n == 1 or np.array_equal(self.starts[1:], (self.starts + self.lengths)[:-1]):
            return self.tokens[first : first + total]
        if n <= 512 or total >= GATHER_BY_SLICES * n:
            # a slice per item, joined in one copy: cheaper than a token index unless items are tiny
            return np.concatenate([self.tokens[a : a + m] for a, m in zip(self.starts.tolist(), self.lengths.tolist())])
        idx = np.repeat(self.starts - (np.cumsum(self.lengths) - self.lengths), self.lengths) + np.arange(total)
        return self.tokens[idx]

    def compact(self, into: np.ndarray | None = None) -> Block:
        """The same items over a fresh contiguous buffer (``into``, ``n_tokens`` long, when given)
        and a segment table of their own: frees the source buffers; what a worker sends."""
        if into is None:
            tokens = np.array(self.gather_tokens(), copy=True)
        else:
            tokens = into
            np.copyto(tokens, self.gather_tokens())
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64) if len(self) else self.starts
        out = replace(self, tokens=tokens, starts=starts)
        if self.seg_lo is not None:
            counts, src = self.segments()
            out.set_segments(
                np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                self.seg_starts[src],
                self.seg_ids[src],
                None if self.seg_lens is None else self.seg_lens[src],
            )
        return out


def rebase(block: Block, first_shard: int) -> Block:
    """The block with every id moved by ``first_shard`` shards (-1, no document, stays): items of a
    mixture source read with the source's own shard numbers, numbered as the mixture's."""
    if not first_shard:
        return block
    shift = np.int64(first_shard) << ID_SHIFT

    def moved(ids: np.ndarray | None) -> np.ndarray | None:
        return None if ids is None else np.where(ids >= 0, ids + shift, ids)

    return replace(
        block,
        ids=block.ids + shift,
        seg_ids=moved(block.seg_ids),
        doc_first=moved(block.doc_first),
        doc_next=moved(block.doc_next),
    )


#: mean tokens per item from which ``gather_tokens`` joins a slice per item rather than building
#: an index of every token (an int64 a token, written and read several times): at about 140 tokens
#: an item (wiki documents) slices take a fifth of the time for 600 items and 0.6 of it for 10,000
GATHER_BY_SLICES = 64


def row_view(tokens: np.ndarray, width: int) -> np.ndarray:
    """[len - width + 1, width] view of ``tokens`` whose row i starts at token i (no copy).

    Built with the ndarray constructor, not ``as_strided``, whose per-call cost is a noticeable
    part of gathering a batch of rows (docs/benchmarks.md)."""
    base = tokens if tokens.flags.c_contiguous else np.ascontiguousarray(tokens)
    step = base.itemsize
    return np.ndarray((max(0, len(base) - width + 1), width), base.dtype, buffer=base, strides=(step, step))


def same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two token arrays are the same memory viewed alike: blocks read in separate slices
    of one mapped shard each hold their own array over the one mapping."""
    if a is b:
        return True
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.strides == b.strides
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )


def concat_blocks(blocks: list[Block]) -> Block:
    """One block over the concatenated buffers of several (no copy when they share a buffer)."""
    if len(blocks) == 1:
        return blocks[0]
    lengths = np.concatenate([b.lengths for b in blocks])
    if all(same_buffer(b.tokens, blocks[0].tokens) for b in blocks):
        tokens = blocks[0].tokens
        starts = np.concatenate([b.starts for b in blocks])
    else:
        tokens = np.concatenate([b.gather_tokens() for b in blocks])
        starts = np.zeros(len(lengths), np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1], out=starts[1:])
    ids = np.concatenate([b.ids for b in blocks])
    pieces = None
    if any(b.pieces is not None for b in blocks):
        pieces = np.concatenate([b.pieces if b.pieces is not None else np.zeros(len(b), np.int64) for b in blocks])
    out = Block(tokens, starts, lengths, ids, pieces)
    if all(b.doc_first is not None for b in blocks):
        out.doc_first = np.concatenate([b.doc_first for b in blocks])
        out.doc_next = np.concatenate([b.doc_next for b in blocks])
        out.doc_count = np.concatenate([b.doc_count for b in blocks])
    if all(b.seg_lo is not None for b in blocks):
        # the blocks' segment tables, each once (slices of one block share it), end to end
        shift: dict[int, int] = {}
        tables: list[Block] = []
        for b in blocks:
            if id(b.seg_starts) not in shift:
                shift[id(b.seg_starts)] = sum(len(t.seg_starts) for t in tables)
                tables.append(b)
        out.seg_starts = tables[0].seg_starts if len(tables) == 1 else np.concatenate([t.seg_starts for t in tables])
        out.seg_ids = tables[0].seg_ids if len(tables) == 1 else np.concatenate([t.seg_ids for t in tables])
        if all(t.seg_lens is not None for t in tables):
            out.seg_lens = tables[0].seg_lens if len(tables) == 1 else np.concatenate([t.seg_lens for t in tables])
        out.seg_lo = np.concatenate([b.seg_lo + shift[id(b.seg_starts)] for b in blocks])
        out.seg_hi = np.concatenate([b.seg_hi + shift[id(b.seg_starts)] for b in blocks])
    return out


def join_rows(block: Block, j: int) -> Block:
    """Rows of a GPT-style stream (consecutive stretches of it, in order) joined ``j`` at a time
    into rows ``j`` times as long (the last one of what is left where ``j`` does not divide them):
    the rows cutting the same stream at the longer length would give. A document that ran on from
    one row into the next is one segment of the joined row."""
    n = len(block)
    if j <= 1 or n == 0:
        return block
    tokens = block.gather_tokens()
    group = np.arange(n, dtype=np.int64) // j
    firsts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    lengths = np.add.reduceat(block.lengths, firsts).astype(np.int64)
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    out = Block(tokens, starts, lengths, block.ids[firsts].copy())
    if block.seg_lo is not None:
        _join_segments(block, out, group, firsts)
    return out


def _join_segments(block: Block, out: Block, group: np.ndarray, firsts: np.ndarray) -> None:
    """The joined rows' segment table: each row's segments moved by the tokens before it in its
    joined row, less a segment that continues the one before it (same document, at a row start)."""
    counts, src = block.segments()
    before = block.lengths.cumsum() - block.lengths
    offset = before - before[firsts][group]  # tokens before each row within its joined row
    row_of = np.repeat(np.arange(len(block)), counts)
    starts = block.seg_starts[src] + offset[row_of]
    ids = block.seg_ids[src]
    lens = None if block.seg_lens is None else block.seg_lens[src].copy()
    joined = group[row_of]
    runs_on = np.r_[False, (block.seg_starts[src][1:] == 0) & (ids[1:] == ids[:-1]) & (joined[1:] == joined[:-1])]
    if lens is not None and runs_on.any():
        keep_index = np.cumsum(~runs_on) - 1
        lens = np.bincount(keep_index, weights=lens).astype(lens.dtype)
    keep = ~runs_on
    per_row = np.bincount(joined[keep], minlength=len(firsts))
    ptr = np.zeros(len(firsts) + 1, np.int64)
    np.cumsum(per_row, out=ptr[1:])
    out.set_segments(ptr, starts[keep], ids[keep], lens)


def windows(blocks: Iterable[Block], size: int) -> Iterator[Block]:
    """Consecutive windows of exactly ``size`` items over a stream of blocks (the last may be
    shorter): what shuffle buffers and bucketing/packing windows are cut from."""
    pending: list[Block] = []
    have = 0
    for block in blocks:
        while len(block):
            take = min(size - have, len(block))
            pending.append(block.slice(0, take) if take < len(block) else block)
            block = block.slice(take, len(block)) if take < len(block) else block.slice(0, 0)
            have += take
            if have == size:
                yield concat_blocks(pending)
                pending, have = [], 0
    if have:
        yield concat_blocks(pending)


def empty_block(dtype: np.dtype, packed: bool = False) -> Block:
    z = np.zeros(0, np.int64)
    b = Block(np.zeros(0, dtype), z, z, z)
    if packed:
        b.set_segments(np.zeros(1, np.int64), z, z)
    return b


def pieces_per_doc(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Items each document becomes when split at ``max_len`` tokens."""
    return (lengths + max_len - 1) // max_len
