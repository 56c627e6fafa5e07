"""Loader speed of two revisions of wdsllm in one sitting: old and new, alternating.

    python tools/bench_ab.py --old e56b2e2 --new e63301f --data bench-out     # the #11 A/B
    python tools/bench_ab.py --old e56b2e2 --old-data old-out --data bench-out --no-check
    python tools/bench_ab.py --old c5d295e --modes all --sources local,http --workers 0,2 --rounds 2

Each revision is checked out once into a git worktree under ``bench-out/ab/`` (or taken from
``--old-tree``/``--new-tree``, on a machine without the history) and imported from there
(``PYTHONPATH``) in a fresh process per measurement. The measurements alternate old, new, old,
new ... for ``--rounds`` rounds, so that a noisy machine affects both alike; each reports the best
of ``--epochs`` (3) whole epochs after a warm-up epoch (``wdsllm.loader``, batch 64, shuffle buffer 10,000,
``max_len`` 2048 for documents; ``--workers`` 0 and 2 by default). ``--modes`` picks the batching
modes (fixed docs batches, length buckets of a batch size or a token budget, pack and concat rows
over documents, packed rows; ``all`` for every one), ``--sources`` local files, an HTTP server of
the test fixtures (a process of its own, serving ``--data``), or both. Each measurement also
reports the CPU seconds of its process and its workers per epoch: on a shared machine they move
less than wall time. The datasets are the docs-mode and packed-mode
wiki packs of ``tools/bench_load.py`` (``DATA/wiki-docs``, ``DATA/wiki-packed``); a revision that
cannot read the current format reads ``--old-data`` (the same packs made by that revision's own
``bench_load.py``). ``--no-check`` adds the new revision with ``check_groups=False``, the reading
path without integrity checks (issue #19). Prints each revision's best tokens/s and new/old.

``--paired N`` measures differently, for a machine whose load comes and goes: per configuration
one live process per revision, warmed up once, then N pairs of measurements taken back to back
(each at least half a second of whole epochs, the order alternating within the pair), so both
revisions of a pair see the same load. It prints the median new/old ratio per wall and per CPU
second and the CPU ratio's quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
kw.update(spec["options"])
if spec["workers"]:
    kw["persistent_workers"] = True
if not spec["check"]:
    kw["check_groups"] = False
loader = wdsllm.loader(spec["data"], **kw)


def cpu_seconds():
    # CPU of this process and its live children (the workers), from /proc: psutil-free
    total = 0.0
    children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    for pid in [os.getpid()] + [int(p) for p in children]:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


if spec.get("paired"):
    # one warm-up epoch, then a measurement per "go" line: epochs until MIN_SECONDS have passed
    epoch = 0
    for batch in loader:
        pass
    print("ready", flush=True)
    for _ in sys.stdin:
        tokens, t, c, p = 0, time.perf_counter(), cpu_seconds(), time.process_time()
        while time.perf_counter() - t < 0.5:
            epoch += 1
            loader.set_epoch(epoch)
            for batch in loader:
                tokens += int(batch["lengths"].sum())
        # without workers, this process's CPU at ns resolution; with them, all from /proc (10 ms ticks)
        cpu = cpu_seconds() - c if spec["workers"] else time.process_time() - p
        print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t, "cpu": cpu}), flush=True)
    raise SystemExit(0)

best = best_cpu = None
for epoch in range(spec["epochs"] + 1):
    loader.set_epoch(epoch)
    lengths = []
    t, c = time.perf_counter(), cpu_seconds()
    for batch in loader:
        lengths.append(batch["lengths"])
    seconds, cpu = time.perf_counter() - t, cpu_seconds() - c
    tokens = sum(int(x.sum()) for x in lengths)
    if epoch and (best is None or seconds < best):
        best = seconds
    if epoch and (best_cpu is None or cpu < best_cpu):
        best_cpu = cpu
print(json.dumps({"tokens_per_s": tokens / best, "tokens_per_cpu_s": tokens / max(best_cpu, 1e-3)}))
"""
CHILD = CHILD.replace("import json, sys, time, torch", "import json, os, sys, time, torch")

#: Batching mode -> (dataset made by bench_load.py, loader options beside batch 64 and the shuffle).
MODES = {
    "docs": ("docs", {"max_len": 2048}),
    "bucket": ("docs", {"batching": "bucket", "max_len": 2048}),
    "budget": ("docs", {"batching": "bucket", "max_tokens": 65536, "batch_size": None, "max_len": 2048}),
    "pack": ("docs", {"batching": "pack", "seq_len": 2048, "batch_size": 8}),
    "concat": ("docs", {"batching": "concat", "seq_len": 2048, "batch_size": 8}),
    "packed": ("packed", {}),
}


def checkout(rev: str, work: Path) -> Path:
    """A worktree of ``rev`` under ``work`` (made once)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    path = work / sha[:12]
    if not path.exists():
        add = ["git", "worktree", "add", "--detach", str(path), sha]
        subprocess.run(add, cwd=REPO, check=True, capture_output=True)
    return path


def _env(code: Path) -> dict:
    """The environment a revision's child runs in: its tree first on PYTHONPATH, the caller's after."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])))


def measure(code: Path, root: str, mode: str, workers: int, check: bool, epochs: int = 3) -> dict:
    """tokens/s and tokens per CPU second of one configuration, in a fresh process."""
    kind, options = MODES[mode]
    spec = {"data": f"{root}/wiki-{kind}", "options": options, "workers": workers, "check": check, "epochs": epochs}
    env = _env(code)
    # run in the revision's tree: `python -c` puts the working directory before PYTHONPATH
    cmd = [sys.executable, "-c", CHILD, json.dumps(spec)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=code)
    if out.returncode:
        raise SystemExit(f"{code} {mode} {workers} workers failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(code: Path, root: str, mode: str, workers: int) -> subprocess.Popen:
    """A paired-mode child: loads, runs a warm-up epoch, then measures once per line it reads."""
    kind, options = MODES[mode]
    spec = {"data": f"{root}/wiki-{kind}", "options": options, "workers": workers, "check": True, "paired": True}
    cmd = [sys.executable, "-c", CHILD, json.dumps(spec)]
    proc = subprocess.Popen(cmd, env=_env(code), cwd=code, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"{code} {mode} {workers} workers failed to start")
    return proc


def paired(trees: tuple[Path, Path], roots: tuple[str, str], mode: str, workers: int, pairs: int) -> dict:
    """new/old ratios of tokens per wall and per CPU second, one per pair of measurements taken
    back to back by two live processes (the order alternating), so that both see the same load."""
    procs = [_child(code, root, mode, workers) for code, root in zip(trees, roots)]
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    try:
        for i in range(pairs):
            got: list[dict] = [{}, {}]
            for side in (0, 1) if i % 2 == 0 else (1, 0):
                procs[side].stdin.write("go\n")
                procs[side].stdin.flush()
                got[side] = json.loads(procs[side].stdout.readline())
            old, new = got
            ratios["wall"].append((new["tokens"] / new["seconds"]) / (old["tokens"] / old["seconds"]))
            ratios["cpu"].append((new["tokens"] / max(new["cpu"], 1e-3)) / (old["tokens"] / max(old["cpu"], 1e-3)))
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)
    return ratios


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def http_root(data: Path):
    """(server process, URL of ``data``) from the test fixtures' HTTP server, as bench_remote runs it."""
    sys.path.insert(0, str(REPO / "tools"))
    from bench_remote import start_server

    proc, url = start_server("http", str(data))
    return proc, url


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git revision measured first in each pair")
    ap.add_argument("--new", default="HEAD", help="git revision measured second [HEAD]")
    ap.add_argument("--data", default="bench-out", help="where bench_load.py put its wiki packs")
    ap.add_argument("--old-data", help="packs the old revision can read [--data]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="measured epochs per process, after a warm-up one [3]")
    ap.add_argument("--old-tree", help="a directory holding the old revision's wdsllm/ (no git checkout)")
    ap.add_argument("--new-tree", help="likewise for the new revision")
    ap.add_argument(
        "--paired", type=int, metavar="N", help="N paired measurements per configuration instead of --rounds"
    )
    ap.add_argument("--no-check", action="store_true", help="also the new revision with check_groups=False")
    ap.add_argument("--modes", default="docs,packed", help=f"comma list of {','.join(MODES)}, or all [docs,packed]")
    ap.add_argument("--sources", default="local", help="comma list of local, http [local]")
    ap.add_argument("--workers", default="0,2", help="comma list of DataLoader worker counts [0,2]")
    args = ap.parse_args(argv)
    modes = list(MODES) if args.modes == "all" else args.modes.split(",")
    workers_list = [int(w) for w in args.workers.split(",")]
    sources = args.sources.split(",")
    configs = [(m, w, s) for s in sources for w in workers_list for m in modes]
    work = REPO / "bench-out" / "ab"
    work.mkdir(parents=True, exist_ok=True)
    old = Path(args.old_tree).resolve() if args.old_tree else checkout(args.old, work)
    new = Path(args.new_tree).resolve() if args.new_tree else checkout(args.new, work)
    data = Path(args.data).resolve()
    old_data = Path(args.old_data).resolve() if args.old_data else data
    servers, roots = [], {"local": (str(old_data), str(data))}
    if "http" in sources:
        # one server serves both revisions' packs: --old-data must then sit inside --data
        proc, url = http_root(data)
        servers.append(proc)
        old_rel = os.path.relpath(old_data, data)
        roots["http"] = (url if old_rel == "." else f"{url}/{old_rel}", url)
    try:
        if args.paired:
            run_paired(args, configs, (old, new), roots)
        else:
            run_rounds(args, configs, (old, new), roots)
    finally:
        for proc in servers:
            proc.stdin.close()
            proc.wait(timeout=10)
    print(f"load average {os.getloadavg()[0]:.2f}")


def run_paired(args, configs: list, trees: tuple[Path, Path], roots: dict) -> None:
    print(f"\n| config | new / old per wall s | per CPU s | CPU quartiles ({args.paired} pairs) |")
    print("|---|---|---|---|")
    for mode, workers, source in configs:
        ratios = paired(trees, roots[source], mode, workers, args.paired)
        _, wall, _ = quartiles(ratios["wall"])
        q1, cpu, q3 = quartiles(ratios["cpu"])
        print(f"| {source} {mode}, {workers} workers | {wall:.2f}x | {cpu:.2f}x | {q1:.2f}-{q3:.2f} |", flush=True)


def run_rounds(args, configs: list, trees: tuple[Path, Path], roots: dict) -> None:
    old, new = trees
    variants = [("old", old, 0, True), ("new", new, 1, True)]
    if args.no_check:
        variants.append(("new, unchecked", new, 1, False))
    best: dict[tuple, dict] = {}
    for r in range(args.rounds):
        for mode, workers, source in configs:
            for name, code, side, check in variants:
                got = measure(code, roots[source][side], mode, workers, check, args.epochs)
                key = (name, mode, workers, source)
                had = best.get(key, {"tokens_per_s": 0.0, "tokens_per_cpu_s": 0.0})
                best[key] = {k: max(had[k], got[k]) for k in had}
                rate = got["tokens_per_s"] / 1e6
                print(f"round {r}: {source} {mode}, {workers} workers, {name}: {rate:.1f}M tokens/s", flush=True)
    print_table(args, configs, best)


def print_table(args, configs: list, best: dict) -> None:
    extra = " unchecked / old |" if args.no_check else ""
    print(f"\n| config | old ({args.old}) | new ({args.new}) | new / old | new / old per CPU s |{extra}")
    print("|---|---|---|---|---|" + ("---|" if args.no_check else ""))
    for mode, workers, source in configs:
        o, n = best[("old", mode, workers, source)], best[("new", mode, workers, source)]
        wall = n["tokens_per_s"] / o["tokens_per_s"]
        cpu = n["tokens_per_cpu_s"] / o["tokens_per_cpu_s"]
        row = f"| {source} {mode}, {workers} workers | {o['tokens_per_s'] / 1e6:.1f}M | {n['tokens_per_s'] / 1e6:.1f}M"
        row += f" | {wall:.2f}x | {cpu:.2f}x |"
        if args.no_check:
            row += f" {best[('new, unchecked', mode, workers, source)]['tokens_per_s'] / o['tokens_per_s']:.2f}x |"
        print(row)


if __name__ == "__main__":
    main()
