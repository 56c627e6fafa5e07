"""Padding, batch counts and load throughput of every batching mode, in one run.

    python tools/bench_batching.py [--data DIR] [--work bench-out]

Packs the shared Wikipedia corpus with the GPT-2 tokenizer in docs mode (once; reused after),
then, over the lengths one consumer sees in epoch 0 (max length 2048, longer documents split):
- baselines: random batches of 32, and infinibatch's greedy rule (windows sorted longest first,
  batch size = budget // longest, the last batch of each window emitted as it is);
- ours: bucket (batch 32, window 320), bucket (budget 65,536, window 10,000), pack (2048), concat;
- how padding falls as the window grows to 100,000, with the loader's peak RSS at each window;
- load throughput of the bucket and pack loaders against the plain docs-mode loader.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from wdsllm.load import stats  # noqa: E402
from wdsllm.load.sources.open import open_source  # noqa: E402

DATA = REPO.parent / "shared" / "data"
MAX_LEN = 2048


def ensure_docs_dataset(work: Path) -> Path:
    out = work / "wiki-docs"
    if not (out / "index.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "wdsllm.cli",
            "pack",
            str(DATA / "corpora/wiki/wiki-*.jsonl.gz"),
            "-o",
            str(out),
            "-t",
            str(DATA / "tokenizers/gpt2.json"),
            "--overwrite",
            "-q",
        ]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    return out


def greedy_infinibatch(
    lengths: np.ndarray, window: int, *, batch_size: int | None = None, budget: int | None = None
) -> stats.ModeCost:
    """infinibatch BucketedReadaheadBatchIterator's rule, on lengths."""
    batches = padded = 0
    for a in range(0, len(lengths), window):
        items = np.sort(lengths[a : a + window], kind="stable")[::-1]
        i = 0
        while i < len(items):
            size = batch_size if batch_size else max(1, budget // int(items[i]))
            chunk = items[i : i + size]
            padded += len(chunk) * int(chunk[0])
            batches += 1
            i += size
    what = f"batch {batch_size}" if batch_size else f"budget {budget}"
    return stats.ModeCost("infinibatch greedy", f"{what}, window {window}", batches, int(lengths.sum()), padded, 0)


def row(m: stats.ModeCost) -> str:
    return f"| {m.mode} | {m.settings} | {m.batches:,} | {m.padding_pct:.2f}% | {m.truncation_pct:.2f}% |"


LOAD_SNIPPET = """
import json, resource, sys, time, wdsllm
kw = json.loads(sys.argv[2])
loader = wdsllm.loader(sys.argv[1], **kw)
for epoch in range(2):
    loader.set_epoch(epoch)
    t = time.perf_counter(); tokens = batches = 0
    for b in loader:
        batches += 1
        tokens += int(b["lengths"].sum())
    dt = time.perf_counter() - t
rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"tokens_per_s": tokens / dt, "batches": batches, "rss_mib": rss_mib}))
"""


def load(data: Path, **kw) -> dict:
    """Throughput of a second pass and peak RSS, in a fresh process per configuration."""
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SNIPPET, str(data), json.dumps(kw)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="a docs-mode dataset (default: pack the wiki corpus into --work)")
    ap.add_argument("--work", default=str(REPO / "bench-out"))
    ap.add_argument("--skip-load", action="store_true", help="padding tables only")
    args = ap.parse_args()
    data = Path(args.data) if args.data else ensure_docs_dataset(Path(args.work))
    catalog = open_source(str(data))
    lengths, _ = stats.stream_lengths(catalog, max_len=MAX_LEN)
    print(
        f"{len(lengths):,} documents (pieces of at most {MAX_LEN}), {int(lengths.sum()):,} tokens; "
        f"median {int(np.median(lengths))}, mean {lengths.mean():.0f}\n"
    )

    print("| mode | settings | batches | padding | truncation |")
    print("|---|---|---|---|---|")
    rnd = stats.random_batches(lengths, 32)
    print(row(rnd))
    for settings in (dict(batch_size=32, window=320), dict(budget=65536, window=10_000)):
        window = settings["window"]
        base = greedy_infinibatch(lengths, window, batch_size=settings.get("batch_size"), budget=settings.get("budget"))
        ours = stats.bucket_batches(
            lengths, window, batch_size=settings.get("batch_size"), max_tokens=settings.get("budget")
        )
        print(row(base))
        print(row(ours))
        verdict = "no worse" if ours.padding_pct <= base.padding_pct and ours.batches <= base.batches else "WORSE"
        print(
            f"|  | ours vs greedy: padding {ours.padding_pct - base.padding_pct:+.2f} points, batches "
            f"{ours.batches - base.batches:+d} ({verdict}) | | | |"
        )
    pack = stats.pack_rows(lengths, MAX_LEN, 10_000)
    print(row(pack))
    print(row(stats.concat_rows(lengths, MAX_LEN)))
    capped, cut = stats.stream_lengths(catalog, max_len=MAX_LEN, max_len_mode="truncate")
    print(
        f"\npack: {pack.padding_pct:.3f}% padding, no document at or under {MAX_LEN} cut, nothing dropped; "
        f"capping at {MAX_LEN} instead would truncate {100 * cut / (cut + int(capped.sum())):.1f}% of the tokens"
    )

    print("\nwindow growth (padding; peak RSS of a loader streaming an epoch with that window):")
    print("| window | bucket, batch 32 | bucket, budget 65,536 | pack 2048 | loader RSS (budget) |")
    print("|---|---|---|---|---|")
    for window in (320, 1_000, 3_200, 10_000, 32_000, 100_000):
        b32 = stats.bucket_batches(lengths, window, batch_size=32)
        bud = stats.bucket_batches(lengths, window, max_tokens=65536)
        pk = stats.pack_rows(lengths, MAX_LEN, window)
        rss = ""
        if not args.skip_load:
            run = load(data, batching="bucket", max_tokens=65536, batch_size=None, window=window, max_len=MAX_LEN)
            rss = f"{run['rss_mib']:.0f} MiB"
        print(
            f"| {window:,} | {b32.padding_pct:.2f}% | {bud.padding_pct:.2f}% ({bud.batches} batches) | "
            f"{pk.padding_pct:.3f}% | {rss} |"
        )

    if args.skip_load:
        return
    print("\nload throughput (real tokens/s, second pass, 1 process):")
    plain = load(data, batch_size=32, max_len=MAX_LEN)
    print(f"| plain docs mode, batch 32 | {plain['tokens_per_s'] / 1e6:.1f}M | 1.00x |")
    for name, kw in (
        ("bucket, batch 32, window 320", dict(batching="bucket", batch_size=32, window=320, max_len=MAX_LEN)),
        (
            "bucket, budget 65,536, window 10,000",
            dict(batching="bucket", max_tokens=65536, batch_size=None, window=10_000, max_len=MAX_LEN),
        ),
        ("pack 2048, batch 8, window 10,000", dict(batching="pack", seq_len=MAX_LEN, batch_size=8, window=10_000)),
        ("concat 2048, batch 8", dict(batching="concat", seq_len=MAX_LEN, batch_size=8)),
    ):
        r = load(data, **kw)
        print(f"| {name} | {r['tokens_per_s'] / 1e6:.1f}M | {r['tokens_per_s'] / plain['tokens_per_s']:.2f}x |")
    print(f"\n(peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\nbench_batching took {time.perf_counter() - t0:.0f} s")
