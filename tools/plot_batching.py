"""Draw docs/img/batching.png: padding against window size for each batching mode.

python tools/plot_batching.py [--data DIR]   (needs the plot extra: pip install wdsllm[plot])
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from bench_batching import MAX_LEN, ensure_docs_dataset, greedy_infinibatch  # noqa: E402

from wdsllm.load import stats  # noqa: E402
from wdsllm.load.sources.open import open_source  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data")
    ap.add_argument("--out", default=str(REPO / "docs" / "img" / "batching.png"))
    args = ap.parse_args()
    data = args.data or ensure_docs_dataset(REPO / "bench-out")
    lengths, _ = stats.stream_lengths(open_source(str(data)), max_len=MAX_LEN)
    windows = [320, 1000, 3200, 10_000, 32_000, 100_000]
    series = {
        "bucket, batch 32": [stats.bucket_batches(lengths, w, batch_size=32).padding_pct for w in windows],
        "bucket, budget 65,536": [stats.bucket_batches(lengths, w, max_tokens=65536).padding_pct for w in windows],
        "infinibatch greedy, budget 65,536": [
            greedy_infinibatch(lengths, w, budget=65536).padding_pct for w in windows
        ],
        "pack into 2048-token rows": [stats.pack_rows(lengths, MAX_LEN, w).padding_pct for w in windows],
    }
    random = stats.random_batches(lengths, 32).padding_pct
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.axhline(random, color="grey", linestyle="--", label=f"random batches of 32 ({random:.1f}%)")
    for (name, values), style in zip(series.items(), ("o-", "s-", "x:", "^-")):
        ax.plot(windows, values, style, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(0.005, 150)
    ax.set_xlabel("window (documents)")
    ax.set_ylabel("padding (% of tensor positions)")
    ax.set_title("Padding by batching mode, Wikipedia / GPT-2, documents split at 2048")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
