"""Documents to tar samples: whole documents (split when over-long) or fixed-length packed rows.

Both shapers consume encoded chunks in input order and emit *groups*: the content of one tar
sample. After every group they can say where the input stands (``Position``), which is what
``--resume`` restarts from. Output depends only on the document sequence, never on how the
documents were chunked or how many workers encoded them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class EncodedChunk:
    """What a tokenizer worker returns for one RawChunk."""

    file_index: int
    first_line: int
    tokens: np.ndarray  # all documents' ids concatenated, specials included
    lengths: np.ndarray  # int64, one per document
    lines: np.ndarray  # int64, 1-based line of each document
    skips: list = field(default_factory=list)  # sources.Skip records (bad input, listed)
    raw_offset: int = 0
    text_bytes: int = 0
    tallies: dict = field(default_factory=dict)  # unlisted skips: reason -> int64 array of lines
    keys: list | None = None  # tar inputs: each document's sample key


@dataclass(frozen=True)
class Position:
    """Everything up to and including this point of the input is in written groups.

    docs mode: the document at (file, line) has had pieces 0..piece written.
    packed mode: the document at (file, line) has had its first ``offset`` tokens written.
    """

    file: int
    line: int
    piece: int = 0
    offset: int = 0
    done: bool = True  # whether that document is complete (all pieces / all tokens written)

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line, "piece": self.piece, "offset": self.offset, "done": self.done}

    @classmethod
    def from_json(cls, d: dict) -> Position:
        return cls(d["file"], d["line"], d.get("piece", 0), d.get("offset", 0), d.get("done", True))


@dataclass
class GroupData:
    tokens: np.ndarray
    files: np.ndarray  # provenance of each document (docs mode) / document start (packed)
    lines: np.ndarray
    pieces: np.ndarray
    lengths: np.ndarray | None = None  # docs mode: tokens per document
    starts: np.ndarray | None = None  # packed mode: offsets of document starts in tokens
    doc_lengths: np.ndarray | None = None  # full token length of each document that starts here
    rows: int = 0
    position: Position | None = None
    keys: np.ndarray | None = None  # object array: each document's source key (tar inputs), else None

    @property
    def documents(self) -> int:
        return len(self.files)


def _keys_of(chunk: EncodedChunk) -> np.ndarray | None:
    if chunk.keys is None:
        return None
    keys = np.empty(len(chunk.keys), object)
    keys[:] = chunk.keys
    return keys


def concat_keys(parts: list[np.ndarray | None], lengths: list[int]) -> np.ndarray | None:
    """Source keys of concatenated parts (None where a part has none), or None if no part has any."""
    if all(p is None for p in parts):
        return None
    return np.concatenate([np.full(n, None, object) if p is None else p for p, n in zip(parts, lengths)])


@dataclass
class _Items:
    """A chunk's items: its documents, with each over-long one cut into pieces."""

    doc_of: np.ndarray  # the chunk's document each item comes from
    piece: np.ndarray  # the item's piece number within its document
    starts: np.ndarray  # the item's first token in the chunk's tokens
    lengths: np.ndarray  # the item's tokens
    last: np.ndarray  # whether the item is its document's last piece

    def where(self, keep: np.ndarray) -> _Items:
        return _Items(self.doc_of[keep], self.piece[keep], self.starts[keep], self.lengths[keep], self.last[keep])


def _split_items(lengths: np.ndarray, max_doc_tokens: int | None) -> _Items:
    """Expand documents longer than ``max_doc_tokens`` into pieces of at most that many tokens."""
    n = len(lengths)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if max_doc_tokens and lengths.max() > max_doc_tokens:
        m = max_doc_tokens
        counts = (lengths + m - 1) // m
        doc_of = np.repeat(np.arange(n), counts)
        piece = np.arange(len(doc_of)) - np.repeat(np.cumsum(counts) - counts, counts)
        return _Items(
            doc_of,
            piece,
            offsets[doc_of] + piece * m,
            np.minimum(m, lengths[doc_of] - piece * m),
            piece == counts[doc_of] - 1,
        )
    return _Items(np.arange(n), np.zeros(n, np.int64), offsets[:-1], lengths, np.ones(n, bool))


class DocGrouper:
    """docs mode: documents go whole into groups of about ``sample_tokens`` tokens.

    A document longer than ``max_doc_tokens`` becomes consecutive pieces (piece 0, 1, ...), each
    its own logical document; nothing is truncated. ``max_items`` caps the documents of a group,
    so that ``--shard-samples`` can be honoured with groups as the unit of a shard.
    """

    def __init__(
        self,
        sample_tokens: int,
        max_doc_tokens: int | None,
        dtype: np.dtype,
        resume: Position | None = None,
        max_items: int | None = None,
    ):
        self.sample_tokens = max(1, sample_tokens)
        self.max_doc_tokens = max_doc_tokens
        self.dtype = dtype
        self.resume = resume
        self.max_items = max_items
        self._parts: list[tuple] = []  # (tokens, lengths, files, lines, pieces, last_done, keys)
        self._tokens = 0
        self._items = 0

    def feed(self, chunk: EncodedChunk) -> list[GroupData]:
        lengths = chunk.lengths
        if len(lengths) == 0:
            return []
        items = _split_items(lengths, self.max_doc_tokens)
        keys = _keys_of(chunk)
        if self.resume is not None:
            items = self._after_resume(chunk, items)
            if items is None:
                return []
        if len(items.doc_of) == 0:
            return []
        return self._fill(chunk, items, keys)

    def _after_resume(self, chunk: EncodedChunk, items: _Items) -> _Items | None:
        """The items of ``chunk`` after the resume position (None if the chunk is wholly before it);
        the resume position is spent once a chunk reaches it."""
        r = self.resume
        if chunk.file_index < r.file:
            return None
        if chunk.file_index == r.file:
            lines = chunk.lines
            item_lines = lines[items.doc_of]
            keep = (item_lines > r.line) | ((item_lines == r.line) & (items.piece > r.piece))
            items = items.where(keep)
            if lines[-1] < r.line:
                return None
        self.resume = None
        return items

    def _fill(self, chunk: EncodedChunk, items: _Items, keys: np.ndarray | None) -> list[GroupData]:
        """Add ``items`` to the open group, emitting each group that fills."""
        doc_of, piece, item_lengths, last = items.doc_of, items.piece, items.lengths, items.last
        # Gather the items' tokens (contiguous unless a resume dropped a prefix: still contiguous).
        first, end = int(items.starts[0]), int(items.starts[-1] + item_lengths[-1])
        item_tokens = chunk.tokens[first:end]
        files = np.full(len(doc_of), chunk.file_index, np.int64)
        item_lines = chunk.lines[doc_of]
        item_keys = keys[doc_of] if keys is not None else None
        groups: list[GroupData] = []
        cum = np.cumsum(item_lengths)
        base = 0  # items consumed from this chunk
        tok_base = 0
        while base < len(item_lengths):
            take = self._room_for(cum, base, tok_base)
            if take <= 0:
                if not self._parts:
                    take = 1
                else:
                    groups.append(self._emit())
                    continue
            stop = base + take
            tok_stop = int(cum[stop - 1])
            self._parts.append(
                (
                    item_tokens[tok_base:tok_stop],
                    item_lengths[base:stop],
                    files[base:stop],
                    item_lines[base:stop],
                    piece[base:stop],
                    bool(last[stop - 1]),
                    item_keys[base:stop] if item_keys is not None else None,
                )
            )
            self._tokens += tok_stop - tok_base
            self._items += take
            base, tok_base = stop, tok_stop
            if self._tokens >= self.sample_tokens or (self.max_items and self._items >= self.max_items):
                groups.append(self._emit())
        return groups

    def _room_for(self, cum: np.ndarray, base: int, tok_base: int) -> int:
        """How many next items fit in the open group's room (may be 0 or less)."""
        room = self.sample_tokens - self._tokens
        limit = tok_base + room
        take = int(np.searchsorted(cum, limit, side="right")) - base
        if self.max_items:
            take = min(take, self.max_items - self._items)
        return take

    def _emit(self) -> GroupData:
        parts = self._parts
        self._parts, self._tokens, self._items = [], 0, 0
        lengths = np.concatenate([p[1] for p in parts])
        files = np.concatenate([p[2] for p in parts])
        lines = np.concatenate([p[3] for p in parts])
        pieces = np.concatenate([p[4] for p in parts])
        position = Position(int(files[-1]), int(lines[-1]), piece=int(pieces[-1]), done=parts[-1][5])
        keys = concat_keys([p[6] for p in parts], [len(p[1]) for p in parts])
        return GroupData(
            tokens=np.concatenate([p[0] for p in parts]).astype(self.dtype, copy=False),
            files=files,
            lines=lines,
            pieces=pieces,
            lengths=lengths,
            doc_lengths=lengths,
            position=position,
            keys=keys,
        )

    def finish(self) -> list[GroupData]:
        return [self._emit()] if self._parts else []


class RowPacker:
    """packed mode: documents concatenated and cut into rows of ``seq_len`` tokens.

    A group holds ``rows_per_group`` rows; the last group of the input may end with a short row
    (the tail), which is kept, never dropped. ``starts`` marks where each document begins.
    """

    def __init__(self, seq_len: int, rows_per_group: int, dtype: np.dtype, resume: Position | None = None):
        self.seq_len = seq_len
        self.group_tokens = seq_len * max(1, rows_per_group)
        self.dtype = dtype
        self.resume = resume
        self._buf: list[np.ndarray] = []
        self._n = 0  # tokens in the buffer
        # Documents overlapping the buffer: offset of their first token relative to the buffer
        # (negative when it was written in an earlier group), file, line, full length, source key.
        self._spans: list[tuple] = []

    def feed(self, chunk: EncodedChunk) -> list[GroupData]:
        tokens, lengths, lines = chunk.tokens, chunk.lengths, chunk.lines
        n = len(lengths)
        if n == 0:
            return []
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        first_doc, lead = 0, 0  # resume: first document to take, tokens of it already written
        r = self.resume
        if r is not None:
            if chunk.file_index < r.file:
                return []
            if chunk.file_index == r.file:
                if lines[-1] < r.line:
                    return []
                first_doc = int(np.searchsorted(lines, r.line, side="left"))
                if lines[first_doc] == r.line:
                    if r.done or r.offset >= lengths[first_doc]:
                        first_doc += 1
                    else:
                        lead = r.offset
            self.resume = None
            if first_doc >= n:
                return []
        drop = int(offsets[first_doc]) + lead
        keys = _keys_of(chunk)
        self._spans.append(
            (
                offsets[first_doc:-1] - drop + self._n,
                np.full(n - first_doc, chunk.file_index, np.int64),
                lines[first_doc:],
                lengths[first_doc:],
                keys[first_doc:] if keys is not None else None,
            )
        )
        data = tokens[drop:]
        self._buf.append(data)
        self._n += len(data)
        groups = []
        while self._n >= self.group_tokens:
            groups.append(self._emit(self.group_tokens))
        return groups

    def _emit(self, size: int) -> GroupData:
        buf = np.concatenate(self._buf) if len(self._buf) > 1 else self._buf[0]
        group_tokens, rest = buf[:size], buf[size:]
        self._buf = [rest] if len(rest) else []
        self._n = len(rest)
        offs, files, lines, lens = (np.concatenate(parts) for parts in list(zip(*self._spans))[:4])
        keys = concat_keys([span[4] for span in self._spans], [len(span[0]) for span in self._spans])
        new = (offs >= 0) & (offs < size)
        # The document covering the group's last token says where the input stands.
        last = int(np.searchsorted(offs, size - 1, side="right")) - 1
        written = size - int(offs[last])
        position = Position(int(files[last]), int(lines[last]), offset=written, done=written >= int(lens[last]))
        carry = offs + lens > size
        if carry.any():
            carried = None if keys is None else keys[carry]
            self._spans = [(offs[carry] - size, files[carry], lines[carry], lens[carry], carried)]
        else:
            self._spans = []
        return GroupData(
            tokens=group_tokens.astype(self.dtype, copy=False),
            files=files[new],
            lines=lines[new],
            pieces=np.zeros(int(new.sum()), np.int64),
            starts=offs[new],
            doc_lengths=lens[new],
            rows=(size + self.seq_len - 1) // self.seq_len,
            position=position,
            keys=None if keys is None else keys[new],
        )

    def finish(self) -> list[GroupData]:
        return [self._emit(self._n)] if self._n else []
