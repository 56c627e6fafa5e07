"""Time to the first batch after resuming at 90% of an epoch, against a fresh start, in one run.

    python tools/bench_resume.py [--data DIR] [--work bench-out] [--repeat 3]

Uses the Wikipedia corpus packed in docs mode (packed once into --work if missing; shared with
bench_batching.py). For each batching mode and worker count: run an epoch to 90% and save the
state; then, in fresh loaders, time (a) the first batch of a fresh epoch and (b) the first batch
after load_state_dict. The target is (b) within 2x of (a): a resume reads only the window and
shuffle block in flight, never the epoch before it. Also checks that the resumed batches equal
the uninterrupted ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_batching import ensure_docs_dataset  # noqa: E402

import wdsllm  # noqa: E402

MODES = {
    "fixed, batch 64": dict(batch_size=64, max_len=2048),
    "bucket, budget 65,536": dict(batching="bucket", max_tokens=65536, batch_size=None, window=10_000, max_len=2048),
    "pack 2048, batch 8": dict(batching="pack", seq_len=2048, batch_size=8, window=10_000),
}


def first_batch_seconds(make, state=None) -> float:
    loader = make()
    t0 = time.perf_counter()
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    dt = time.perf_counter() - t0
    del it
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data")
    ap.add_argument("--work", default=str(REPO / "bench-out"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    data = str(args.data or ensure_docs_dataset(Path(args.work)))
    print("| mode | workers | batches/epoch | fresh first batch | resumed at 90% | ratio | resumed == uninterrupted |")
    print("|---|---|---|---|---|---|---|")
    for name, kw in MODES.items():
        for workers in (0, 2):

            def make(workers=workers, kw=kw):
                return wdsllm.loader(data, num_workers=workers, seed=0, **kw)

            loader = make()
            total = len(loader)
            cut = int(0.9 * total)
            it = iter(loader)
            for _ in range(cut):
                next(it)
            state = loader.state_dict()
            tail_expected = [next(it) for _ in range(3)]
            del it
            fresh = statistics.median(first_batch_seconds(make) for _ in range(args.repeat))
            resumed = statistics.median(first_batch_seconds(make, state) for _ in range(args.repeat))
            check = make()
            check.load_state_dict(state)
            it = iter(check)
            tail = [next(it) for _ in range(3)]
            del it
            equal = all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(tail, tail_expected))
            print(
                f"| {name} | {workers} | {total} | {fresh * 1000:.0f} ms | {resumed * 1000:.0f} ms | "
                f"{resumed / fresh:.2f}x | {equal} |"
            )


if __name__ == "__main__":
    main()
