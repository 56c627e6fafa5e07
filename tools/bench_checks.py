"""What the integrity checks cost: the loader with and without group checks, every batching mode.

    python tools/bench_checks.py [--work bench-out] [--quick] [--workers 0,2] [--rounds 5]

Uses the wiki packs of ``tools/bench_load.py`` (docs mode, and packed rows of 2048; made on the
first run). For each batching mode and worker count, the same loader settings run with
``check_groups=True`` (the default: every group's bytes against its xxh3 checksum, its dtype, its
counts and its ids against the vocabulary, before anything is decoded) and ``check_groups=False``
(the unchecked reading path) in alternating passes in one process, so that both see the same
machine; each pass reads whole epochs for at least ``--min-seconds``. It prints the best tokens/s
of each and their ratio. Targets (issue #19): at least 0.95x in docs, bucket and concat modes,
0.8x in packed mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_load  # the same packs and constants as the load benchmark

import wdsllm

MODES = {
    "docs, fixed batch 64": ("docs", dict(batch_size=64, max_len=2048)),
    "docs, bucket batch 64": ("docs", dict(batching="bucket", batch_size=64, max_len=2048)),
    "docs, bucket 65,536 tokens": ("docs", dict(batching="bucket", max_tokens=65536, batch_size=None, max_len=2048)),
    "docs, pack rows 2048 x 8": ("docs", dict(batching="pack", seq_len=2048, batch_size=8)),
    "docs, concat rows 2048 x 8": ("docs", dict(batching="concat", seq_len=2048, batch_size=8)),
    "packed rows 2048 x 64": ("packed", dict(batch_size=64)),
    "packed rows 2048 x 64, docs=False": ("packed", dict(batch_size=64, docs=False)),
}


def rate(data: str, workers: int, check: bool, options: dict, min_seconds: float) -> float:
    """Tokens per second over whole epochs (at least ``min_seconds`` of them)."""
    loader = wdsllm.loader(
        data, num_workers=workers, persistent_workers=workers > 0, seed=0, check_groups=check, **options
    )
    for _ in loader:  # warm: page cache, mappings, workers
        pass
    tokens, elapsed, epoch = 0, 0.0, 1
    while elapsed < min_seconds:
        loader.set_epoch(epoch)
        lengths = []
        t = time.perf_counter()
        for batch in loader:
            lengths.append(batch["lengths"])
        elapsed += time.perf_counter() - t
        tokens += int(sum(int(x.sum()) for x in lengths))
        epoch += 1
    return tokens / elapsed


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(bench_load.REPO / "bench-out"))
    ap.add_argument("--quick", action="store_true", help="one wiki file instead of eight")
    ap.add_argument("--workers", default="0,2", help="comma-separated worker counts")
    ap.add_argument("--rounds", type=int, default=5, help="alternating passes of each variant")
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument("--only", default="", help="substring: run only the modes whose name holds it")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as bench_load: torch's parallel fills lose to contention on 2 cores
    paths = bench_load.prepare(args.work, args.quick)
    bench_load.warm_page_cache(paths)
    results = {}
    print("| mode | workers | checked tokens/s | unchecked tokens/s | checked / unchecked |")
    print("|---|---|---|---|---|")
    for name, (kind, options) in MODES.items():
        if args.only and args.only not in name:
            continue
        data = paths.docs if kind == "docs" else paths.packed
        for workers in (int(w) for w in args.workers.split(",")):
            best = {True: 0.0, False: 0.0}
            for _ in range(args.rounds):
                for check in (True, False):
                    best[check] = max(best[check], rate(data, workers, check, options, args.min_seconds))
            ratio = best[True] / best[False]
            results[f"{name} | {workers}"] = {"checked": best[True], "unchecked": best[False], "ratio": ratio}
            print(
                f"| {name} | {workers} | {best[True] / 1e6:,.1f}M | {best[False] / 1e6:,.1f}M | {ratio:.3f}x |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
