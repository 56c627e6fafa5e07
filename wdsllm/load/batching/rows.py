"""Batches of rows that run across windows: what the row-making modes (pack, concat) share."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from ..block import Block, concat_blocks


def row_batches(
    rows_stream: Iterable[tuple[int, Block]], b: int, first_batch: int, skip_rows: int, drop_last: bool
) -> Iterator[tuple[int, Block, dict]]:
    """Batches of ``b`` rows over a stream of (window, rows); rows run across windows. The hint
    after a batch is (window, rows of it already used) of the next row."""
    index = first_batch
    queue: list[tuple[int, int, Block]] = []  # (window, first row's offset in it, rows)
    have = 0
    last_window = -1
    for w, rows in rows_stream:
        last_window = w
        offset = 0
        if skip_rows:
            take = min(skip_rows, len(rows))
            skip_rows -= take
            offset = take
            rows = rows.slice(take, len(rows))
        if len(rows):
            queue.append((w, offset, rows))
            have += len(rows)
        while have >= b:
            parts, need = [], b
            while need:
                qw, qoff, qrows = queue[0]
                take = min(need, len(qrows))
                parts.append(qrows.slice(0, take))
                if take == len(qrows):
                    queue.pop(0)
                else:
                    queue[0] = (qw, qoff + take, qrows.slice(take, len(qrows)))
                need -= take
            have -= b
            after = {"w": queue[0][0], "skip": queue[0][1]} if queue else {"w": w + 1, "skip": 0}
            yield index, concat_blocks(parts) if len(parts) > 1 else parts[0], after
            index += 1
    if have and not drop_last:
        yield index, concat_blocks([q[2] for q in queue]), {"w": last_window + 1, "skip": 0}


def rows_lower_bound(
    items: np.ndarray, tokens: np.ndarray | None, seq_len: int, batch_size: int, drop_last: bool
) -> np.ndarray:
    """Batches of rows of at most ``seq_len`` tokens that ``tokens`` (unknown: ``items``, one
    token each at least) fill at least."""
    have = np.asarray(tokens if tokens is not None else items, np.int64)
    rows = -(-have // seq_len)
    return (rows // batch_size if drop_last else -(-rows // batch_size)).astype(np.int64)
