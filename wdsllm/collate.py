"""Compact batches to tensors: padding, attention masks, labels, document boundaries.

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids`` and the model
shifts it (position t predicts labels[t+1]). -100 marks what must not be predicted: padding, and
with ``boundaries`` the first token of each document in a packed row, which would otherwise be
predicted from the end of the previous document.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .items import Block

IGNORE_INDEX = -100
_NP_DTYPES = {torch.long: np.int64, torch.int32: np.int32}


@dataclass(frozen=True)
class CollateOptions:
    pad_id: int = 0
    pad_to_multiple_of: int | None = None
    boundaries: bool = False  # packed rows: position_ids, cu_seqlens, labels masked at doc starts
    seq_len: int | None = None  # packed rows: the fixed row length
    max_segments: int | None = None  # packed rows: segments per row that cu_seqlens/docs are padded to
    dtype: torch.dtype = torch.long


def _tokens_tensor(tokens: np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Token ids as an int64 (or int32) tensor; converted by numpy, single-threaded (see _filled)."""
    return torch.from_numpy(np.asarray(tokens).astype(_NP_DTYPES[dtype]))


def _filled(n: int, value: int, dtype: torch.dtype) -> torch.Tensor:
    """A new 1-D tensor of ``value``s. numpy's single-threaded fill (calloc for zeros) beats
    torch.full here: the main process shares the cores with the DataLoader workers, and torch's
    parallel fill loses badly to that contention."""
    np_dtype = _NP_DTYPES[dtype]
    arr = np.zeros(n, np_dtype) if value == 0 else np.full(n, value, np_dtype)
    return torch.from_numpy(arr)


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else (n + multiple - 1) // multiple * multiple


def _flat_positions(lengths: np.ndarray, width: int) -> torch.Tensor:
    """Positions in a row-major [n, width] array of each item's tokens (items left-aligned)."""
    total = int(lengths.sum())
    row_base = np.arange(len(lengths), dtype=np.int64) * width - (np.cumsum(lengths) - lengths)
    return torch.from_numpy(np.repeat(row_base, lengths) + np.arange(total, dtype=np.int64))


def collate_docs(items: Block, opts: CollateOptions) -> dict:
    """Documents padded to the longest in the batch: input_ids, attention_mask, labels, lengths, docs.

    Built with one fill per tensor and one scatter of the real tokens: work proportional to the
    padded size is a memset, the rest is proportional to the tokens.
    """
    lengths = items.lengths.astype(np.int64, copy=False)
    n = len(lengths)
    width = _round_up(int(lengths.max()) if n else 0, opts.pad_to_multiple_of)
    flat = _tokens_tensor(items.gather_tokens(), opts.dtype)
    where = _flat_positions(lengths, width)
    input_ids = _filled(n * width, opts.pad_id, opts.dtype).index_copy_(0, where, flat)
    labels = _filled(n * width, IGNORE_INDEX, opts.dtype).index_copy_(0, where, flat)
    attention_mask = _filled(n * width, 0, opts.dtype).index_fill_(0, where, 1)
    pieces = items.pieces if items.pieces is not None else np.zeros(n, np.int64)
    return {
        "input_ids": input_ids.view(n, width),
        "attention_mask": attention_mask.view(n, width),
        "labels": labels.view(n, width),
        "lengths": torch.from_numpy(lengths.copy()),
        "docs": torch.from_numpy(np.stack([items.ids, pieces], axis=1).astype(np.int64)),
    }


def collate_rows(items: Block, opts: CollateOptions) -> dict:
    """Packed rows of ``seq_len``: input_ids, labels, lengths (tokens per row: seq_len but for a
    short tail row), rows, docs; with ``boundaries`` also position_ids, cu_seqlens, max_seqlen.

    No attention_mask: rows hold no padding but after a short tail row's tokens, which causal
    attention never lets a real token see, and whose labels are -100. Leaving it out saves a
    third of the bytes a batch writes."""
    seq_len = opts.seq_len
    n = len(items)
    lengths = items.lengths
    tokens = items.gather_tokens()
    full = bool(n and lengths.min() == seq_len)
    flat = _tokens_tensor(tokens, opts.dtype)
    if full:
        input_ids = flat.view(n, seq_len)
        # Nothing to mask: labels are the same values, so they share input_ids' storage (as the
        # x/y views of one buffer in nanoGPT-style loaders). Boundary masking below copies first.
        labels = input_ids
    else:
        where = _flat_positions(lengths.astype(np.int64), seq_len)
        input_ids = _filled(n * seq_len, opts.pad_id, opts.dtype).index_copy_(0, where, flat).view(n, seq_len)
        labels = _filled(n * seq_len, IGNORE_INDEX, opts.dtype).index_copy_(0, where, flat).view(n, seq_len)
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "lengths": torch.from_numpy(lengths.astype(np.int64)),
        "rows": torch.from_numpy(items.ids.astype(np.int64)),
    }
    seg_counts = np.diff(items.seg_ptr)
    most = int(seg_counts.max()) if n else 1
    max_seg = opts.max_segments or most
    if most > max_seg:
        raise ValueError(f"a row holds {most} documents, more than max_segments={max_seg}; raise max_segments")
    row_of_seg = np.repeat(np.arange(n), seg_counts)
    slot = np.arange(len(row_of_seg)) - np.repeat(items.seg_ptr[:-1], seg_counts)
    docs = np.full((n, most), -1, np.int64)  # metadata, not a model input: as wide as this batch needs
    docs[row_of_seg, slot] = items.seg_ids
    out["docs"] = torch.from_numpy(docs)
    if opts.boundaries:
        out.update(_boundaries(items, seg_counts, row_of_seg, n, seq_len, max_seg, lengths))
        starts = items.seg_starts
        doc_first = starts > 0  # a segment at a row's start continues or starts unseen context; label 0 is never used
        if labels is input_ids:
            labels = labels.clone()
            out["labels"] = labels
        labels[row_of_seg[doc_first], torch.from_numpy(starts[doc_first].astype(np.int64))] = IGNORE_INDEX
    return out


def _boundaries(items: Block, seg_counts, row_of_seg, n: int, seq_len: int, max_seg: int, lengths) -> dict:
    """position_ids restarting at every segment, and flat cu_seqlens padded to a fixed length."""
    starts = items.seg_starts.astype(np.int64)
    flat_starts = row_of_seg * seq_len + starts
    seg_len = np.empty(len(starts), np.int64)
    if len(starts):
        nxt = np.append(starts[1:], 0)
        last_of_row = np.zeros(len(starts), bool)
        last_of_row[items.seg_ptr[1:] - 1] = True
        row_end = lengths[row_of_seg]
        seg_len = np.where(last_of_row, row_end - starts, nxt - starts)
    pos = np.zeros(n * seq_len, np.int64)
    # simple, exact: position within segment for each token position that a segment covers
    seg_token_pos = np.arange(int(seg_len.sum())) - np.repeat(np.cumsum(seg_len) - seg_len, seg_len)
    covered = np.repeat(flat_starts, seg_len) + seg_token_pos
    pos[covered] = seg_token_pos
    # fixed length: every row's segments plus one padding segment per row, so shapes never change
    cu = np.full(n * (max_seg + 1) + 1, n * seq_len, np.int32)
    bounds = np.append(flat_starts, n * seq_len)
    # padding tokens of a short tail row form one more segment so cu_seqlens covers every token
    tails = np.nonzero(lengths < seq_len)[0]
    if len(tails):
        bounds = np.sort(np.concatenate([bounds, tails * seq_len + lengths[tails]]))
    cu[: len(bounds)] = bounds.astype(np.int32)
    seg_lengths = np.diff(bounds)
    return {
        "position_ids": torch.from_numpy(pos.reshape(n, seq_len)),
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": int(seg_lengths.max()) if len(seg_lengths) else 0,
    }
