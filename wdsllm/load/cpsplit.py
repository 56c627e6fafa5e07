"""Context-parallel slices of a batch: each CP rank gets its part of every row.

A row of length L is cut into equal chunks: ``zigzag`` cuts 2 x CP chunks and rank r takes
chunks r and 2CP-1-r, so that under causal attention every rank holds as much work as the others
(an early chunk attends to little, its mirror to much); ``contiguous`` cuts CP chunks, rank r
takes chunk r. Labels are shifted before the cut (``shift_labels[t]`` is the token position t
predicts), because after it a chunk's last token would lose its label to the next rank; the
batch then carries ``shift_labels`` in place of ``labels``, the form Hugging Face's loss takes
(``shift_labels=``). ``position_ids`` are the true positions (a row's, or each document's where
packed rows carry them). Per-row facts (``lengths``, ``docs``, ``sources``, ``rows``) and the
row's ``cu_seqlens`` are kept whole; ``cp_token_ranges`` says which of the row's tokens this
rank holds, which a varlen or flex attention kernel needs with ``cu_seqlens`` to keep the
documents apart. :func:`reassemble` puts the slices back together (tests, gathering outputs).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .collate import IGNORE_INDEX
from .layout import CpSlice

#: the tensors laid out along a row's tokens ([batch, L]): these are cut
TOKEN_KEYS = ("input_ids", "attention_mask", "shift_labels", "position_ids")
RANGES_KEY = "cp_token_ranges"


def check_row_length(cp: CpSlice, *, seq_len: int | None, multiple: int | None, rows: bool) -> None:
    """Refuse, at construction, rows that the split cannot cut into equal chunks: packed rows of
    ``seq_len``, or padded documents whose width must be a multiple of the chunk count."""
    need = cp.chunks
    if rows:
        if not seq_len or seq_len % need:
            raise ConfigError(
                f"context parallel ({cp.split}, cp size {cp.size}) cuts every row into {need} equal chunks: "
                f"seq_len={seq_len} is not a multiple of {need}"
            )
    elif not multiple or multiple % need:
        raise ConfigError(
            f"context parallel ({cp.split}, cp size {cp.size}) cuts every padded batch into {need} equal chunks: pass "
            f"pad_to_multiple_of= a multiple of {need} (now {multiple})"
        )


def chunk_ranges(cp: CpSlice, length: int) -> list[tuple[int, int]]:
    """The [start, end) token ranges of a row of ``length`` that rank ``cp.rank`` holds, in order."""
    if length % cp.chunks:
        raise ConfigError(f"a row of {length} tokens does not cut into {cp.chunks} equal chunks")
    chunk = length // cp.chunks
    picks = [cp.rank, 2 * cp.size - 1 - cp.rank] if cp.split == "zigzag" else [cp.rank]
    return [(i * chunk, (i + 1) * chunk) for i in picks]


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` moved one token left: what each position predicts (-100 after a row's last)."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    return out


def full_view(batch: dict) -> dict:
    """The whole batch as every CP rank sees it before its cut: labels shifted (unless the batch
    has next-token labels already: ``shift_labels=True``), true positions."""
    out = dict(batch)
    if "labels" in out:
        out["shift_labels"] = shifted(out.pop("labels"))
    if "position_ids" not in out:
        n, length = out["input_ids"].shape
        out["position_ids"] = torch.arange(length, dtype=torch.long).expand(n, length)
    return out


def cp_slice(batch: dict, cp: CpSlice) -> dict:
    """This CP rank's part of ``batch`` (see the module's docstring)."""
    whole = full_view(batch)
    ranges = chunk_ranges(cp, whole["input_ids"].shape[1])
    out = {}
    for key, value in whole.items():
        if key in TOKEN_KEYS:
            value = torch.cat([value[:, a:b] for a, b in ranges], dim=1)
        out[key] = value
    out[RANGES_KEY] = torch.tensor(ranges, dtype=torch.long)
    return out


def reassemble(slices: list[dict]) -> dict:
    """The whole batch (as :func:`full_view` gives it) from every CP rank's slice, in rank order."""
    first = slices[0]
    n = first["input_ids"].shape[0]
    length = sum(s["input_ids"].shape[1] for s in slices)
    out = {k: v for k, v in first.items() if k != RANGES_KEY}
    for key in TOKEN_KEYS:
        if key not in first:
            continue
        whole = first[key].new_empty((n, length))
        for part in slices:
            at = 0
            for a, b in part[RANGES_KEY].tolist():
                whole[:, a:b] = part[key][:, at : at + b - a]
                at += b - a
        out[key] = whole
    return out


__all__ = ["check_row_length", "chunk_ranges", "cp_slice", "full_view", "reassemble", "shifted"]
