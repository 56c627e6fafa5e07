"""Workers that scale with cores, and ranks that share a machine: ``tools/bench_load.py --workers
0,1,2,4,8 --ranks 8`` (issue #44).

- Workers: for each count, ``wdsllm.loader`` in a process of its own with persistent workers
  (``bench_load.loader_result``): a warm-up pass whose first batch includes starting the
  workers ("cold"), then the best of ``--repeat`` passes (tokens/s, "warm" first batch).
- Ranks: N processes at once, one per rank (``rank=r, world_size=N``, 1 worker each), as the
  ranks of an N-GPU node: each makes a warm-up pass, waits until every rank has, then all make
  ``--repeat`` passes together; their tokens over the wall time of the slowest is the node's
  rate, against one rank alone (world size 1, 1 worker) measured the same way.

Configurations (``--scaling``): ``docs`` (documents padded into batches of 64, max_len 2,048,
shuffled) and ``pack`` (documents packed into rows of 2,048, 16 rows a batch: the GPU benchmark's
batching) over the docs-mode wiki pack; ``packed`` (rows of a packed-mode pack, batches of 64).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHUFFLE = {"shuffle": True, "shuffle_buffer": 10_000, "seed": 0}
CONFIGS = {  # name -> (pack mode of the data, loader options)
    "docs": ("docs", {"batch_size": 64, "max_len": 2048, **SHUFFLE}),
    "pack": ("docs", {"batching": "pack", "seq_len": 2048, "batch_size": 16, **SHUFFLE}),
    "packed": ("packed", {"batch_size": 64, **SHUFFLE}),
}


def run_rank(spec: dict) -> dict:
    """Runs in a rank's process: a warm-up pass, the barrier, then ``repeat`` passes."""
    import torch

    import wdsllm

    torch.set_num_threads(spec["torch_threads"])
    loader = wdsllm.loader(
        spec["data"],
        rank=spec["rank"],
        world_size=spec["world"],
        num_workers=1,
        persistent_workers=True,
        **spec["options"],
    )
    for _ in loader:  # warm-up: workers started, files mapped
        pass
    Path(spec["ready"]).touch()
    while not os.path.exists(spec["go"]):
        time.sleep(0.005)
    began = time.perf_counter()
    lengths = []
    for epoch in range(1, 1 + spec["repeat"]):
        loader.set_epoch(epoch)
        lengths += [batch["lengths"] for batch in loader]
    seconds = time.perf_counter() - began
    loader.close()
    return {"tokens": int(torch.cat(lengths).sum()), "seconds": seconds, "ended": time.time()}


def ranks_together(data: str, options: dict, ranks: int, args) -> dict:
    """``ranks`` processes at once: their tokens over the wall time from the go to the last end."""
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        go = os.path.join(tmp, "go")
        procs = []
        for rank in range(ranks):
            spec = {
                "data": data,
                "rank": rank,
                "world": ranks,
                "options": options,
                "repeat": args.repeat,
                "torch_threads": args.torch_threads,
                "ready": os.path.join(tmp, f"ready-{rank}"),
                "go": go,
            }
            cmd = [sys.executable, str(Path(__file__).with_name("bench_load.py")), "--rank-child", json.dumps(spec)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        while not all(os.path.exists(os.path.join(tmp, f"ready-{r}")) for r in range(ranks)):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.01)
        start = time.time()
        Path(go).touch()
        results = []
        for p in procs:
            out, err = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"a rank failed:\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    wall = max(r["ended"] for r in results) - start
    tokens = sum(r["tokens"] for r in results)
    return {"ranks": ranks, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def measure(args, work: str) -> list[dict]:
    """Every configuration asked, at every worker count, and N ranks against one."""
    import bench_load

    rows = []
    workers = [int(w) for w in args.workers.split(",") if w] if args.workers else []
    for name in [c for c in args.scaling.split(",") if c]:
        mode, options = CONFIGS[name]
        data = bench_load.pack_corpus(work, args.quick, mode)
        for count in workers:
            r = bench_load.loader_result(f"{name}, {count} workers", mode, data, count, options, args)
            rows.append(
                {
                    "config": name,
                    "workers": count,
                    "tokens_per_s": r.tokens_per_s,
                    "first_batch_cold_s": r.first_batch_cold_s,
                    "first_batch_s": r.first_batch_s,
                }
            )
            print(f"  {name}, {count} workers: {r.tokens_per_s / 1e6:,.1f}M tokens/s", flush=True)
        if args.ranks:
            one = ranks_together(data, options, 1, args)
            many = ranks_together(data, options, args.ranks, args)
            rows.append({"config": name, "one_rank": one, "ranks_together": many})
            print(f"  {name}, {args.ranks} ranks: {many['tokens_per_s'] / one['tokens_per_s']:.2f}x one", flush=True)
    return rows


def tables(rows: list[dict]) -> str:
    out = ["| configuration | workers | tokens/s | vs 1 worker | first batch cold / warm |", "|---|---|---|---|---|"]
    by_one = {r["config"]: r["tokens_per_s"] for r in rows if r.get("workers") == 1}
    for r in rows:
        if "workers" not in r:
            continue
        one = by_one.get(r["config"])
        ratio = f"{r['tokens_per_s'] / one:.2f}x" if one else ""
        first = f"{r['first_batch_cold_s'] * 1e3:.0f} / {r['first_batch_s'] * 1e3:.0f} ms"
        out.append(f"| {r['config']} | {r['workers']} | {r['tokens_per_s'] / 1e6:,.1f}M | {ratio} | {first} |")
    ranks = [r for r in rows if "ranks_together" in r]
    if ranks:
        out += ["", "| configuration | one rank (1 worker) | ranks at once (1 worker each) | together vs one |"]
        out.append("|---|---|---|---|")
        for r in ranks:
            one, many = r["one_rank"], r["ranks_together"]
            out.append(
                f"| {r['config']} | {one['tokens_per_s'] / 1e6:,.1f}M tokens/s | {many['ranks']} ranks: "
                f"{many['tokens_per_s'] / 1e6:,.1f}M tokens/s | {many['tokens_per_s'] / one['tokens_per_s']:.2f}x |"
            )
    return "\n".join(out)


def main(args) -> list[dict]:
    """``bench_load.py --workers/--ranks`` (and a rank's own process, ``--rank-child``)."""
    if args.rank_child:
        print(json.dumps(run_rank(json.loads(args.rank_child))))
        return []
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"worker scaling on {os.cpu_count()} cores (load {load}); torch threads {args.torch_threads}", flush=True)
    rows = measure(args, args.work)
    print()
    print(tables(rows))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows
