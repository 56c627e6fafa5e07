"""Per-source losses of a mixture's batch: the signal online mixing (DoReMi, ODM, Aioli) steers by.

A batch of a mixture carries ``sources``: one per document (documents), or per document of each
row, -1 past a row's last (rows). Each token's loss is charged to the source of the document it
belongs to: a document's own row (documents), or the row's segment it falls in, found from
``position_ids`` (rows with ``boundaries=True``: a segment starts where they restart at 0). Tokens
whose label is ignored (-100: padding, a document's first token in a packed row) count nowhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...errors import UsageError

IGNORE_INDEX = -100


def _token_sources(batch: Mapping[str, Any], width: int) -> torch.Tensor:
    """[B, width] the source of each input position's document (-1: none)."""
    sources = batch.get("sources")
    if sources is None:
        raise UsageError("source_losses() needs a mixture's batch: it reads the batch's `sources`")
    if sources.dim() == 1:  # documents: one source a row
        return sources[:, None].expand(-1, width)
    if sources.shape[1] == 1:  # rows of one document each
        return sources.expand(-1, width)
    positions = batch.get("position_ids")
    if positions is None:
        raise UsageError(
            "rows of several documents tell which token is whose from their position_ids: "
            "build the loader with boundaries=True to attribute a row's tokens to its sources"
        )
    segment = torch.cumsum((positions[:, :width] == 0).to(torch.int64), dim=1) - 1
    segment = segment.clamp(min=0, max=sources.shape[1] - 1)
    return torch.gather(sources, 1, segment)


def source_losses(
    token_losses: torch.Tensor, batch: Mapping[str, Any], num_sources: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, tokens) per source of a mixture's batch, two tensors of ``num_sources``.

    ``token_losses`` is [B, T], aligned with the batch's positions (what ``shift_labels`` or
    next-token labels give), or [B, T - 1] as a Hugging Face model's internal shift gives it
    (``cross_entropy(logits[:, :-1], labels[:, 1:], reduction="none")``): a loss is then charged to
    the document of the token it predicts. Sum both over ranks (an all-reduce) before dividing, so
    that every rank steers by the same figures."""
    b, t = token_losses.shape
    labels = batch.get("shift_labels", batch.get("labels"))
    if labels is None or labels.shape[0] != b:
        raise UsageError("source_losses() needs the batch's labels to know which positions count")
    width = labels.shape[1]
    if t == width:
        sources, counted = _token_sources(batch, width), labels != IGNORE_INDEX
    elif t == width - 1:
        sources, counted = _token_sources(batch, width)[:, 1:], labels[:, 1:] != IGNORE_INDEX
    else:
        raise UsageError(f"token_losses is [{b}, {t}]; the batch's rows are {width} long (give {width} or {width - 1})")
    sources = sources.to(token_losses.device)
    keep = counted.to(token_losses.device) & (sources >= 0) & (sources < num_sources)
    index = sources[keep]
    sums = torch.zeros(num_sources, dtype=torch.float64, device=token_losses.device)
    sums.index_add_(0, index, token_losses[keep].detach().to(torch.float64))
    counts = torch.bincount(index, minlength=num_sources).to(torch.float64)
    return sums, counts


def mean_losses(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean loss per source (NaN where a source had no token)."""
    return sums / counts.where(counts > 0, torch.full_like(counts, float("nan")))


__all__ = ["mean_losses", "source_losses"]
