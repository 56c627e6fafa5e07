"""A mixture's realized mix and its planned shares: tokens and items delivered per source (counted
in the worker that made each batch), and what ``wdsllm stats`` says of a mixture from the indexes."""

from __future__ import annotations

import bisect

import numpy as np

from .block import Block
from .mixplan import Mixing, MixPlanner
from .sources.mixture import MixtureSource

# ----------------------------------------------------------------------------------------------
# The realized mix


class MixTally:
    """Tokens and items delivered per source, so far and in the current epoch."""

    def __init__(self, source: MixtureSource):
        self.source = source
        k = len(source.parts)
        self.total = np.zeros((k, 2), np.int64)  # [source, (tokens, items)]
        self.this_epoch = np.zeros((k, 2), np.int64)
        self.epoch: int | None = None

    def add(self, counts: np.ndarray, epoch: int) -> None:
        """Count a batch's ``mix_counts`` (made where the batch was made: in its worker)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.this_epoch[:] = 0
        self.total += counts
        self.this_epoch += counts

    def report(self, world: int = 1) -> dict[str, dict]:
        planner = self.source.mix_planner()
        epoch = self.epoch or 0
        quotas = planner.unit_quotas(epoch)
        epoch_weights = _weights_at(planner, epoch)
        unit = 0 if self.source.mixture.unit == "tokens" else 1
        delivered = self.this_epoch[:, unit]
        share = delivered / max(1, int(delivered.sum()))
        # ranks stay in step (equal batches): the run's position is this rank's units times world
        position = epoch * planner.epoch + int(delivered.sum()) * max(1, world)
        weights = phase_weights(planner, position)
        out = {}
        for s, name in enumerate(self.source.names()):
            out[name] = {
                "tokens": int(self.total[s, 0]),
                "items": int(self.total[s, 1]),
                "epoch_tokens": int(self.this_epoch[s, 0]),
                "epoch_items": int(self.this_epoch[s, 1]),
                "share": float(share[s]),
                "target_share": float(weights[s]),
                "epoch_target_share": float(epoch_weights[s]),
                "epoch_quota": int(quotas[s]),
                "rank_quota": int(quotas[s]) // max(1, world),
            }
        return out


def phase_at(phases: list[tuple[int, tuple[float, ...]]], position: int) -> int:
    """Which of ``phases`` (``MixPlanner.phases()``) is in force at ``position`` units of the run."""
    return max(0, bisect.bisect_right([start for start, _ in phases], position) - 1)


def normalised(weights: tuple[float, ...]) -> list[float]:
    total = sum(weights) or 1
    return [w / total for w in weights]


def phase_weights(planner: MixPlanner, position: int) -> list[float]:
    """The weights (normalised) of the schedule's phase in force at ``position`` units of the run."""
    phases = planner.report_phases()
    return normalised(phases[phase_at(phases, position)][1])


def _weights_at(planner: MixPlanner, epoch: int) -> list[float]:
    """The epoch's planned share of each source (its quotas over their sum)."""
    q = planner.unit_quotas(epoch)
    total = sum(q) or 1
    return [x / total for x in q]


def mix_counts(items: Block, mixing: Mixing, mode: str) -> np.ndarray:
    """[sources, 2]: a batch's tokens and items (documents or pieces; rows of packed data) by source."""
    src, tokens = block_sources(items, mixing, mode)
    k = mixing.sources
    out = np.empty((k, 2), np.int64)
    out[:, 0] = np.bincount(src, weights=tokens, minlength=k)
    out[:, 1] = np.bincount(src, minlength=k)
    return out


def block_sources(items: Block, mixing: Mixing, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(source, tokens) of every document or document piece of a batch: one entry per item, or
    per segment of rows made from documents (it runs for every batch: few numpy calls)."""
    if mode == "packed" or items.seg_ids is None:
        return mixing.sources_of_ids(items.ids), items.lengths
    _, src = items.segments()
    sources = mixing.sources_of_ids(items.seg_ids[src])
    if items.seg_lens is not None:  # rows made by a batcher, which knew each segment's tokens
        return sources, items.seg_lens[src]
    starts = items.seg_starts[src]
    ends = np.empty(len(src), starts.dtype)  # a segment ends where the next of its row starts ...
    ends[:-1] = starts[1:]
    rows, last = items.row_last_segments()
    ends[last] = items.lengths[rows]  # ... or, the last, at its row's end
    return sources, ends - starts


# ----------------------------------------------------------------------------------------------
# What `wdsllm stats` says of a mixture, from the indexes alone


def mixture_summary(source: MixtureSource, epoch: int = 0) -> list[dict]:
    """Per source: its size (items, tokens), weight, the epoch's quota in the unit and in items,
    and whether the quota repeats the source (``repeats``: quota / size) or takes a subset
    (``subset``: the fraction taken)."""
    planner = source.mix_planner()
    units = planner.unit_quotas(epoch)
    items = planner.quotas(epoch)
    total = sum(units) or 1
    out = []
    for s, name in enumerate(source.names()):
        st = planner.streams[s]
        size = planner.sizes[s]
        ratio = units[s] / size if size else 0.0
        out.append(
            {
                "source": name,
                "items": st.size,
                "tokens": st.token_size,
                "weight": units[s] / total,
                "quota": units[s],
                "quota_items": items[s],
                "repeats": ratio if ratio >= 1 else None,
                "subset": ratio if ratio < 1 else None,
            }
        )
    return out


def planned_shares(source: MixtureSource, epochs: int = 1, points: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """(positions in the unit, [points, sources] weights in force there) over ``epochs`` epochs
    (schedule included): what ``wdsllm stats --plot`` draws."""
    planner = source.mix_planner()
    end = planner.epoch * max(1, epochs)
    phases = planner.phases()
    xs = np.linspace(0, end, points, endpoint=False)
    starts = np.array([p for p, _ in phases])
    table = np.array([w for _, w in phases])
    return xs, table[np.searchsorted(starts, xs, side="right") - 1]
