"""Concatenation: the documents in stream order cut into rows of ``seq_len`` (GPT-style)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ConfigError
from ..block import Block, concat_blocks
from .protocol import COUNT_BY_TOKENS, Hint, ItemLengths, as_item_lengths, batches_of
from .rows import row_batches, rows_lower_bound

if TYPE_CHECKING:
    from ..stream import StreamSpec


class ConcatBatcher:
    """Documents concatenated in stream order and cut into rows of ``seq_len`` (GPT-style)."""

    needs_lengths = True
    count_by = COUNT_BY_TOKENS

    def __init__(self, seq_len: int, batch_size: int, drop_last: bool = False, whole_rows: bool = False):
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.drop_last = drop_last
        #: only rows of seq_len: the short row the stream's last tokens make is left out
        self.whole_rows = whole_rows

    def rows(self, tokens: int) -> int:
        """Rows ``tokens`` tokens make (the last one short, unless ``whole_rows`` leaves it out)."""
        return tokens // self.seq_len if self.whole_rows else -(-tokens // self.seq_len)

    def count(self, n_items: int, lengths: np.ndarray | ItemLengths | None) -> int:
        if lengths is None:
            raise ConfigError("concat batch counts need the documents' lengths (an index)")
        return batches_of(self.rows(as_item_lengths(lengths).total()), self.batch_size, self.drop_last)

    def handing(self) -> ConcatBatcher:
        return ConcatBatcher(self.seq_len, self.batch_size, drop_last=True, whole_rows=True)

    def tail(self, lengths: np.ndarray, spec: StreamSpec) -> tuple[np.ndarray, int]:
        """The tokens after the last full batch: from inside the item that batch's last row cuts."""
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if len(ends) else 0
        span = self.batch_size * self.seq_len
        used = total // span * span
        if used == total:
            return np.zeros(0, np.int64), 0
        first = int(np.searchsorted(ends, used, side="right"))
        return np.arange(first, len(lengths), dtype=np.int64), used - int(ends[first - 1] if first else 0)

    def lower_bound(self, items: np.ndarray, tokens: np.ndarray | None, longest: int) -> np.ndarray:
        """A row holds at most seq_len tokens."""
        return rows_lower_bound(items, tokens, self.seq_len, self.batch_size, self.drop_last)

    def start_position(self, batch: int, lengths: np.ndarray | None, hint: dict | None = None) -> int:
        if hint is not None:
            return hint["i"]
        if batch == 0 or lengths is None:
            return 0
        offset = batch * self.batch_size * self.seq_len
        return int(np.searchsorted(np.cumsum(lengths), offset, side="right"))

    def dry_batches(self, lengths: np.ndarray, spec: StreamSpec) -> Iterator[np.ndarray]:
        """Items each batch's rows touch; an item that runs across batches is in each of them."""
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if len(ends) else 0
        span = self.batch_size * self.seq_len
        rows = self.rows(total)  # the last row may be short: it still counts as a row
        for a in range(0, total, span):
            b = min(total, a + span)
            if self.drop_last and rows - a // self.seq_len < self.batch_size:
                return
            first = int(np.searchsorted(ends, a, side="right"))
            last = int(np.searchsorted(ends, b - 1, side="right"))
            yield np.arange(first, last + 1)

    def batches(
        self,
        shuffled: Iterable[tuple[int, Block]],
        first_batch: int,
        spec: StreamSpec,
        lengths: np.ndarray | None = None,
        hint: Hint | None = None,
    ) -> Iterator[tuple[int, Block, None]]:
        L, b = self.seq_len, self.batch_size
        lead = 0  # tokens of the first item already used by earlier rows
        skip_rows = first_batch * b
        if hint is not None:
            lead, skip_rows = hint["lead"], 0
        elif first_batch and lengths is not None:
            start = self.start_position(first_batch, lengths)
            lead = first_batch * b * L - (int(lengths[:start].sum()) if start else 0)
            skip_rows = 0
        spans = _Spans(lead)
        rows_stream = ((0, rows) for rows in _concat_rows(spans.wrap(shuffled), L, lead, not self.whole_rows))
        for index, block, _ in row_batches(rows_stream, b, first_batch, skip_rows, self.drop_last):
            yield index, block, spans.at(((index + 1 - first_batch) * b + skip_rows) * L)


class _Spans:
    """Shuffled positions and token ends of the items a concat stream passed (the last few
    blocks): which item holds the stream's token ``t``, and how much of it comes before, is
    the hint ``{"i", "lead"}`` from which the next row is cut again."""

    #: blocks kept: a batch's rows reach back over fewer blocks of the stream than this
    KEEP = 64

    def __init__(self, lead: int):
        self.lead = lead  # tokens of the first item before the stream's first row
        self.end = 0  # tokens passed, counted from the first item's first token
        self.position = 0  # the shuffled position after the last item passed
        #: (first position, first token, one past the last token, each item's end token)
        self._blocks: list[tuple[int, int, int, np.ndarray]] = []

    def wrap(self, shuffled: Iterable[tuple[int, Block]]) -> Iterator[tuple[int, Block]]:
        for position, block in shuffled:
            ends = self.end + np.cumsum(block.lengths)
            last = int(ends[-1]) if len(ends) else self.end
            self._blocks.append((position, self.end, last, ends))
            if len(self._blocks) > self.KEEP:
                del self._blocks[0]
            self.end = last
            self.position = position + len(block)
            yield position, block

    def at(self, tokens: int) -> dict:
        """The hint of the row that starts ``tokens`` tokens after the stream's first row (asked
        for every batch: the last blocks are searched first, with the arrays' own methods)."""
        t = tokens + self.lead
        for position, first, last, ends in reversed(self._blocks):
            if first <= t < last:
                i = int(ends.searchsorted(t, "right"))
                return {"i": position + i, "lead": t - (int(ends[i - 1]) if i else first)}
        return {"i": self.position, "lead": 0}  # at (or past) the end of what was passed


def _concat_rows(
    shuffled: Iterable[tuple[int, Block]], seq_len: int, lead: int, short_row: bool = True
) -> Iterator[Block]:
    """Rows of ``seq_len`` over the concatenated items; a row's segments are the pieces of
    items it holds. ``lead`` tokens of the first item belong to rows before the stream start;
    ``short_row``: the last tokens make a short row (else they are left out)."""
    carry: Block | None = None
    for _, block in shuffled:
        if lead:
            block = Block(block.tokens, block.starts.copy(), block.lengths.copy(), block.ids, block.pieces)
            block.starts[0] += lead
            block.lengths[0] -= lead
            lead = 0
        if carry is not None:
            block = concat_blocks([carry, block])
        total = int(block.lengths.sum())
        n_rows = total // seq_len
        if n_rows == 0:
            carry = block
            continue
        rows, carry = _cut_rows(block, seq_len, n_rows)
        yield rows
    if carry is not None and len(carry) and short_row:
        rows, _ = _cut_rows(carry, seq_len, 1)
        yield rows


def _sorted_unique(merged: np.ndarray) -> np.ndarray:
    """``np.unique`` of two sorted runs joined: a stable sort merges them in one pass (timsort),
    where ``np.unique`` hashes or sorts from scratch."""
    merged.sort(kind="stable")
    keep = np.empty(len(merged), bool)
    keep[:1] = True
    np.not_equal(merged[1:], merged[:-1], out=keep[1:])
    return merged[keep]


def _cut_rows(block: Block, seq_len: int, n_rows: int) -> tuple[Block, Block | None]:
    """The first ``n_rows`` rows of the block's concatenated tokens, and the rest as a block."""
    ends = np.cumsum(block.lengths)
    starts = ends - block.lengths
    limit = min(n_rows * seq_len, int(ends[-1]))
    # segments: every item piece that falls inside a row
    row_edges = np.arange(0, limit, seq_len)
    cuts = _sorted_unique(np.concatenate([starts[starts < limit], row_edges]))
    item_of = np.searchsorted(ends, cuts, side="right")
    seg_end = np.minimum(np.append(cuts[1:], limit), ends[item_of])
    seg_len = seg_end - cuts
    keep = seg_len > 0
    cuts, item_of, seg_len = cuts[keep], item_of[keep], seg_len[keep]
    tokens = block.gather_tokens()
    row_of = cuts // seq_len
    counts = np.bincount(row_of, minlength=(limit + seq_len - 1) // seq_len)
    n = len(counts)
    row_len = np.minimum(seq_len, limit - np.arange(n) * seq_len)
    rows = Block(
        tokens[:limit], np.arange(n, dtype=np.int64) * seq_len, row_len.astype(np.int64), np.zeros(n, np.int64)
    )
    rows.set_segments(
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        (cuts - row_of * seq_len).astype(np.int64),
        block.ids[item_of],
        seg_len.astype(np.int64),
    )
    rest = None
    if limit < int(ends[-1]):
        i = int(np.searchsorted(ends, limit, side="right"))
        rest = block.slice(i, len(block))
        used = limit - int(starts[i])
        if used:
            rest = Block(rest.tokens, rest.starts.copy(), rest.lengths.copy(), rest.ids, rest.pieces)
            rest.starts[0] += used
            rest.lengths[0] -= used
    return rows, rest
