"""Loader speed of two revisions of wdsllm in one sitting: old and new, alternating.

    python tools/bench_ab.py --old e56b2e2 --new e63301f --data bench-out     # the #11 A/B
    python tools/bench_ab.py --old e56b2e2 --old-data old-out --data bench-out --no-check

Each revision is checked out once into a git worktree under ``bench-out/ab/`` and imported from
there (``PYTHONPATH``) in a fresh process per measurement. The measurements alternate old, new,
old, new ... for ``--rounds`` rounds, so that a noisy machine affects both alike; each reports the
best of 3 whole epochs after a warm-up epoch (``wdsllm.loader``, batch 64, shuffle buffer 10,000,
``max_len`` 2048 for documents, 0 and 2 workers). The datasets are the docs-mode and packed-mode
wiki packs of ``tools/bench_load.py`` (``DATA/wiki-docs``, ``DATA/wiki-packed``); a revision that
cannot read the current format reads ``--old-data`` (the same packs made by that revision's own
``bench_load.py``). ``--no-check`` adds the new revision with ``check_groups=False``, the reading
path without integrity checks (issue #19). Prints each revision's best tokens/s and new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
spec = json.loads(sys.argv[1])
import wdsllm
kw = dict(batch_size=64, shuffle_buffer=10000, seed=0, num_workers=spec["workers"])
if spec["mode"] == "docs":
    kw["max_len"] = 2048
if spec["workers"]:
    kw["persistent_workers"] = True
if not spec["check"]:
    kw["check_groups"] = False
loader = wdsllm.loader(spec["data"], **kw)
best = None
for epoch in range(4):
    loader.set_epoch(epoch)
    lengths = []
    t = time.perf_counter()
    for batch in loader:
        lengths.append(batch["lengths"])
    seconds = time.perf_counter() - t
    tokens = sum(int(x.sum()) for x in lengths)
    if epoch and (best is None or seconds < best):
        best = seconds
print(json.dumps({"tokens_per_s": tokens / best}))
"""

CONFIGS = [("docs", 0), ("packed", 0), ("docs", 2), ("packed", 2)]


def checkout(rev: str, work: Path) -> Path:
    """A worktree of ``rev`` under ``work`` (made once)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    path = work / sha[:12]
    if not path.exists():
        add = ["git", "worktree", "add", "--detach", str(path), sha]
        subprocess.run(add, cwd=REPO, check=True, capture_output=True)
    return path


def measure(code: Path, data: Path, mode: str, workers: int, check: bool) -> float:
    spec = {"data": str(data / f"wiki-{mode}"), "mode": mode, "workers": workers, "check": check}
    env = dict(os.environ, PYTHONPATH=str(code))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{code} {mode} {workers} workers failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git revision measured first in each pair")
    ap.add_argument("--new", default="HEAD", help="git revision measured second [HEAD]")
    ap.add_argument("--data", default="bench-out", help="where bench_load.py put its wiki packs")
    ap.add_argument("--old-data", help="packs the old revision can read [--data]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="also the new revision with check_groups=False")
    args = ap.parse_args(argv)
    work = REPO / "bench-out" / "ab"
    work.mkdir(parents=True, exist_ok=True)
    old, new = checkout(args.old, work), checkout(args.new, work)
    data = Path(args.data).resolve()
    old_data = Path(args.old_data).resolve() if args.old_data else data
    variants = [("old", old, old_data, True), ("new", new, data, True)]
    if args.no_check:
        variants.append(("new, unchecked", new, data, False))
    best: dict[tuple[str, str, int], float] = {}
    for r in range(args.rounds):
        for mode, workers in CONFIGS:
            for name, code, where, check in variants:
                rate = measure(code, where, mode, workers, check)
                key = (name, mode, workers)
                best[key] = max(best.get(key, 0.0), rate)
                print(f"round {r}: {mode}, {workers} workers, {name}: {rate / 1e6:.1f}M tokens/s", flush=True)
    extra = " unchecked / old |" if args.no_check else ""
    print(f"\n| config | old ({args.old}) | new ({args.new}) | new / old |{extra}")
    print("|---|---|---|---|" + ("---|" if args.no_check else ""))
    for mode, workers in CONFIGS:
        o, n = best[("old", mode, workers)], best[("new", mode, workers)]
        row = f"| {mode}, {workers} workers | {o / 1e6:.1f}M | {n / 1e6:.1f}M | {n / o:.2f}x |"
        if args.no_check:
            row += f" {best[('new, unchecked', mode, workers)] / o:.2f}x |"
        print(row)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
