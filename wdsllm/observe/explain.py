"""Which documents a step holds: the batch a rank's loader yields at step N, named document by
document (source, shard, ordinal, piece or place in the row), without a model.

The batch is made again by the loader's own stages in this process (its workers' streams run one
after another in DataLoader's order, as ``wdsllm.loader(..., _in_process=True)`` does), from the
epoch's start or from a saved state: the plan decides which documents a step holds and in which
order, and the same plan run again gives the same batch on any machine. Reading up to step N costs
reading those N batches: explain from the checkpoint before the step of interest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..load.block import split_id


@dataclass(frozen=True)
class Placed:
    """One document (or piece) of a step: in batch row ``row``, from ``source`` (None outside a
    mixture), shard ``shard`` (its URL ``url``), the ``ordinal``-th item of that shard; ``piece``:
    its piece number (documents split by ``max_len``), or for rows its order within the row;
    ``tokens``: its tokens' range in the row (rows with boundaries), else in the document."""

    row: int
    source: str | None
    shard: int
    url: str
    ordinal: int
    piece: int
    tokens: tuple[int, int] | None


def explain_step(source: Any, step: int, *, state: dict | None = None, epoch: int | None = None, **options: Any):
    """The documents of the ``step``-th batch (0-based) of the pass a loader of ``source`` with
    ``options`` (``rank``, ``world_size``, ``num_workers`` as in the run) makes from ``epoch`` (set
    as ``set_epoch`` would) or from ``state`` (a ``state_dict()``: step 0 is the first batch after
    it)."""
    from ..load.loader import Loader

    if step < 0:
        raise ConfigError(f"step must be at least 0, not {step}")
    options = {**options, "watchdog_s": None}
    with Loader(source, _in_process=True, **options) as loader:
        if state is not None:
            loader.load_state_dict(state)
        elif epoch is not None:
            loader.set_epoch(epoch)
        made = 0
        for batch in loader:
            if made == step:
                return placed(loader, batch)
            made += 1
    raise ConfigError(f"the pass has {made} batches: no step {step}")


def placed(loader: Any, batch: dict) -> list[Placed]:
    """The documents of a collated batch, named."""
    if "docs" not in batch:
        raise ConfigError("the batch carries no `docs` (docs=False): explain needs them")
    docs = batch["docs"].numpy()
    sources = batch["sources"].numpy() if "sources" in batch else None
    names = loader.catalog.names() if sources is not None else None
    urls = loader.catalog.urls
    if "rows" not in batch:  # documents: [B, 2] id and piece
        max_len = loader.cfg.max_len
        out = []
        for row, (item, piece) in enumerate(docs):
            length = int(batch["lengths"][row])
            start = int(piece) * max_len if max_len else 0
            name = names[int(sources[row])] if names is not None else None
            out.append(_one(row, name, urls, int(item), int(piece), (start, start + length)))
        return out
    return _rows(batch, docs, sources, names, urls)


def _rows(batch: dict, docs: np.ndarray, sources: np.ndarray | None, names: Any, urls: Any) -> list[Placed]:
    spans = _row_spans(batch)
    out = []
    for row in range(docs.shape[0]):
        for order, item in enumerate(int(x) for x in docs[row] if x >= 0):
            name = names[int(sources[row, order])] if names is not None else None
            span = spans[row][order] if spans is not None and order < len(spans[row]) else None
            out.append(_one(row, name, urls, item, order, span))
    return out


def _row_spans(batch: dict) -> list[list[tuple[int, int]]] | None:
    """Each row's documents' token ranges, from ``position_ids`` (rows with boundaries)."""
    if "position_ids" not in batch:
        return None
    out = []
    for positions, length in zip(batch["position_ids"].numpy(), batch["lengths"].numpy()):
        starts = [int(i) for i in np.flatnonzero(positions[:length] == 0)]
        out.append(list(zip(starts, [*starts[1:], int(length)])))
    return out


def _one(row: int, source: str | None, urls: Any, item: int, piece: int, tokens: tuple | None) -> Placed:
    shard, ordinal = split_id(item)
    return Placed(row, source, shard, urls[shard], ordinal, piece, tokens)
