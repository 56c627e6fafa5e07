"""Compact batches to tensors: padding, attention masks, labels, document boundaries.

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids`` and the model
shifts it (position t predicts labels[t+1]). -100 marks what must not be predicted: padding, and
with ``boundaries`` the first token of each document in a packed row, which would otherwise be
predicted from the end of the previous document. With next-token labels (``shift_labels=True``)
the batch carries ``shift_labels`` instead, ``shift_labels[t] = labels[t + 1]``: a row of rows mode
is read with one token more than it hands out (``Config.row_len``), whose last token is only a
label, so every position has its label; a padded document's last position predicts nothing.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ConfigError
from .block import Block, row_view

if TYPE_CHECKING:
    from .config import Config
    from .sources.protocol import Source

IGNORE_INDEX = -100
#: the Hugging Face names of ``cu_seqlens`` and ``max_seqlen`` (padding-free packing, transformers >= 4.47)
HF_CU_SEQ_LENS = ("cu_seq_lens_q", "cu_seq_lens_k")
HF_MAX_LENGTH = ("max_length_q", "max_length_k")
_NP_DTYPES = {torch.long: np.int64, torch.int32: np.int32}


@dataclass(frozen=True)
class CollateOptions:
    pad_id: int = 0
    pad_to_multiple_of: int | None = None
    boundaries: bool = False  # packed rows: position_ids, cu_seqlens, labels masked at doc starts
    seq_len: int | None = None  # packed rows: the fixed row length
    max_segments: int | None = None  # packed rows: segments per row that cu_seqlens is padded to
    dtype: torch.dtype = torch.long
    docs: bool = True  # a `docs` tensor: the identity of every document (docs) or of a row's documents (rows)
    mixing: Any = None  # a mixture's mixplan.Mixing: a `sources` tensor aligned with `docs`
    rows: bool = False  # batches are rows of a fixed length (collate_rows), else documents
    next_token: bool = False  # ``shift_labels`` in place of ``labels``; rows hand out seq_len - 1 positions

    @property
    def width(self) -> int | None:
        """Positions of a row of rows mode as handed out: the row, less the token that is only a label."""
        return self.seq_len - 1 if self.next_token and self.seq_len else self.seq_len

    @classmethod
    def for_config(cls, cfg: Config, catalog: Source) -> CollateOptions:
        """What the loader settings and the dataset ask of collation."""
        tok = catalog.index.tokenizer if catalog.index else None
        pad = cfg.pad_id
        if pad is None:
            pad = (
                tok.pad_id if tok and tok.pad_id is not None else (tok.eos_id if tok and tok.eos_id is not None else 0)
            )
        mode = cfg.mode
        seq_len = cfg.row_len if mode.rows else (catalog.index.seq_len if catalog.index else None)
        max_seg = cfg.max_segments
        if max_seg is None:
            if catalog.mode == "packed" and catalog.index is not None:
                max_seg = (catalog.index.packed or {}).get("max_row_segments") or None
            elif mode.rows:
                max_seg = seq_len  # every document has at least one token: a safe fixed bound
        return cls(
            pad_id=pad,
            pad_to_multiple_of=cfg.pad_to_multiple_of,
            boundaries=cfg.boundaries or mode.boundaries,
            seq_len=seq_len,
            max_segments=max_seg,
            docs=cfg.docs,
            mixing=catalog.mixing,
            rows=cfg.rows_out(catalog),
            next_token=cfg.shift_labels,
        )


class BufferPool:
    """Reuses the memory of output arrays that nothing references any more.

    A batch's tensors are megabytes; a fresh allocation of that size is fresh pages from the
    kernel, and faulting them in costs more than filling them (docs-mode batches: about a third
    of the loader's time). A pooled buffer is reused only when its reference count shows that no
    tensor, view or array outside the pool still holds it, so a batch the caller keeps is never
    overwritten. Capacities are powers of two so that batches of varying width share buffers.
    """

    def __init__(self, keep: int = 12):
        self.keep = keep
        self.buffers: list[np.ndarray] = []
        self.lock = threading.Lock()
        # The reference count of a buffer only the pool holds, measured with the very expression
        # that _unused uses (so interpreter details cannot make it wrong).
        self.buffers.append(np.empty(1))
        self.baseline = self._refs(0)
        self.buffers.clear()

    def _refs(self, i: int) -> int:
        return sys.getrefcount(self.buffers[i])

    def _unused(self, i: int) -> bool:
        return self._refs(i) == self.baseline

    def take(self, n: int, dtype: np.dtype | type) -> np.ndarray:
        dtype = np.dtype(dtype)
        with self.lock:
            for i in range(len(self.buffers)):
                if self.buffers[i].dtype == dtype and self.buffers[i].size >= n and self._unused(i):
                    return self.buffers[i][:n]
            self.buffers.append(np.empty(1 << max(12, (n - 1).bit_length()), dtype))
            if len(self.buffers) > self.keep:
                # forget the oldest buffer not in use (those in use are freed by their holders)
                unused = [i for i in range(len(self.buffers) - 1) if self._unused(i)]
                del self.buffers[unused[0] if unused else 0]
            return self.buffers[-1][:n]


_pool = BufferPool()


def _filled(shape: tuple[int, int], value: int, dtype: torch.dtype) -> np.ndarray:
    """An array of ``value``s in pooled memory. numpy's single-threaded fill beats torch.full
    here: the main process shares the cores with the DataLoader workers, and torch's parallel
    fill loses badly to that contention."""
    arr = _pool.take(shape[0] * shape[1], _NP_DTYPES[dtype]).reshape(shape)
    arr.fill(value)
    return arr


def _left_aligned(items: Block, lengths: np.ndarray, width: int, opts: CollateOptions) -> tuple:
    """``input_ids`` and ``labels`` of the items, each left-aligned in a row of ``width`` and
    padded after it, and the mask of the real tokens (numpy, in pooled memory). The tokens are
    written through the mask, once per array: no scatter over a position array."""
    n = len(lengths)
    real = _pool.take(n * width, np.bool_).reshape(n, width)
    np.less(np.arange(width), lengths[:, None], out=real)
    input_ids = _filled((n, width), opts.pad_id, opts.dtype)
    input_ids[real] = items.gather_tokens()
    labels = _filled((n, width), IGNORE_INDEX, opts.dtype)
    np.copyto(labels, input_ids, where=real)
    return input_ids, labels, real


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else (n + multiple - 1) // multiple * multiple


def assemble(items: Block, epoch: int, opts: CollateOptions) -> dict:
    """A batch as a training step takes it: the collated tensors and the data epoch the batch
    belongs to. The one place a batch dict is made."""
    out = collate_rows(items, opts) if opts.rows else collate_docs(items, opts)
    if opts.next_token:
        out = next_token_labels(out, opts)
    out["epoch"] = epoch
    return out


def next_token_labels(out: dict, opts: CollateOptions) -> dict:
    """``labels`` as ``shift_labels``, what each position predicts; a row of rows mode loses the
    position of its last token, which is only the label of the one before it (its boundaries were
    made for the shorter row: ``collate_rows``)."""
    labels = out.pop("labels")
    if opts.rows:
        width = opts.width
        out["input_ids"] = out["input_ids"][:, :width].contiguous()
        out["shift_labels"] = labels[:, 1:].contiguous()
        out["lengths"] = out["lengths"].clamp(max=width)
        return out
    shift = torch.full_like(labels, IGNORE_INDEX)
    shift[:, :-1] = labels[:, 1:]
    out["shift_labels"] = shift
    return out


def collate_docs(items: Block, opts: CollateOptions) -> dict:
    """Documents padded to the longest in the batch: input_ids, attention_mask, labels, lengths, docs.

    Each tensor is written in one or two passes over the padded size (a fill, then the real tokens
    through their mask), with no position array: the rest is proportional to the tokens.
    """
    lengths = items.lengths.astype(np.int64, copy=False)
    n = len(lengths)
    width = _round_up(int(lengths.max()) if n else 0, opts.pad_to_multiple_of)
    input_ids, labels, real = _left_aligned(items, lengths, width, opts)
    attention_mask = _pool.take(n * width, _NP_DTYPES[opts.dtype]).reshape(n, width)
    np.copyto(attention_mask, real)
    out = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "labels": torch.from_numpy(labels),
        "lengths": torch.from_numpy(lengths.copy()),
    }
    if opts.docs:
        pieces = items.pieces if items.pieces is not None else np.zeros(n, np.int64)
        out["docs"] = torch.from_numpy(np.stack([items.ids, pieces], axis=1).astype(np.int64))
    if opts.mixing is not None:
        out["sources"] = torch.from_numpy(opts.mixing.sources_of_ids(items.ids).astype(np.int64))
    return out


def collate_rows(items: Block, opts: CollateOptions) -> dict:
    """Packed rows of ``seq_len``: input_ids, labels, lengths (tokens per row: seq_len but for a
    short tail row), rows, docs; with ``boundaries`` also position_ids, cu_seqlens, max_seqlen
    (and the same as cu_seq_lens_q/k, max_length_q/k, the names Hugging Face models read).

    No attention_mask: rows hold no padding but after a short tail row's tokens, which causal
    attention never lets a real token see, and whose labels are -100. Leaving it out saves a
    third of the bytes a batch writes."""
    seq_len = opts.seq_len
    n = len(items)
    lengths = items.lengths
    full = bool(n and lengths.min() == seq_len)
    if full:
        # whole rows: gathered from the buffer and widened to int64 in one pass into pooled memory
        out_ids = _pool.take(n * seq_len, _NP_DTYPES[opts.dtype]).reshape(n, seq_len)
        np.copyto(out_ids, row_view(items.tokens, seq_len)[items.starts], casting="unsafe")
        input_ids = torch.from_numpy(out_ids)
        # Nothing to mask: labels are the same values, so they share input_ids' storage (as the
        # x/y views of one buffer in nanoGPT-style loaders). Boundary masking below copies first.
        labels = input_ids
    else:
        ids, labels, _ = _left_aligned(items, lengths.astype(np.int64), seq_len, opts)
        input_ids, labels = torch.from_numpy(ids), torch.from_numpy(labels)
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "lengths": torch.from_numpy(lengths.astype(np.int64)),
        "rows": torch.from_numpy(items.ids.astype(np.int64)),
    }
    if opts.docs or opts.mixing is not None:
        docs = row_docs(items)
        if opts.docs:
            out["docs"] = torch.from_numpy(docs)
        if opts.mixing is not None:  # [B, D] like docs, -1 past a row's last document
            out["sources"] = torch.from_numpy(opts.mixing.sources_of_ids(docs).astype(np.int64))
    if opts.boundaries:
        seg_counts, src = items.segments()  # the batch's segments in row order
        row_of_seg = np.repeat(np.arange(n), seg_counts)
        starts = items.seg_starts[src]
        doc_first = starts > 0  # a segment at a row's start continues or starts unseen context; label 0 is never used
        if labels is input_ids:
            labels = labels.clone()
            out["labels"] = labels
        labels[row_of_seg[doc_first], torch.from_numpy(starts[doc_first].astype(np.int64))] = IGNORE_INDEX
        out.update(_row_boundaries(starts, row_of_seg, n, opts, lengths))
    return out


def _row_boundaries(starts: np.ndarray, row_of_seg: np.ndarray, n: int, opts: CollateOptions, lengths) -> dict:
    """The boundaries of the rows as handed out (``opts.width`` positions: a segment that starts
    at a next-token row's last token is only a label)."""
    width = opts.width
    if width != opts.seq_len:
        keep = starts < width
        starts, row_of_seg, lengths = starts[keep], row_of_seg[keep], np.minimum(lengths, width)
    most = int(np.bincount(row_of_seg, minlength=n).max()) if n else 1
    max_seg = opts.max_segments or most
    if most > max_seg:
        raise ConfigError(f"a row holds {most} documents, more than max_segments={max_seg}; raise max_segments")
    return _boundaries(starts, row_of_seg, n, width, max_seg, lengths)


def row_docs(items: Block) -> np.ndarray:
    """docs[i, j]: the j-th document of row i, -1 past the row's last (metadata, not a model
    input: as wide as this batch needs)."""
    n = len(items)
    if items.doc_first is not None:
        # rows of a packed dataset: the first document, then the ones after it in shard order
        counts = items.doc_count
        slot = np.arange(int(counts.max()) if n else 1)
        docs = np.where(slot < counts[:, None], items.doc_next[:, None] + (slot - 1), -1)
        docs[:, 0] = items.doc_first
        return docs
    counts = items.seg_hi - items.seg_lo
    slot = np.arange(int(counts.max()) if n else 1)
    table = items.seg_lo[:, None] + slot
    np.minimum(table, len(items.seg_ids) - 1, out=table)
    docs = items.seg_ids.take(table)
    docs[slot >= counts[:, None]] = -1
    return docs


def _boundaries(seg_starts: np.ndarray, row_of_seg, n: int, seq_len: int, max_seg: int, lengths) -> dict:
    """position_ids restarting at every segment, and flat cu_seqlens padded to a fixed length.

    Segments are the documents of each row, and the padding of a short tail row as one more
    segment, so that cu_seqlens covers every token and position_ids agree with it everywhere.
    """
    flat_starts = row_of_seg * seq_len + seg_starts.astype(np.int64)
    tails = np.nonzero(lengths < seq_len)[0]
    bounds = np.concatenate([flat_starts, tails * seq_len + lengths[tails], [n * seq_len]]).astype(np.int64)
    bounds = np.unique(bounds)
    seg_lengths = np.diff(bounds)
    positions = np.arange(n * seq_len, dtype=np.int64) - np.repeat(bounds[:-1], seg_lengths)
    # fixed length: every row's segments plus one padding segment per row, so shapes never change
    cu = torch.from_numpy(np.full(n * (max_seg + 1) + 1, n * seq_len, np.int32))
    cu[: len(bounds)] = torch.from_numpy(bounds.astype(np.int32))
    longest = int(seg_lengths.max()) if len(seg_lengths) else 0
    # Hugging Face models read the same two facts under their own names (FlashAttention's varlen
    # path; sdpa/eager find the documents from position_ids): one tensor, several keys.
    return {
        "position_ids": torch.from_numpy(positions.reshape(n, seq_len)),
        "cu_seqlens": cu,
        "max_seqlen": longest,
        **dict.fromkeys(HF_CU_SEQ_LENS, cu),
        **dict.fromkeys(HF_MAX_LENGTH, longest),
    }
