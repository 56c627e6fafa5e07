#!/usr/bin/env python
"""Start-up cost and memory of the loader as the corpus grows (issue #16).

Builds, once, a synthetic docs-mode dataset of N hardlinked copies of one real shard (the wiki
files wiki-00 and wiki-01 packed with the GPT-2 tokenizer: 24,959 documents, 6.9 MB) with
``tools/scale_data.py``: a consistent format-4 index, ``lengths.npy`` (uint32), ``groups.npy``
and, beyond 10,000 shards, ``shards.npy``, written a chunk at a time. N is chosen to reach
``--docs`` documents (1e9: 40,066 shards, a 3.7 GiB lengths.npy). Datasets are kept under
``--work``; reruns reuse them.

Then, each in a fresh process (with a fresh temporary directory, so no count cached by another
run is found), for rank 0 of every world size and worker count asked for, in every batching mode:

- time to first batch: from constructing ``wdsllm.loader(...)`` to receiving its first batch;
- peak RSS of the main process and of the largest DataLoader worker (VmHWM; a forked worker's
  RSS counts the pages it shares with its parent, so the worker's private memory, sampled, is
  shown too);
- with ``--exact``, also when the exact equal-batches decision was known (the token-budget and
  pack counts run in the background after the first batch) and the peak RSS by then;

plus ``wdsllm stats``, ``wdsllm info`` and ``wdsllm verify`` (wall time, peak RSS), and
optionally how long reading an index of many shard entries takes (``--index-parse``; in JSON as
format 4 keeps up to 10,000 shards, and from ``shards.npy`` beyond).

Every measurement has a time limit (``--timeout``; shown as "> T s") and a memory cap
(``--mem-cap``, default 7.5 GiB over the measured process tree, plus RLIMIT_DATA in the measured
process). Nothing runs in parallel, but the machine may be shared: the load average is printed.

    python tools/bench_scale.py                          # 2.5e7 documents, every mode
    python tools/bench_scale.py --docs 1e9 --exact       # the issue's targets
    python tools/bench_scale.py --docs 1e9 --modes fixed --no-cli
    python tools/bench_scale.py --build-only --docs 1e9  # just build (and time the build)
    python tools/bench_scale.py --index-parse 4e4,1e6 --no-loader --no-cli
    python tools/bench_scale.py --docs 1e7,5e6,2.5e6 --mix --modes pack --worlds 8 --workers 2 --exact

``--mix`` measures one mixture of the datasets of ``--docs`` (weights 0.5, 0.3, 0.2, ... by tokens,
an epoch of their total) instead of each dataset alone.

``--code DIR`` puts DIR first on the measured processes' path (to measure another checkout).
``--repeat N`` runs each loader measurement N times and keeps the run of fewest CPU seconds (the
process and its workers): on a shared machine, the one the others' work disturbed least.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import itertools
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import scale_data  # noqa: E402 - the builder the test suite uses too
from scale_data import fmt  # noqa: E402

SHARED = os.environ.get("WDSLLM_SHARED", os.path.normpath(os.path.join(HERE, "..", "..", "shared", "data")))
if not os.path.isdir(SHARED):
    SHARED = "/work/shared/data"
CORPUS = [os.path.join(SHARED, "corpora", "wiki", f"wiki-0{i}.jsonl.gz") for i in (0, 1)]
TOKENIZER = os.path.join(SHARED, "tokenizers", "gpt2.json")

MODES = {
    "fixed": {"batching": "fixed", "batch_size": 32},
    "bucket": {"batching": "bucket", "batch_size": 32},
    "budget": {"batching": "bucket", "batch_size": None, "max_tokens": 65536},
    "pack": {"batching": "pack", "seq_len": 2048, "batch_size": 8},
    "concat": {"batching": "concat", "seq_len": 2048, "batch_size": 8},
}
MODE_LABEL = {
    "fixed": "fixed 32",
    "bucket": "bucket, batch 32",
    "budget": "bucket, budget 65536",
    "pack": "pack 2048 x 8",
    "concat": "concat 2048 x 8",
}
GiB = 1 << 30
MiB = 1 << 20
BASE_DOCS = 24_959  # documents of the base shard (wiki-00 + wiki-01, GPT-2)


# ------------------------------------------------------------------------------------------------
# Building the dataset


def python_env(code: str | None, tmpdir: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if code:
        env["PYTHONPATH"] = os.path.abspath(code)
    if tmpdir:
        env["TMPDIR"] = tmpdir
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def pack_base(work: str, code: str | None, docs: int | None = None) -> str:
    """The one real shard everything is copied from (packed once): the wiki files wiki-00 and
    wiki-01, or (``docs``) the first ``docs`` documents of wiki-00."""
    base = os.path.join(work, "base" if docs is None else f"base-{docs}")
    if os.path.exists(os.path.join(base, "index.json")):
        with open(os.path.join(base, "index.json")) as f:
            if json.load(f).get("version") == fmt.FORMAT_VERSION:
                return base
    if os.path.exists(base):
        shutil.rmtree(base)
    inputs = CORPUS
    if docs is not None:
        inputs = [os.path.join(work, f"wiki-first-{docs}.jsonl")]
        with gzip.open(CORPUS[0], "rt") as src, open(inputs[0], "w") as out:
            out.writelines(itertools.islice(src, docs))
    cmd = [sys.executable, "-m", "wdsllm.cli", "pack", *inputs, "-o", base, "-t", TOKENIZER, "-q", "--overwrite"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=python_env(code))
    with open(os.path.join(base, "index.json")) as f:
        totals = json.load(f)["totals"]
    if totals["shards"] != 1:
        raise SystemExit(f"{base}: expected one shard, got {totals['shards']}")
    print(f"packed the base shard in {time.perf_counter() - t0:.1f} s: {totals}", file=sys.stderr)
    return base


def build_dataset(work: str, docs: float, code: str | None) -> tuple[str, dict]:
    """The synthetic dataset for about ``docs`` documents (kept): (root, build info)."""
    base = pack_base(work, code)
    n = max(1, round(docs / BASE_DOCS))
    root = os.path.join(work, f"docs-{n}")
    return root, scale_data.build(base, root, n)


def build_shards(work: str, shards: int, shard_docs: int, code: str | None) -> tuple[str, dict]:
    """The synthetic dataset of ``shards`` copies of a shard of ``shard_docs`` documents (kept)."""
    base = pack_base(work, code, shard_docs)
    root = os.path.join(work, f"shards-{shards}-of-{shard_docs}")
    return root, scale_data.build(base, root, shards)


# ------------------------------------------------------------------------------------------------
# Measuring one process tree


def _read_kv(path: str) -> dict:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(":")
                parts = v.split()
                if parts and parts[0].isdigit():
                    out[k] = int(parts[0]) * 1024  # kB
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _tree(pgid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid:  # process group
            pids.append(int(d))
    return pids


def run_measured(cmd: list[str], *, timeout: float, cap: int, env: dict, poll: float = 0.1) -> dict:
    """Run ``cmd`` in a new session; watch its process tree's memory; kill it past ``timeout``
    seconds or ``cap`` bytes. Returns status, wall time, the child's JSON line (if any), its
    stderr tail, and per-process peaks (VmHWM; private memory sampled)."""
    out_f = tempfile.TemporaryFile()  # noqa: SIM115 - read back after the process ends
    err_f = tempfile.TemporaryFile()  # noqa: SIM115
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=env, start_new_session=True)
    peaks: dict[int, dict] = {}
    verdict = None
    status = 0
    k = 0
    while True:
        pid, status, _ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        k += 1
        total_anon = 0
        big = 0
        for q in _tree(p.pid):
            st = _read_kv(f"/proc/{q}/status")
            if not st:
                continue
            rec = peaks.setdefault(q, {"hwm": 0, "private": 0, "main": q == p.pid})
            rec["hwm"] = max(rec["hwm"], st.get("VmHWM", 0), st.get("VmRSS", 0))
            total_anon += st.get("RssAnon", 0) + st.get("RssShmem", 0)
            big = max(big, st.get("VmRSS", 0))
            if not rec["main"] or k % 5 == 0:
                sm = _read_kv(f"/proc/{q}/smaps_rollup")
                rec["private"] = max(rec["private"], sm.get("Private_Clean", 0) + sm.get("Private_Dirty", 0))
        over = big > cap
        if not over and total_anon > cap:  # forked workers share pages: count them once (PSS)
            pss = sum(_read_kv(f"/proc/{q}/smaps_rollup").get("Pss", 0) for q in _tree(p.pid))
            over = pss > cap
        elapsed = time.perf_counter() - t0
        if over or elapsed > timeout:
            verdict = "mem" if over else "timeout"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            _, status, _rusage = os.wait4(p.pid, 0)
            time.sleep(0.2)  # let the workers die too
            break
        time.sleep(poll)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    out_f.seek(0)
    err_f.seek(0)
    stdout = out_f.read().decode(errors="replace")
    stderr = err_f.read().decode(errors="replace")
    result = None
    for line in stdout.splitlines()[::-1]:
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except ValueError:
                pass
    if verdict is None:
        verdict = "ok" if p.returncode == 0 else "error"
    if verdict == "error" and ("MemoryError" in stderr or "Unable to allocate" in stderr):
        verdict = "mem"  # RLIMIT_DATA refused an allocation past the cap
    # (wait4's ru_maxrss would include reaped grandchildren: use the process's own figures)
    main_hwm = max([r["hwm"] for r in peaks.values() if r["main"]] + [(result or {}).get("maxrss_self", 0)])
    workers = [r for r in peaks.values() if not r["main"]]
    if result and result.get("maxrss_children"):
        worker_hwm = max([r["hwm"] for r in workers] + [result["maxrss_children"]])
    else:
        worker_hwm = max([r["hwm"] for r in workers], default=0)
    return {
        "status": verdict,
        "returncode": p.returncode,
        "wall": wall,
        "result": result,
        "stdout_tail": stdout[-2000:],
        "fail_lines": sum(1 for line in stdout.splitlines() if line.startswith("FAIL ")),
        "duplicate_key_lines": sum(1 for line in stdout.splitlines() if re.match(r"FAIL key \S+ is in both ", line)),
        "stderr_tail": stderr[-2000:],
        "main_peak": main_hwm,
        "worker_peak": worker_hwm,
        "worker_private": max([r["private"] for r in workers], default=0),
        "workers_seen": len(workers),
    }


def _limit_memory(cap: int) -> None:
    """In the measured process: allocations past the cap fail (RLIMIT_DATA counts private
    writable mappings, what numpy allocates), so a runaway measurement raises MemoryError."""
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))


def cpu_seconds() -> float:
    """CPU seconds of this process, every thread of it."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def children_cpu_seconds() -> float:
    """CPU seconds of this process's live children (its DataLoader workers) so far."""
    total = 0
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
                pids = f.read().split()
            for pid in pids:
                with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def child_loader(spec: dict) -> None:
    """Runs in the measured process: time to first batch for one configuration (and, with
    ``exact``, until the exact equal-batches decision is known)."""
    _limit_memory(spec["cap"])
    import multiprocessing as mp

    import torch

    torch.set_num_threads(1)
    import wdsllm
    import wdsllm.load.loader  # imported before the clock starts, as a training script has it

    t = time.perf_counter
    base_rss = _read_kv("/proc/self/status").get("VmRSS", 0)
    opts = dict(MODES[spec["mode"]])
    if spec.get("context"):
        opts["multiprocessing_context"] = spec["context"]
    gc.collect()
    t0, cpu0 = t(), cpu_seconds()
    source = spec["root"]
    if isinstance(source, dict):  # a mixture: {name: root}
        source = wdsllm.Mixture(source, weights=dict(zip(source, spec["weights"])))
    ld = wdsllm.loader(source, rank=spec["rank"], world_size=spec["world"], num_workers=spec["workers"], seed=0, **opts)
    t1 = t()
    it = iter(ld)
    batch = next(it)
    t2, cpu2, workers_cpu = t(), cpu_seconds(), children_cpu_seconds()
    limits = ld.limits
    out = {
        "construct_s": t1 - t0,
        "first_batch_s": t2 - t0,
        "first_batch_cpu_s": cpu2 - cpu0,
        "workers_cpu_s": workers_cpu,
        "base_rss": base_rss,
        "first_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "bound": limits.per_rank_bound if limits is not None else None,
        "exact_at_first": bool(limits is not None and limits.ready()),
        "shape": list(batch["input_ids"].shape),
        "wdsllm": os.path.dirname(wdsllm.__file__),
    }
    if spec.get("exact") and limits is not None:
        per_rank = limits.per_rank  # waits for the background count
        out["exact_s"] = t() - t0
        out["per_rank"] = per_rank
    elif limits is not None and limits.ready():
        out["per_rank"] = limits.per_rank
    out["maxrss_self"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    it.close()
    del it, batch
    ld._dataloader = None
    gc.collect()
    deadline = t() + 20
    while mp.active_children() and t() < deadline:
        time.sleep(0.05)
    out["maxrss_children"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps(out), flush=True)


def child_cli(spec: dict) -> None:
    """Runs in the measured process: one wdsllm CLI command, in process (same memory cap)."""
    _limit_memory(spec["cap"])
    from wdsllm.cli import main

    t0 = time.perf_counter()
    code = 0
    try:
        main(spec["args"])  # the `wdsllm` command's own entry point (exits with its status)
    except SystemExit as exc:
        code = exc.code or 0
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    out = {
        "wall_s": time.perf_counter() - t0,
        "exit": code,
        "maxrss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    sys.stdout.flush()
    print("\n" + json.dumps(out), flush=True)


def child_index_parse(spec: dict) -> None:
    """Runs in the measured process: read an index of many shard entries (JSON or shards.npy)."""
    _limit_memory(spec["cap"])
    import tracemalloc

    from wdsllm import format as fmt

    root = spec["root"]
    rss0 = _read_kv("/proc/self/status").get("VmRSS", 0)
    t0 = time.perf_counter()
    index, _ = fmt.read_index(root)
    t1 = time.perf_counter()
    totals = index.totals()
    items = index.items_per_shard
    t2 = time.perf_counter()
    rss1 = _read_kv("/proc/self/status").get("VmRSS", 0)
    del index, items
    gc.collect()
    tracemalloc.start()
    index, _ = fmt.read_index(root)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    import wdsllm.load.loader  # torch imported before the clock starts

    t3 = time.perf_counter()
    # opening the loader (2 workers): the index, the settings, the plan's set-up; no shard is read
    wdsllm.load.loader.loader(root, batch_size=8, num_workers=2)
    open_loader_s = time.perf_counter() - t3
    out = {
        "read_index_s": t1 - t0,
        "totals_s": t2 - t1,
        "open_loader_s": open_loader_s,
        "bytes": os.path.getsize(os.path.join(root, fmt.INDEX_NAME)),
        "table": index.shards_file.name if index.shards_file else "index.json",
        "shards": totals["shards"],
        "rss_growth": rss1 - rss0,
        "index_held": held,
        "parse_peak": peak,
        "maxrss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps(out), flush=True)


def write_big_index(base: str, shards: int, root: str, binary: bool) -> None:
    """An index of ``shards`` packed-mode entries (just the index: no shards), its table in
    index.json or in shards.npy."""
    from wdsllm import format as fmt

    index, _ = fmt.read_index(base)
    e = index.shards[0]
    rows = e.tokens // 2048 + 1
    index.mode, index.seq_len = "packed", 2048
    index.packed = {"max_row_segments": 64, "short_rows": 1}
    columns = np.tile(index.shards.columns[0], (shards, 1))
    columns[:, 4] = rows
    columns[:, 5:] = np.random.default_rng(0).integers(-(2**62), 2**62, (shards, 4))
    index.shards = fmt.ShardTable(columns, prefix="shard")
    os.makedirs(root, exist_ok=True)
    files = index.move_shard_table(0 if binary else shards)
    if not binary:  # index.json lists every entry
        index.shards = fmt.ShardTable.of(list(index.shards))
    for name, data in files:
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
    with open(os.path.join(root, fmt.INDEX_NAME), "w") as f:
        f.write(index.to_json())


# ------------------------------------------------------------------------------------------------
# Reporting


def fmt_s(x: float) -> str:
    if x < 1:
        return f"{x:.2f} s"
    if x < 100:
        return f"{x:.1f} s"
    m, s = divmod(x, 60)
    return f"{int(m)} min {s:02.0f} s" if x < 3600 else f"{x / 3600:.1f} h"


def fmt_b(n: int) -> str:
    if not n:
        return "–"
    if n < MiB:
        return f"{n / 1024:,.0f} KiB"
    return f"{n / MiB:,.0f} MiB" if n < 10 * GiB else f"{n / GiB:.1f} GiB"


def verdict_text(r: dict, timeout: float, cap: int, what: float | None) -> str:
    if r["status"] == "timeout":
        return f"> {timeout:g} s"
    if r["status"] == "mem":
        return f"> {cap / GiB:g} GiB (stopped)"
    if r["status"] == "skipped-timeout":
        return f"> {timeout:g} s (skipped)"
    if r["status"] == "skipped-mem":
        return f"> {cap / GiB:g} GiB (skipped)"
    if r["status"] != "ok" or what is None:
        return "error"
    return fmt_s(what)


def progress_of(stderr: str) -> str:
    """The last 'k/n shards' progress a verify printed (to say how far a timed-out run got)."""
    found = re.findall(r"(\d+)/(\d+) shards", stderr)
    return f" ({found[-1][0]}/{found[-1][1]} shards)" if found else ""


def human_docs(n: float) -> str:
    e = math.floor(math.log10(n))
    m = n / 10**e
    return f"{m:.2g}e{e}" if m != 1 else f"1e{e}"


# ------------------------------------------------------------------------------------------------


def total_cpu(r: dict) -> float:
    """CPU seconds to the first batch of a measured run: its process with every thread and worker."""
    res = r.get("result") or {}
    if r["status"] != "ok" or res.get("first_batch_cpu_s") is None:
        return math.inf
    return res["first_batch_cpu_s"] + (res.get("workers_cpu_s") or 0)


def measure_repeated(args, cmd: list, cap: int) -> dict:
    """The run of ``--repeat`` that took the fewest CPU seconds (on a shared machine, the one the
    others' work disturbed least), each in a fresh process with a fresh temporary directory (no
    count cached before); the load average at its end is kept with it."""
    best = None
    for _ in range(max(1, args.repeat)):
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
            r = run_measured(cmd, timeout=args.timeout, cap=cap, env=python_env(args.code, tmp))
        r["load"] = os.getloadavg()[0]
        if best is None or total_cpu(r) < total_cpu(best):
            best = r
        if r["status"] != "ok":
            break
    return best


def measure_loader(args, root: str, info: dict, label: str, me: list, cap: int, record, rows: list) -> None:
    worlds = [int(float(w)) for w in args.worlds.split(",") if w]
    workers = [int(w) for w in args.workers.split(",") if w]
    gave_up: list = []  # (mode, workers, world, why) that ran out of time or memory
    for mode in [m for m in args.modes.split(",") if m]:
        for nw in workers:
            for world in worlds:
                spec = {
                    "kind": "loader",
                    "root": root,
                    "mode": mode,
                    "world": world,
                    "rank": 0,
                    "workers": nw,
                    "cap": cap,
                    "context": args.context,
                    "code": args.code,
                    "exact": args.exact,
                    "weights": info.get("weights"),
                }
                why = [v for m, w0, x0, v in gave_up if m == mode and nw >= w0 and world >= x0]
                if why and not args.no_skip:
                    r = {"status": "skipped-" + why[0], "main_peak": 0, "worker_peak": 0, "worker_private": 0}
                else:
                    r = measure_repeated(args, [*me, "--child", json.dumps(spec)], cap)
                    if r["status"] in ("timeout", "mem"):
                        gave_up.append((mode, nw, world, r["status"]))
                res = r.get("result") or {}
                row = {
                    "docs": info["documents"],
                    "shards": info["shards"],
                    "world": world,
                    "workers": nw,
                    "mode": mode,
                    "status": r["status"],
                    "first_batch_s": res.get("first_batch_s"),
                    "first_batch_cpu_s": res.get("first_batch_cpu_s"),
                    "workers_cpu_s": res.get("workers_cpu_s"),
                    "first_rss": res.get("first_rss"),
                    "exact_s": res.get("exact_s"),
                    "exact_at_first": res.get("exact_at_first"),
                    "main_peak": r["main_peak"],
                    "worker_peak": r["worker_peak"],
                    "worker_private": r["worker_private"],
                    "per_rank": res.get("per_rank"),
                    "bound": res.get("bound"),
                    "context": args.context,
                    "load": r.get("load", os.getloadavg()[0]),
                }
                if r["status"] == "error":
                    row["error"] = r["stderr_tail"][-600:]
                record(row)
                rows.append((label, row))
                first = verdict_text(r, args.timeout, cap, res.get("first_batch_s"))
                exact = (
                    "at once"
                    if res.get("exact_at_first")
                    else (fmt_s(res["exact_s"]) if res.get("exact_s") is not None else "-")
                )
                cpu = f"{row['first_batch_cpu_s']:.2f}" if row["first_batch_cpu_s"] is not None else "-"
                print(
                    f"{label:<24} world {world:>6} workers {nw} {MODE_LABEL[mode]:<22} first batch {first:>14} "
                    f"(CPU s {cpu})  "
                    f"exact {exact:>8}  main {fmt_b(r['main_peak']):>10}  worker {fmt_b(r['worker_peak']):>10} "
                    f"(private {fmt_b(r['worker_private'])})  batches/rank {res.get('per_rank')} "
                    f"(bound {res.get('bound')})",
                    flush=True,
                )
                if r["status"] == "error":
                    print(r["stderr_tail"][-1500:], file=sys.stderr)


def measure_shards(args, work: str, me: list, cap: int, record, rows: list) -> None:
    """The loader on datasets of the same shard, copied ``--shards`` times each: what opening a
    dataset costs as its shard count grows."""
    for count in [c for c in args.shards.split(",") if c]:
        root, info = build_shards(work, int(float(count)), args.shard_docs, args.code)
        print(
            f"# dataset {root}: {info['shards']:,} shards of {args.shard_docs} documents, {info['documents']:,} "
            f"documents; built in {info['build_s']} s{' [kept from before]' if info.get('cached') else ''}",
            flush=True,
        )
        label = f"{info['shards']:,} shards"
        if not args.build_only:
            measure_loader(args, root, info, label, me, cap, record, rows)


MIX_WEIGHTS = [0.5, 0.3, 0.2, 0.1, 0.05]


def measure_mixture(args, work: str, me: list, cap: int, record, rows: list) -> None:
    """One mixture of the --docs datasets (sources ``s0``, ``s1``, ...), weighted by tokens."""
    sizes = [float(d) for d in args.docs.split(",") if d]
    if len(sizes) > len(MIX_WEIGHTS):
        raise SystemExit(f"--mix takes at most {len(MIX_WEIGHTS)} datasets")
    roots, docs, shards = {}, 0, 0
    for i, size in enumerate(sizes):
        root, info = build_dataset(work, size, args.code)
        roots[f"s{i}"] = root
        docs, shards = docs + info["documents"], shards + info["shards"]
    weights = MIX_WEIGHTS[: len(sizes)]
    print(f"# mixture of {roots} (weights {weights} by tokens): {docs:,} documents, {shards:,} shards", flush=True)
    label = f"mix {human_docs(docs)} ({shards:,} shards)"
    measure_loader(args, roots, {"documents": docs, "shards": shards, "weights": weights}, label, me, cap, record, rows)


def measure_cli(args, root: str, info: dict, label: str, me: list, cap: int, record, rows: list) -> None:
    commands = {
        "info": ["info", root],
        "stats": ["stats", root],
        "verify": ["verify", root] + (["--jobs", str(args.verify_jobs)] if args.verify_jobs else []),
    }
    for name in [c for c in args.cli.split(",") if c]:
        spec = {"kind": "cli", "args": commands[name], "cap": cap, "code": args.code}
        r = run_measured(
            [*me, "--child", json.dumps(spec)], timeout=args.cli_timeout, cap=cap, env=python_env(args.code)
        )
        res = r.get("result") or {}
        wall = res.get("wall_s")
        if r["status"] == "ok" and res.get("exit"):
            status = f"exit {res['exit']}"
            if "Unable to allocate" in r["stderr_tail"] or "MemoryError" in r["stderr_tail"]:
                status = "mem"  # RLIMIT_DATA refused an allocation: it needs more than the cap
            if name == "verify" and r["fail_lines"] and r["fail_lines"] == r["duplicate_key_lines"]:
                status = "ok but for the copies' duplicate keys"  # hardlinked copies repeat the base's keys
        else:
            status = r["status"]
        row = {
            "docs": info["documents"],
            "shards": info["shards"],
            "command": name,
            "status": status,
            "wall_s": wall,
            "peak": r["main_peak"],
            "progress": progress_of(r["stderr_tail"]),
            "tail": (r["stdout_tail"] + r["stderr_tail"])[-1200:],
            "load": os.getloadavg()[0],
        }
        record(row)
        rows.append((label, row))
        shown = verdict_text(
            dict(r, status=status if status in ("timeout", "mem") else "ok"), args.cli_timeout, cap, wall
        )
        print(
            f"{label:<24} wdsllm {name:<7} {shown:>14}{row['progress']}  peak {fmt_b(r['main_peak'])}  [{status}]",
            flush=True,
        )
        if name == "stats" and r["status"] == "ok":
            print(r["stdout_tail"][-1200:], flush=True)


def measure_index(args, work: str, me: list, cap: int, record) -> None:
    base = pack_base(work, args.code)
    for count in [c for c in args.index_parse.split(",") if c]:
        n = int(float(count))
        for binary in (False, True):
            root = os.path.join(work, f"index-{n}-{'npy' if binary else 'json'}")
            if not os.path.exists(os.path.join(root, "index.json")):
                t0 = time.perf_counter()
                write_big_index(base, n, root, binary)
                print(f"# wrote {root} in {time.perf_counter() - t0:.1f} s", flush=True)
            spec = {"kind": "index", "root": root, "cap": cap, "code": args.code}
            r = run_measured(
                [*me, "--child", json.dumps(spec)], timeout=args.cli_timeout, cap=cap, env=python_env(args.code)
            )
            res = r.get("result") or {}
            record({"index_shards": n, "status": r["status"], **res, "peak": r["main_peak"]})
            if r["status"] == "ok":
                print(
                    f"index of {n:,} packed-shard entries, table in {res['table']} (index.json "
                    f"{fmt_b(res['bytes'])}): read_index {fmt_s(res['read_index_s'])}, totals and items per shard "
                    f"{res['totals_s'] * 1e3:.0f} ms, wdsllm.loader(num_workers=2) opened in "
                    f"{fmt_s(res['open_loader_s'])}; the index holds {fmt_b(res['index_held'])}, reading it peaks at "
                    f"{fmt_b(res['parse_peak'])}, process peak {fmt_b(r['main_peak'])}",
                    flush=True,
                )
            else:
                print(f"index of {n:,} entries: {r['status']} {r['stderr_tail'][-500:]}", flush=True)


def cpu_text(row: dict) -> str:
    """CPU seconds to the first batch: the process with all its threads (and its workers)."""
    if row.get("first_batch_cpu_s") is None:
        return "–"
    workers = f" ({row['workers_cpu_s']:.2f})" if row["workers"] else ""
    return f"{row['first_batch_cpu_s']:.2f}{workers}"


def row_cpu(row: dict) -> float:
    """A row's CPU seconds to the first batch: the process with its threads and its workers."""
    return row["first_batch_cpu_s"] + (row["workers_cpu_s"] or 0)


def print_opening(rows: list) -> None:
    """Each configuration's first batch at every shard count, against the fewest shards' (wall
    time and CPU seconds of the process with its threads and workers; memory: peak RSS of the
    process), with the load average at the end of each measurement."""
    by_config: dict = {}
    for _label, row in rows:
        by_config.setdefault((row["mode"], row["world"], row["workers"]), []).append(row)
    print(
        "\n| batching | world | workers | shards | first batch | CPU s (workers) | peak RSS main "
        "| more than the fewest shards: wall, CPU (with workers), RSS | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (mode, world, workers), found in by_config.items():
        found = sorted(found, key=lambda r: r["shards"])
        first = found[0]
        for row in found:
            if row["status"] != "ok":
                print(f"| {MODE_LABEL[mode]} | {world:,} | {workers} | {row['shards']:,} | {row['status']} | | | | |")
                continue
            more = ""
            if row is not first and first["status"] == "ok":
                more = (
                    f"+{row['first_batch_s'] - first['first_batch_s']:.2f} s, "
                    f"+{row_cpu(row) - row_cpu(first):.2f} s, "
                    f"+{fmt_b(row['main_peak'] - first['main_peak']) if row['main_peak'] > first['main_peak'] else '0'}"
                )
            print(
                f"| {MODE_LABEL[mode]} | {world:,} | {workers} | {row['shards']:,} | {fmt_s(row['first_batch_s'])} "
                f"| {cpu_text(row)} | {fmt_b(row['main_peak'])} | {more} | {row['load']:.1f} |"
            )


def print_tables(args, cap: int, loader_rows: list, cli_rows: list) -> None:
    if loader_rows:
        print(
            "\n| documents | world | workers | batching | time to first batch | CPU s (workers) | exact count "
            "| peak RSS main | largest worker (private) | batches/rank (bound) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
    for label, row in loader_rows:
        first = verdict_text({"status": row["status"]}, args.timeout, cap, row["first_batch_s"])
        if row["exact_at_first"]:
            exact = "at once"
        else:
            exact = fmt_s(row["exact_s"]) if row.get("exact_s") is not None else "background"
        worker = "–" if not row["workers"] else f"{fmt_b(row['worker_peak'])} ({fmt_b(row['worker_private'])})"
        if row["status"] != "ok":
            worker = "–" if not row["workers"] or not row["worker_peak"] else f"≥ {fmt_b(row['worker_peak'])}"
        main_rss = fmt_b(row["main_peak"]) if row["status"] == "ok" else "–"
        per_rank = f"{row['per_rank']:,}" if row["per_rank"] is not None else "–"
        bound = f" ({row['bound']:,})" if row.get("bound") is not None and not row["exact_at_first"] else ""
        print(
            f"| {label} | {row['world']:,} | {row['workers']} | {MODE_LABEL[row['mode']]} | {first} | {cpu_text(row)} "
            f"| {exact} | {main_rss} | {worker} | {per_rank}{bound} |"
        )
    if cli_rows:
        print("\n| documents | command | wall time | peak RSS |")
        print("|---|---|---|---|")
    for label, row in cli_rows:
        r = {"status": row["status"] if row["status"] in ("timeout", "mem") else "ok"}
        shown = verdict_text(r, args.cli_timeout, cap, row["wall_s"])
        note = "" if row["status"] in ("ok", "timeout", "mem") else f" ({row['status']})"
        print(f"| {label} | `wdsllm {row['command']}` | {shown}{row['progress']}{note} | {fmt_b(row['peak'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default="2.5e7", help="target documents, comma-separated for several datasets [2.5e7]")
    ap.add_argument(
        "--shards", default="", help="datasets by shard count instead (1e3,1e6), each shard of --shard-docs documents"
    )
    ap.add_argument("--shard-docs", type=int, default=100, help="documents per shard for --shards [100]")
    ap.add_argument("--work", default=os.path.join(HERE, "..", "bench-out", "scale"), help="where datasets are kept")
    ap.add_argument("--worlds", default="8,1024,16384", help="world sizes (rank 0 is measured)")
    ap.add_argument("--workers", default="0,2", help="DataLoader worker counts")
    ap.add_argument("--modes", default=",".join(MODES), help=f"batching modes among {','.join(MODES)}")
    ap.add_argument("--timeout", type=float, default=60, help="seconds per loader measurement [60]")
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of each loader measurement; the one of fewest CPU seconds kept [1]"
    )
    ap.add_argument("--exact", action="store_true", help="also wait for the exact equal-batches decision")
    ap.add_argument("--cli-timeout", type=float, default=600, help="seconds per CLI measurement [600]")
    ap.add_argument("--mem-cap", type=float, default=7.5, help="GiB per measured process tree [7.5]")
    ap.add_argument("--no-skip", action="store_true", help="measure configurations past one that ran out of time")
    ap.add_argument("--no-loader", action="store_true", help="skip the loader measurements")
    ap.add_argument("--no-cli", action="store_true", help="skip stats/info/verify")
    ap.add_argument("--cli", default="info,stats,verify", help="which CLI commands to measure")
    ap.add_argument("--verify-jobs", type=int, default=0, help="wdsllm verify --jobs [its default: one per core]")
    ap.add_argument("--context", default=None, help="DataLoader multiprocessing context (fork by default)")
    ap.add_argument("--index-parse", default="", help="also time reading indexes of these shard counts (4e4,1e6)")
    ap.add_argument("--mix", action="store_true", help="measure one mixture of the --docs datasets")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--code", default=None, help="put this checkout first on the measured processes' path")
    ap.add_argument("--json", dest="json_out", default=None, help="append every result as a JSON line here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        spec = json.loads(args.child)
        if args.code or spec.get("code"):
            sys.path.insert(0, os.path.abspath(args.code or spec["code"]))
        {"loader": child_loader, "cli": child_cli, "index": child_index_parse}[spec["kind"]](spec)
        return

    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    cap = int(args.mem_cap * GiB)
    me = [sys.executable, os.path.abspath(__file__)]
    for m in [m for m in args.modes.split(",") if m]:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m}; choose among {list(MODES)}")
    log = open(args.json_out, "a") if args.json_out else None  # noqa: SIM115 - appended to as results come

    def record(row: dict) -> None:
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"# bench_scale: {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores (shared machine: load {load}), "
        f"timeout {args.timeout:g} s, memory cap {args.mem_cap:g} GiB",
        flush=True,
    )
    loader_rows: list = []
    cli_rows: list = []
    if args.mix:
        measure_mixture(args, work, me, cap, record, loader_rows)
        print_tables(args, cap, loader_rows, cli_rows)
        return
    if args.shards:
        measure_shards(args, work, me, cap, record, loader_rows)
        print_tables(args, cap, loader_rows, cli_rows)
        print_opening(loader_rows)
        return
    for docs_text in [d for d in args.docs.split(",") if d]:
        root, info = build_dataset(work, float(docs_text), args.code)
        label = f"{human_docs(info['documents'])} ({info['shards']:,} shards)"
        print(
            f"# dataset {root}: {info['documents']:,} documents, {info['shards']:,} shards, lengths.npy "
            f"{fmt_b(info['lengths_bytes'])}, index.json {fmt_b(info['index_bytes'])}; built in {info['build_s']} s "
            f"(links {info['links_s']} s, side files {info['side_files_s']} s, index {info['index_s']} s)"
            f"{' [kept from before]' if info.get('cached') else ''}",
            flush=True,
        )
        if args.build_only:
            continue
        if not args.no_loader:
            measure_loader(args, root, info, label, me, cap, record, loader_rows)
        if not args.no_cli:
            measure_cli(args, root, info, label, me, cap, record, cli_rows)
    if args.index_parse:
        measure_index(args, work, me, cap, record)
    print_tables(args, cap, loader_rows, cli_rows)


if __name__ == "__main__":
    main()
