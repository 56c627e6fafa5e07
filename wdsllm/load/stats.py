"""What each batching mode would cost on a dataset: padding and truncation, simulated from lengths.

The simulations run the loader's own batchers over the documents' lengths in the order one
worker of one rank would see them in epoch 0 (the shard plan and the shuffle buffer included),
so the figures are what training would get, without reading a token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..errors import ConfigError
from .batching import BucketBatcher, best_fit_decreasing, round_up
from .catalog import Catalog
from .config import Config
from .stream import epoch_slices, shuffle_lengths, slice_item_lengths


@dataclass
class ModeCost:
    """Simulated outcome of one batching mode."""

    mode: str
    settings: str
    batches: int
    tokens: int  # real tokens delivered
    padded: int  # tensor positions (real + padding)
    truncated: int  # tokens cut away (max_len='truncate' only)
    small_batches: int = 0

    @property
    def padding_pct(self) -> float:
        return 100.0 * (self.padded - self.tokens) / self.padded if self.padded else 0.0

    @property
    def truncation_pct(self) -> float:
        total = self.tokens + self.truncated
        return 100.0 * self.truncated / total if total else 0.0


def stream_lengths(
    catalog: Catalog, *, max_len: int | None, max_len_mode: str = "split", shuffle_buffer: int = 10_000, seed: int = 0
) -> tuple[np.ndarray, int]:
    """Lengths one consumer sees in epoch 0 (after splitting or truncating), and tokens truncated."""
    cfg = Config(seed=seed, shuffle_buffer=shuffle_buffer, max_len=max_len, max_len_mode=max_len_mode)
    spec = cfg.spec(0, 0, 1, 0, 1)
    slices = epoch_slices(catalog, spec)
    raw = slice_item_lengths(catalog, slices, replace(spec, max_len=None))
    if raw is None:
        raise ConfigError("this dataset has no lengths.npy; stats need the index")
    lengths = slice_item_lengths(catalog, slices, spec)
    truncated = int(raw.sum() - lengths.sum()) if max_len_mode == "truncate" else 0
    return shuffle_lengths(lengths, spec), truncated


def random_batches(lengths: np.ndarray, batch_size: int, multiple: int | None = None) -> ModeCost:
    n = len(lengths)
    pad = 0
    for a in range(0, n, batch_size):
        chunk = lengths[a : a + batch_size]
        pad += len(chunk) * int(round_up(int(chunk.max()), multiple))
    return ModeCost("random", f"batch {batch_size}", (n + batch_size - 1) // batch_size, int(lengths.sum()), pad, 0)


def bucket_batches(
    lengths: np.ndarray,
    window: int,
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    multiple: int | None = None,
) -> ModeCost:
    batcher = BucketBatcher(window, batch_size=batch_size, max_tokens=max_tokens, pad_to_multiple_of=multiple)
    k = window
    n_windows = max(1, (len(lengths) + k - 1) // k)
    carry = np.zeros(0, np.int64)
    batches = padded = small = 0
    for i in range(n_windows):
        new = lengths[i * k : (i + 1) * k]
        plan = batcher.plan_window(carry, new, final=i == n_windows - 1)
        merged = np.concatenate([carry, new])
        for idx in plan.batches:
            padded += len(idx) * int(round_up(int(merged[idx].max()), multiple))
        batches += len(plan.batches)
        small += plan.small
        carry = np.sort(new, kind="stable")[len(new) - plan.carry_out :] if plan.carry_out else np.zeros(0, np.int64)
    what = f"batch {batch_size}" if batch_size else f"budget {max_tokens}"
    return ModeCost("bucket", f"{what}, window {window}", batches, int(lengths.sum()), padded, 0, small)


def pack_rows(lengths: np.ndarray, seq_len: int, window: int, batch_size: int = 1) -> ModeCost:
    rows = 0
    for a in range(0, len(lengths), window):
        rows += len(best_fit_decreasing(lengths[a : a + window], seq_len))
    return ModeCost(
        "pack",
        f"seq_len {seq_len}, window {window}",
        (rows + batch_size - 1) // batch_size,
        int(lengths.sum()),
        rows * seq_len,
        0,
    )


def concat_rows(lengths: np.ndarray, seq_len: int, batch_size: int = 1) -> ModeCost:
    tokens = int(lengths.sum())
    rows = (tokens + seq_len - 1) // seq_len
    return ModeCost("concat", f"seq_len {seq_len}", (rows + batch_size - 1) // batch_size, tokens, rows * seq_len, 0)


def all_modes(
    catalog: Catalog,
    *,
    batch_size: int,
    max_tokens: int,
    seq_len: int,
    window: int,
    multiple: int | None = None,
    seed: int = 0,
) -> list[ModeCost]:
    """Padding and truncation of every mode with the given settings."""
    split, _ = stream_lengths(catalog, max_len=seq_len, max_len_mode="split", seed=seed)
    capped, cut = stream_lengths(catalog, max_len=seq_len, max_len_mode="truncate", seed=seed)
    out = []
    rnd = random_batches(split, batch_size, multiple)
    out.append(rnd)
    rnd_cap = random_batches(capped, batch_size, multiple)
    rnd_cap.mode, rnd_cap.truncated = "random, truncated", cut
    out.append(rnd_cap)
    out.append(bucket_batches(split, window, batch_size=batch_size, multiple=multiple))
    out.append(bucket_batches(split, window, max_tokens=max_tokens, multiple=multiple))
    out.append(pack_rows(split, seq_len, window, batch_size))
    out.append(concat_rows(split, seq_len, batch_size))
    return out
