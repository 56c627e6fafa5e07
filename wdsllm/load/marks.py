"""Where a worker's plan stream stands in documents, for a resume of raw text without counts.

Positions are counted in items, and where documents are split at max_len an item is a piece of
one, so a plan position says nothing of documents until the lengths are known. Raw text without
a count sidecar has no lengths: a resume would have to tokenize everything before its position to
count the pieces again. So a worker notes, as its plan stream goes by, how many documents began
before each recent position and which piece of its document the item there is; the state saves
that *mark* ``[documents, pieces]`` with the position (the hint's ``"at"``), and a resume passes
over the documents by parsing only (the readers' ``skip``) and drops the pieces, never
tokenizing what came before.

The read blocks hold all pieces of a document (splitting happens in a block), so a position at
the end of what was read starts a document.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from .block import Block

#: the hint key of a mark
MARK_KEY = "at"


class DocMarks:
    """Documents begun before the recent plan positions of one stream (``wrap`` it), from
    ``start`` (where ``mark`` says the stream starts), keeping blocks back to ``keep`` items."""

    def __init__(self, start: int, mark: tuple[int, int] | None, keep: int):
        docs, pieces = mark or (start, 0)
        self.end = start
        self.begun = docs + (1 if pieces else 0)  # documents begun before ``end``
        self.keep = keep
        self._blocks: deque[tuple[int, int, np.ndarray, np.ndarray]] = deque()

    def wrap(self, blocks: Iterable[Block]) -> Iterator[Block]:
        """``blocks`` (the plan stream from ``start``), noting each one as it goes by."""
        for block in blocks:
            pieces = np.zeros(len(block), np.int64) if block.pieces is None else block.pieces
            starts = np.cumsum(pieces == 0) - (pieces == 0)  # documents begun before each item
            self._blocks.append((self.end, self.begun, starts, pieces))
            self.end += len(block)
            self.begun += int(np.count_nonzero(pieces == 0))
            while self._blocks and self._blocks[0][0] + len(self._blocks[0][2]) < self.end - self.keep:
                self._blocks.popleft()
            yield block

    def mark(self, position: int) -> list[int] | None:
        """``[documents to pass, pieces of the next one to drop]`` to reach plan ``position``
        (None: not among the blocks kept, or not read yet)."""
        if position == self.end:
            return [self.begun, 0]
        for first, begun, starts, pieces in self._blocks:
            if first <= position < first + len(starts):
                i = position - first
                piece = int(pieces[i])
                docs = begun + int(starts[i])
                return [docs - 1, piece] if piece else [docs, 0]
        return None


def parse_mark(hint: dict | None) -> tuple[int, int] | None:
    """The mark of a hint (checked when the state was loaded), or None."""
    if not hint or MARK_KEY not in hint:
        return None
    docs, pieces = hint[MARK_KEY]
    return int(docs), int(pieces)


def batcher_hint(hint: dict | None) -> dict | None:
    """A hint without its mark: what the batcher wrote."""
    if not hint or MARK_KEY not in hint:
        return hint
    rest = {k: v for k, v in hint.items() if k != MARK_KEY}
    return rest or None


class TaskMarks:
    """The marks of one worker task's stream: where it starts (its hint's mark), and each batch's
    hint with the mark of the plan position the batch after it starts from (``Batcher``'s
    ``start_position``, at the start of its shuffle block of ``size`` items)."""

    def __init__(self, hint: dict | None, batcher, size: int, keep: int):
        self.start = parse_mark(hint)
        self.batcher = batcher
        self.size = size
        self.keep = keep
        self.notes: DocMarks | None = None

    def wrap(self, position: int, blocks: Iterable[Block]) -> Iterator[Block]:
        """The plan stream from ``position`` (the task's start), noted."""
        self.notes = DocMarks(position, self.start, self.keep)
        return self.notes.wrap(blocks)

    def hint(self, following: int, hint: dict | None) -> dict | None:
        """``hint`` (the batcher's, for batch ``following``) with the mark of where it starts."""
        if self.notes is None:
            return hint
        position = self.batcher.start_position(following, None, hint)
        if self.size > 1:
            position = position // self.size * self.size
        mark = self.notes.mark(position)
        return hint if mark is None else {**(hint or {}), MARK_KEY: mark}
