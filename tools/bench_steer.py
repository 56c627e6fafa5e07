"""What steering costs on a large mixture: ``set_weights`` and ``exclude`` while a run trains.

    python tools/bench_steer.py --sources 1000 --docs 100000000        # the issue's scale (#42)
    python tools/bench_steer.py --sources 100 --docs 1000000 --workers 2

A mixture of ``--sources`` synthetic sources holding ``--docs`` documents in all (each source
hardlinked shards of one real wiki shard, ``tools/scale_data.py``; built once under ``--work``) is
read by ``wdsllm.loader`` (documents, batch 64, shuffle blocks of ``--shuffle-buffer``). After a
warm-up the script times a normal step (the median of ``--steps``), then each change made while
the run trains: the call itself (wall and this process's CPU seconds) and the wait for the batch
of the step it takes effect at, as a multiple of a normal step. With ``--horizon H`` (the
loader's ``steer_horizon``) a change takes effect H steps after the call and is re-planned
meanwhile in the background; ``--step-ms`` then stands for the trainer's own work each step (a
sleep, as a GPU step leaves the CPU), so the wait is what a trainer would see. The table also
gives the longest wait of the steps between the call and the change. One torch thread. Prints a
table and, with ``--json``, the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


def base_shard(work: Path) -> Path:
    """One real docs-mode shard of wiki documents (the unit every source repeats)."""
    from wdsllm.pack.job import PackConfig, pack

    base = work / "base"
    if not (base / "index.json").exists():
        wiki = sorted((REPO.parent / "shared" / "data" / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))[0]
        pack(PackConfig(inputs=[str(wiki)], output=str(base), tokenizer=str(tokenizer()), shard_size=1 << 40))
    return base


def tokenizer() -> Path:
    return REPO.parent / "shared" / "data" / "tokenizers" / "gpt2.json"


def sources(work: Path, count: int, docs: int) -> dict[str, str]:
    """``count`` sources of about ``docs / count`` documents each (built once)."""
    import scale_data

    from wdsllm import format as fmt

    base = base_shard(work)
    per_shard = fmt.Index.from_json((base / "index.json").read_text()).documents
    shards = max(1, -(-docs // count // per_shard))
    out = {}
    for i in range(count):
        root = work / f"n{docs}-s{count}" / f"src{i:05d}"
        if not (root / "index.json").exists():
            scale_data.build(str(base), str(root), shards)
        out[f"src{i:05d}"] = str(root)
    return out


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def measure(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    import wdsllm

    torch.set_num_threads(1)
    work = Path(args.work)
    roots = sources(work, args.sources, args.docs)
    names = sorted(roots)
    mix = wdsllm.Mixture(roots, weights={n: 1.0 for n in names}, unit="items", epoch_items=args.epoch_items)
    options = dict(batch_size=64, seed=0, num_workers=args.workers, shuffle_buffer=args.shuffle_buffer)
    loader, opened, _ = timed(lambda: wdsllm.loader(mix, steer_horizon=args.horizon, **options))
    it = iter(loader)
    first = timed(lambda: next(it))[1]

    def step() -> float:
        """One step: the wait for the batch (returned), then the trainer's own work."""
        wait = timed(lambda: next(it))[1]
        time.sleep(args.step_ms / 1e3)
        return wait

    for _ in range(args.warmup):
        step()
    normal = statistics.median(step() for _ in range(args.steps))
    rng = np.random.default_rng(0)
    rows = {}
    weights = dict(zip(names, rng.dirichlet(np.ones(len(names))).tolist()))
    changes = [
        ("set_weights", lambda: loader.set_weights(weights)),
        ("exclude a source", lambda: loader.exclude(sources=[names[-1]])),
        ("exclude 1,000 documents", lambda: loader.exclude(docs=[(1 << 32) + k for k in range(1000)])),
    ]
    for label, change in changes:
        at, wall, cpu = timed(change)
        before = [step() for _ in range(at - loader.planned_step)]
        wait = step()
        after = statistics.median(step() for _ in range(5))
        rows[label] = {
            "call_s": wall,
            "call_cpu_s": cpu,
            "horizon_max_wait_s": max(before, default=0.0),
            "next_batch_s": wait,
            "next_over_step": (wait + args.step_ms / 1e3) / (normal + args.step_ms / 1e3),
            "steps_after_s": after,
            "made_ahead": loader.metrics().get("steer_replans_ahead", 0.0),
        }
    loader.close()
    return {
        "sources": args.sources,
        "docs": args.docs,
        "workers": args.workers,
        "open_s": opened,
        "first_batch_s": first,
        "step_s": normal,
        "horizon": args.horizon,
        "step_ms": args.step_ms,
        "changes": rows,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=int, default=100)
    ap.add_argument("--docs", type=int, default=1_000_000, help="documents in all the sources together")
    ap.add_argument("--epoch-items", type=int, default=None, help="the mixture's epoch [all the documents]")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument(
        "--shuffle-buffer",
        type=int,
        default=100_000,
        help="items a shuffle block (a plan holds a row per block and source)",
    )
    ap.add_argument("--horizon", type=int, default=0, help="the loader's steer_horizon (0: at the next step)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="the trainer's own work a step (slept)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--work", default=str(REPO / "bench-out" / "steer"))
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    out = measure(args)
    print(
        f"{args.sources:,} sources, {args.docs:,} documents, {args.workers} workers: opened in "
        f"{out['open_s']:.2f} s, first batch {out['first_batch_s']:.2f} s, a batch's wait "
        f"{out['step_s'] * 1e3:.1f} ms (+ {args.step_ms:g} ms of training a step), horizon {args.horizon}"
    )
    print(
        f"{'change':<26} {'call s':>8} {'call CPU s':>11} {'max wait before s':>18} {'its step s':>11} "
        f"{'x a step':>9} {'made ahead':>11}"
    )
    for label, row in out["changes"].items():
        print(
            f"{label:<26} {row['call_s']:>8.3f} {row['call_cpu_s']:>11.3f} {row['horizon_max_wait_s']:>18.3f} "
            f"{row['next_batch_s']:>11.3f} {row['next_over_step']:>9.1f} {row['made_ahead']:>11.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
