"""What each batching mode would cost on a dataset: padding and truncation, simulated from lengths.

The simulations run the loader's own batchers over the documents' lengths in the order one
worker of one rank would see them in epoch 0 (the shard plan and the shuffle buffer included),
so the figures are what training would get, without reading a token.

A dataset of more than ``EXACT_DOCUMENTS`` documents is simulated on a seeded sample instead:
runs of a few consecutive windows of the same stream, each read from lengths.npy where it lies,
shuffled and batched as the loader would. Padding is then a ratio estimate over the runs with a
95% confidence bound, and batch counts are extrapolated from the documents; the time and memory
are those of the sample, whatever the dataset's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..errors import ConfigError
from ..format import Index
from .batching import BucketBatcher, bfd_count, round_up
from .config import Config
from .plan import block_tokens, epoch_layout, slices_for
from .sources.protocol import DocumentLengths, Source
from .stream import _max_len_lengths, plan_labels, shuffle_lengths, slice_item_lengths

#: datasets up to this many documents are simulated whole (beyond: a sample of windows)
EXACT_DOCUMENTS = 5_000_000
#: runs of consecutive windows sampled, and windows per run (the first one's carry feeds the rest)
SAMPLE_RUNS = 400
RUN_WINDOWS = 3


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
    padding_ci: float | None = None  # sampled: half-width of the padding's 95% confidence interval, in % points
    steps: int | None = None  # under a batch-size schedule: the steps its batches make (wdsllm stats --schedule)

    @property
    def padding_pct(self) -> float:
        return 100.0 * (self.padded - self.tokens) / self.padded if self.padded else 0.0

    @property
    def truncation_pct(self) -> float:
        total = self.tokens + self.truncated
        return 100.0 * self.truncated / total if total else 0.0


def stream_lengths(
    catalog: Source,
    *,
    max_len: int | None,
    max_len_mode: str = Config.max_len_mode,
    shuffle_buffer: int = 10_000,
    seed: int = 0,
) -> tuple[np.ndarray, int]:
    """Lengths one consumer sees in epoch 0 (after splitting or truncating), and tokens truncated."""
    cfg = Config(seed=seed, shuffle_buffer=shuffle_buffer, max_len=max_len, max_len_mode=max_len_mode)
    spec = cfg.spec(0, 0, 1, 0, 1)
    catalog.bind(cfg, 1)  # a mixture: its plan with this seed
    slices = slices_for(catalog, cfg, spec)
    raw = slice_item_lengths(catalog, slices, replace(spec, max_len=None))
    if raw is None:
        raise ConfigError("this dataset has no lengths.npy; stats need the index")
    lengths = slice_item_lengths(catalog, slices, spec)
    truncated = int(raw.sum() - lengths.sum()) if max_len_mode == "truncate" else 0
    return shuffle_lengths(lengths, spec, catalog.mixing, plan_labels(catalog, slices, spec)), truncated


def random_batches(lengths: np.ndarray, batch_size: int, multiple: int | None = None) -> ModeCost:
    n = len(lengths)
    full = n // batch_size
    maxes = lengths[: full * batch_size].reshape(full, batch_size).max(axis=1) if full else np.zeros(0, np.int64)
    pad = batch_size * int(round_up(maxes.astype(np.int64), multiple).sum())
    if n > full * batch_size:
        pad += (n - full * batch_size) * int(round_up(int(lengths[full * batch_size :].max()), multiple))
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
        rows += bfd_count(lengths[a : a + window], seq_len)
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


@dataclass
class Sample:
    """What a sampled simulation covered."""

    runs: int
    windows: int  # windows simulated
    documents: int  # documents simulated
    total_documents: int


def all_modes(
    catalog: Source,
    *,
    batch_size: int,
    max_tokens: int,
    seq_len: int,
    window: int,
    multiple: int | None = None,
    seed: int = 0,
    sample: int | None = None,
) -> tuple[list[ModeCost], Sample | None]:
    """Padding and truncation of every mode with the given settings, and what was sampled (None:
    the whole stream was simulated). ``sample``: runs to sample (0: the whole stream, whatever
    its size; None: whole up to EXACT_DOCUMENTS documents, else SAMPLE_RUNS runs)."""
    documents = catalog.index.documents if catalog.index is not None else 0
    if sample is None:
        sample = 0 if documents <= EXACT_DOCUMENTS or catalog.mixing is not None else SAMPLE_RUNS
    if sample and catalog.mixing is not None:
        raise ConfigError("a mixture's stats simulate its whole epoch (--sample 0)")
    if sample:
        return _sampled(catalog, batch_size, max_tokens, seq_len, window, multiple, seed, sample)
    return _whole(catalog, batch_size, max_tokens, seq_len, window, multiple, seed), None


def _whole(
    catalog: Source, batch_size: int, max_tokens: int, seq_len: int, window: int, multiple: int | None, seed: int
) -> list[ModeCost]:
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


#: The simulated modes, in the order stats reports them.
_SAMPLED_MODES = ["random", "random, truncated", "bucket batch", "bucket budget", "pack"]


@dataclass
class _RunTallies:
    """What the sampled runs measured: per mode, each run's (batches, tokens, padded, items)."""

    per_run: dict[str, np.ndarray]
    small: int = 0  # bucket budget's batches under the budget
    cut_total: int = 0  # tokens that truncation at seq_len drops
    pieces: int = 0  # items after max_len splitting


def _sampled(
    catalog: Source,
    batch_size: int,
    max_tokens: int,
    seq_len: int,
    window: int,
    multiple: int | None,
    seed: int,
    runs: int,
) -> tuple[list[ModeCost], Sample]:
    """Every mode simulated on ``runs`` runs of RUN_WINDOWS windows of consecutive documents of
    the epoch-0 stream, at seeded places; padding as ratio estimates with 95% intervals."""
    if catalog.lengths() is None:
        raise ConfigError("this dataset has no lengths.npy; stats need the index")
    cfg = Config(seed=seed, shuffle_buffer=10_000)
    layout = epoch_layout(
        catalog.items_per_shard,
        seed=seed,
        epoch=0,
        world=1,
        workers=1,
        shuffle=True,
        tokens_per_shard=block_tokens(catalog),
    )
    total = int(layout.ends[-1]) if len(layout.ends) else 0
    span = min(total, RUN_WINDOWS * window)
    rng = np.random.default_rng([seed, 16])
    starts = np.sort(rng.integers(0, max(1, total - span + 1), runs))
    tallies = _RunTallies({name: np.zeros((runs, 4), np.int64) for name in _SAMPLED_MODES})
    for i, start in enumerate(starts.tolist()):
        raw = _plan_lengths(catalog, layout, start, start + span)
        _tally_run(tallies, i, raw, cfg, seed, seq_len, window, batch_size, max_tokens, multiple)
    scale = total / max(1, span * runs)  # documents of the dataset per document sampled
    out = _mode_costs(tallies, catalog.index.tokens, total, scale, batch_size, max_tokens, seq_len, window)
    out.append(concat_rows(np.array([catalog.index.tokens]), seq_len, batch_size))  # exact: the index's tokens
    return out, Sample(runs, runs * -(-span // window), span * runs, total)


def _tally_run(
    tallies: _RunTallies,
    i: int,
    raw: np.ndarray,
    cfg: Config,
    seed: int,
    seq_len: int,
    window: int,
    batch_size: int,
    max_tokens: int,
    multiple: int | None,
) -> None:
    """Simulate every mode on run ``i``'s document lengths ``raw`` into ``tallies``."""
    spec = cfg.spec(0, 0, 1, 0, 1)
    split = _max_len_lengths(raw, replace(spec, max_len=seq_len, max_len_mode="split"))
    capped = np.minimum(raw, seq_len)
    tallies.cut_total += int(raw.sum() - capped.sum())
    tallies.pieces += len(split)
    block_rng = np.random.default_rng([seed, 16, i])
    whole = max(1, len(split) // window) * window  # whole windows only: no stream end inside a run
    shuffled = _block_shuffled(split[:whole], cfg.shuffle_buffer, block_rng)
    capped = _block_shuffled(capped, cfg.shuffle_buffer, block_rng)
    for name, (cost, items) in (
        ("random", (random_batches(shuffled, batch_size, multiple), len(shuffled))),
        ("random, truncated", (random_batches(capped, batch_size, multiple), len(capped))),
        ("bucket batch", _bucket_steady(shuffled, window, batch_size=batch_size, multiple=multiple)),
        ("bucket budget", _bucket_steady(shuffled, window, max_tokens=max_tokens, multiple=multiple)),
        ("pack", (pack_rows(shuffled, seq_len, window, 1), len(shuffled))),
    ):
        tallies.per_run[name][i] = (cost.batches, cost.tokens, cost.padded, items)
        if name == "bucket budget":
            tallies.small += cost.small_batches


def _mode_costs(
    tallies: _RunTallies,
    tokens: int,
    total: int,
    scale: float,
    batch_size: int,
    max_tokens: int,
    seq_len: int,
    window: int,
) -> list[ModeCost]:
    """Each sampled mode's cost over the whole dataset, scaled up from the runs."""
    cut = round(tallies.cut_total * scale)
    items_total = {"random, truncated": total}  # items of the whole stream: documents, or their pieces
    split_total = round(tallies.pieces * scale)
    labels = {
        "random": ("random", f"batch {batch_size}"),
        "random, truncated": ("random, truncated", f"batch {batch_size}"),
        "bucket batch": ("bucket", f"batch {batch_size}, window {window}"),
        "bucket budget": ("bucket", f"budget {max_tokens}, window {window}"),
        "pack": ("pack", f"seq_len {seq_len}, window {window}"),
    }
    out = []
    for name in _SAMPLED_MODES:
        measured = tallies.per_run[name]
        per_item = measured[:, 0].sum() / max(1, measured[:, 3].sum())  # batches (pack: rows) per item
        batches = per_item * items_total.get(name, split_total)
        if name == "pack":
            batches = -(-round(batches) // batch_size)
        have = tokens - cut if name == "random, truncated" else tokens
        pad_share, ci = _ratio_ci(measured[:, 2] - measured[:, 1], measured[:, 2])
        cost = ModeCost(
            labels[name][0],
            labels[name][1],
            round(batches),
            have,
            round(have / (1 - pad_share)) if pad_share < 1 else have,
            cut if name == "random, truncated" else 0,
            round(tallies.small * scale) if name == "bucket budget" else 0,
            padding_ci=100.0 * ci,
        )
        out.append(cost)
    return out


def _bucket_steady(
    lengths: np.ndarray,
    window: int,
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    multiple: int | None = None,
) -> tuple[ModeCost, int]:
    """Bucket batches (and the items they hold) of the windows of a run after its first, as in the
    middle of a stream: the first window only feeds its carry to the second, and the last carries
    its partial batch on."""
    batcher = BucketBatcher(window, batch_size=batch_size, max_tokens=max_tokens, pad_to_multiple_of=multiple)
    carry = np.zeros(0, np.int64)
    batches = tokens = padded = small = items = 0
    for i, a in enumerate(range(0, len(lengths), window)):
        new = lengths[a : a + window]
        plan = batcher.plan_window(carry, new, final=False)
        if i:
            merged = np.concatenate([carry, new])
            for idx in plan.batches:
                padded += len(idx) * int(round_up(int(merged[idx].max()), multiple))
                tokens += int(merged[idx].sum())
                items += len(idx)
            batches += len(plan.batches)
            small += plan.small
        carry = np.sort(new, kind="stable")[len(new) - plan.carry_out :] if plan.carry_out else np.zeros(0, np.int64)
    return ModeCost("bucket", "", batches, tokens, padded, 0, small), items


def _plan_lengths(catalog: Source, layout, a: int, b: int) -> np.ndarray:
    """Lengths of documents [a, b) of the epoch's plan order (the shards in their epoch order)."""
    parts = []
    i = int(np.searchsorted(layout.ends, a, side="right"))
    while a < b and i < len(layout.order):
        first = int(layout.ends[i] - layout.counts[i]) - (0 if layout.firsts is None else int(layout.firsts[i]))
        stop = min(b, int(layout.ends[i]))
        parts.append(catalog.lengths().of_unit(int(layout.order[i]), a - first, stop - first))
        a = stop
        i += 1
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _block_shuffled(lengths: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """The lengths in a blockwise shuffled order, as the stream shuffles (blocks of ``size``)."""
    out = lengths.copy()
    for a in range(0, len(out), size):
        out[a : a + size] = rng.permutation(out[a : a + size])
    return out


def _ratio_ci(num: np.ndarray, den: np.ndarray) -> tuple[float, float]:
    """sum(num) / sum(den) over sampled runs, and the half-width of its 95% confidence interval
    (the ratio estimator's variance over runs, by the delta method)."""
    n = len(den)
    total = float(den.sum())
    if n == 0 or total == 0:
        return 0.0, 0.0
    ratio = float(num.sum()) / total
    if n < 2:
        return ratio, float("inf")
    residual = num - ratio * den
    var = float(residual.var(ddof=1)) / (n * (total / n) ** 2)
    return ratio, 1.96 * math.sqrt(var)


# ----------------------------------------------------------------------------------------------
# Packed data: its rows are fixed when it is packed, so what stats can say is what they hold.

#: documents_cut is worked out up to this many documents (one pass over lengths.npy in memory)
CUT_DOCUMENTS = 4 * EXACT_DOCUMENTS


@dataclass
class PackedRows:
    """What a packed dataset's rows hold: only the last row of each task is short (padded when
    batched), and a document that runs past a row's end continues in the next row (cut)."""

    source: str
    seq_len: int
    rows: int
    tokens: int
    short_rows: int
    padding: int  # pad tokens that fill the short rows to seq_len
    documents: int
    documents_cut: int | None  # documents that span a row boundary; None: not worked out

    @property
    def padding_pct(self) -> float:
        return 100 * self.padding / max(1, self.rows * self.seq_len)


def packed_rows(name: str, index: Index, lengths: DocumentLengths | None) -> PackedRows:
    """The rows of one packed dataset (a mixture: of one of its sources), from its index and
    lengths.npy; no shard is read."""
    seq_len = int(index.seq_len or 0)
    rows = index.shards.column("rows").astype(np.int64)
    tokens = index.shards.column("tokens").astype(np.int64)
    total_rows, total_tokens = int(rows.sum()), int(tokens.sum())
    cut = None
    if lengths is not None and seq_len and index.documents <= CUT_DOCUMENTS:
        cut = documents_cut(np.asarray(lengths.whole(), np.int64), rows, tokens, seq_len)
    return PackedRows(
        source=name,
        seq_len=seq_len,
        rows=total_rows,
        tokens=total_tokens,
        short_rows=int((index.packed or {}).get("short_rows", 0)),
        padding=total_rows * seq_len - total_tokens,
        documents=int(index.documents),
        documents_cut=cut,
    )


def documents_cut(lengths: np.ndarray, rows: np.ndarray, tokens: np.ndarray, seq_len: int) -> int:
    """Documents that span a row boundary. Each shard starts a row; within it rows are seq_len
    tokens, the last one possibly short; documents run on across shards."""
    starts = np.concatenate([[0], np.cumsum(tokens)[:-1]])
    within = [s + seq_len * np.arange(1, r, dtype=np.int64) for s, r in zip(starts, rows, strict=True) if r > 1]
    boundaries = np.sort(np.concatenate([*within, starts[1:]])) if len(starts) else np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    begins = ends - lengths
    inside = np.searchsorted(boundaries, ends, side="left") - np.searchsorted(boundaries, begins, side="right")
    return int(np.count_nonzero(inside > 0))
