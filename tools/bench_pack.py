#!/usr/bin/env python
"""Benchmark `wdsllm pack` against the tokenizer alone, in one run.

Packs the wiki corpus (all of ../shared/data/corpora/wiki, GPT-2 tokenizer) in a subprocess and
measures, over the same documents loaded into memory first, the rate of raw
``Tokenizer.encode_batch`` (batches of 1000, default rayon parallelism, no writing) and, for
reference, ``encode_batch_fast``. Prints tokens/s, bytes per token, peak RSS of the packing process
and its workers, and the ratio pack/raw (raw encode time over pack wall time for the same text).
Rounds alternate raw and pack so that a shared, noisy machine affects both alike; the headline
figures are the best (shortest) time of each over the rounds, and every round's own ratio is
printed too. CPU seconds (the packing process plus its workers, against the encoding thread
pool) say how much work each does whatever the contention.

    python tools/bench_pack.py                 # full corpus, 3 rounds
    python tools/bench_pack.py --rounds 1 --files 2

With ``--parquet`` each round also packs the same corpus written as Parquet (one file per wiki
file, the JSON fields as columns, row groups of ``--row-group`` rows, snappy, written once into
the git-ignored ``bench-out/wiki-parquet/``), so the same tokens arrive by another road: the
shards of the two packs must be byte-identical (checked), and the ratio jsonl.gz time / Parquet
time is printed per round and best against best.

With ``--remote`` (implies ``--parquet``) each round also packs that Parquet corpus from object
stores started on 127.0.0.1 for the run: a moto S3 server (``s3://bucket/wiki-parquet/*.parquet``,
a glob listed from the store) and the HTTP server of the tests (the file URLs), read by ranged
requests; their shards must be byte-identical too, and each ratio jsonl.gz time / remote time is
printed. The servers share the machine's cores with the pack (no network latency: this measures
what the remote road costs in CPU and requests, not a WAN).

Targets (issue #2, 2-core machine): ratio >= 0.9, peak RSS < 1 GiB, bytes/token <= 2.1.
Issue #14: the Parquet pack at >= 0.9x the jsonl.gz pack of the same text.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
BATCH = 1000

# The pack subprocess reports its timing, CPU and its own peak RSS. VmHWM, not ru_maxrss: a
# process started by fork+exec keeps in ru_maxrss the size of the process it was forked from.
PACK_SNIPPET = """
import json, resource, sys, time
from wdsllm.pack.job import PackConfig, pack
cfg = PackConfig(**json.loads(sys.argv[1]))
t = time.perf_counter()
result = pack(cfg)
wall = time.perf_counter() - t
own = resource.getrusage(resource.RUSAGE_SELF)
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"pack_seconds": wall, "tokens": result.index.tokens, "bytes": result.index.totals()["bytes"],
                  "documents": result.index.documents, "shards": len(result.index.shards), "main_rss_kib": hwm,
                  "main_cpu": own.ru_utime + own.ru_stime, "worker_cpu": kids.ru_utime + kids.ru_stime}))
"""


def write_parquet_corpus(files: list[Path], row_group: int) -> list[Path]:
    """The wiki files as Parquet files of the same records, in bench-out/ (written once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = REPO / "bench-out" / f"wiki-parquet-{row_group}"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for path in files:
        target = out_dir / (path.name.split(".")[0] + ".parquet")
        if not target.exists():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                table = pa.Table.from_pylist([json.loads(line) for line in f])
            pq.write_table(table, str(target) + ".tmp", row_group_size=row_group, compression="snappy")
            os.replace(str(target) + ".tmp", target)
        paths.append(target)
    return paths


def serve_remote(parquet_files: list[Path]) -> tuple[dict[str, list[str]], list]:
    """The Parquet corpus in a moto S3 bucket and behind the tests' HTTP server: {store: input URLs}."""
    sys.path.insert(0, str(REPO / "tests"))
    from remote_fixtures import HttpServer, S3Server

    s3 = S3Server()
    s3.install_env()  # os.environ: the pack subprocesses inherit the endpoint and test credentials
    bucket = s3.new_bucket("bench")
    client = s3.client()
    for path in parquet_files:
        client.upload_file(str(path), bucket, f"wiki-parquet/{path.name}")
    http = HttpServer()
    http.root = parquet_files[0].parent
    return {"s3": [f"s3://{bucket}/wiki-parquet/*.parquet"], "http": [http.url_for(p.name) for p in parquet_files]}, [
        s3,
        http,
    ]


def shard_hashes(out: Path) -> list[str]:
    index = json.loads((out / "index.json").read_text())
    return [s["sha256"] for s in index["shards"]]


def load_documents(files: list[Path]) -> list[str]:
    """The texts pack would encode: the `text` field of every line, blank ones left out."""
    docs = []
    for path in files:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                if text.strip():
                    docs.append(text)
    return docs


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_encode(tokenizer, docs: list[str], method: str) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and tokens for encoding every document in batches, nothing kept."""
    encode = getattr(tokenizer, method)
    tokens = 0
    cpu = _cpu_seconds()
    start = time.perf_counter()
    for i in range(0, len(docs), BATCH):
        tokens += sum(len(e) for e in encode(docs[i : i + BATCH], add_special_tokens=False))
    return time.perf_counter() - start, _cpu_seconds() - cpu, tokens


def _tree_rss_kib(pid: int) -> dict[int, int]:
    """Resident KiB of a process and of each of its descendants, from /proc."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                found[p] = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return found


def run_pack(files: list[Path], tokenizer: Path, out: Path, workers: int, **options) -> dict:
    """One pack in a fresh process; adds the peak summed RSS of its process tree, sampled."""
    cfg = {
        "inputs": [str(f) for f in files],
        "output": str(out),
        "tokenizer": str(tokenizer),
        "workers": workers,
        "overwrite": True,
        **options,
    }
    env = dict(os.environ)
    env.pop("TOKENIZERS_PARALLELISM", None)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", PACK_SNIPPET, json.dumps(cfg)], stdout=subprocess.PIPE, env=env, cwd=REPO
    )
    peak = {"tree": 0, "worker": 0}

    def sample() -> None:
        while proc.poll() is None:
            rss = _tree_rss_kib(proc.pid)
            peak["tree"] = max(peak["tree"], sum(rss.values()))
            peak["worker"] = max([peak["worker"]] + [v for p, v in rss.items() if p != proc.pid])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    wall = time.perf_counter() - start
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"pack failed with exit code {proc.returncode}")
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    result["process_seconds"] = wall
    result["tree_rss_kib"] = peak["tree"]
    result["worker_rss_kib"] = peak["worker"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=DATA / "corpora" / "wiki", help="directory of wiki-*.jsonl.gz")
    ap.add_argument("--files", type=int, default=0, help="use only the first N files (0: all)")
    ap.add_argument("--tokenizer", type=Path, default=DATA / "tokenizers" / "gpt2.json")
    ap.add_argument("--workers", type=int, default=0, help="pack --workers (0: all cores)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating raw/pack rounds; the best time of each is reported"
    )
    ap.add_argument("--out", type=Path, help="pack output directory (default: a temporary one, removed)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--parquet", action="store_true", help="also pack the corpus written as Parquet, each round")
    ap.add_argument("--row-group", type=int, default=5000, help="rows per Parquet row group (--parquet)")
    ap.add_argument("--remote", action="store_true", help="also pack the Parquet corpus over S3 (moto) and HTTP")
    args = ap.parse_args()
    args.parquet = args.parquet or args.remote

    os.environ.pop("TOKENIZERS_PARALLELISM", None)  # raw encode_batch runs with its default parallelism
    from tokenizers import Tokenizer

    files = sorted(args.corpus.glob("wiki-*.jsonl.gz"))
    if args.files:
        files = files[: args.files]
    if not files:
        raise SystemExit(f"no wiki-*.jsonl.gz in {args.corpus}")
    docs = load_documents(files)
    parquet_files = write_parquet_corpus(files, args.row_group) if args.parquet else []
    remotes, servers = serve_remote(parquet_files) if args.remote else ({}, [])
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    time_encode(tokenizer, docs[:2000], "encode_batch")  # warm up the rayon pool
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-pack-"))

    rounds = []
    try:
        for r in range(args.rounds):
            raw_s, raw_cpu, raw_tokens = time_encode(tokenizer, docs, "encode_batch")
            fast_s, fast_cpu, _ = time_encode(tokenizer, docs, "encode_batch_fast")
            packed = run_pack(files, args.tokenizer, out, args.workers)
            extra = {}
            if parquet_files:
                jsonl_shards = shard_hashes(out)
                pq_run = run_pack(parquet_files, args.tokenizer, out, args.workers)
                if shard_hashes(out) != jsonl_shards:
                    raise SystemExit("the Parquet pack's shards differ from the jsonl.gz pack's")
                extra = {f"parquet_{k}": v for k, v in pq_run.items()}
                for name, urls in remotes.items():
                    remote_run = run_pack(urls, args.tokenizer, out, args.workers)
                    if shard_hashes(out) != jsonl_shards:
                        raise SystemExit(f"the Parquet pack over {name}'s shards differ from the jsonl.gz pack's")
                    extra.update({f"{name}_{k}": v for k, v in remote_run.items()})
            rounds.append(
                {
                    "raw_seconds": raw_s,
                    "raw_cpu": raw_cpu,
                    "fast_seconds": fast_s,
                    "fast_cpu": fast_cpu,
                    "raw_tokens": raw_tokens,
                    **packed,
                    **extra,
                }
            )
            print(
                f"round {r + 1}: encode_batch {raw_tokens / raw_s:,.0f} tok/s, encode_batch_fast "
                f"{raw_tokens / fast_s:,.0f} tok/s, "
                f"pack {raw_tokens / packed['process_seconds']:,.0f} text tok/s -> ratio "
                f"{raw_s / packed['process_seconds']:.3f}"
                + (
                    f"; parquet pack {extra['parquet_process_seconds']:.2f} s vs jsonl.gz "
                    f"{packed['process_seconds']:.2f} s -> "
                    f"{packed['process_seconds'] / extra['parquet_process_seconds']:.3f}x"
                    if extra
                    else ""
                )
                + "".join(
                    f"; {name} {extra[f'{name}_process_seconds']:.2f} s -> "
                    f"{packed['process_seconds'] / extra[f'{name}_process_seconds']:.3f}x"
                    for name in remotes
                )
                + f" (load average {os.getloadavg()[0]:.2f})",
                file=sys.stderr,
            )
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
        for server in servers:
            server.close()

    best = lambda key: min(r[key] for r in rounds)  # noqa: E731
    last = rounds[-1]
    mib = 1 / 1024
    pack_cpu = [r["main_cpu"] + r["worker_cpu"] for r in rounds]
    figures = {
        "files": len(files),
        "rounds": len(rounds),
        "documents": last["documents"],
        "text_tokens": last["raw_tokens"],
        "stored_tokens": last["tokens"],
        "shards": last["shards"],
        "pack_seconds": round(best("process_seconds"), 2),
        "pack_tokens_per_s": round(last["tokens"] / best("process_seconds")),
        "pack_text_tokens_per_s": round(last["raw_tokens"] / best("process_seconds")),
        "encode_batch_tokens_per_s": round(last["raw_tokens"] / best("raw_seconds")),
        "encode_batch_fast_tokens_per_s": round(last["raw_tokens"] / best("fast_seconds")),
        "ratio_pack_to_encode_batch": round(best("raw_seconds") / best("process_seconds"), 3),
        "ratio_pack_to_encode_batch_fast": round(best("fast_seconds") / best("process_seconds"), 3),
        "ratios_each_round": [round(r["raw_seconds"] / r["process_seconds"], 3) for r in rounds],
        "cpu_s_per_mtok_pack": round(min(pack_cpu) / last["raw_tokens"] * 1e6, 3),
        "cpu_s_per_mtok_encode_batch": round(best("raw_cpu") / last["raw_tokens"] * 1e6, 3),
        "cpu_s_per_mtok_encode_batch_fast": round(best("fast_cpu") / last["raw_tokens"] * 1e6, 3),
        "bytes_per_token": round(last["bytes"] / last["tokens"], 4),
        "peak_rss_main_mib": round(max(r["main_rss_kib"] for r in rounds) * mib, 1),
        "peak_rss_worker_mib": round(max(r["worker_rss_kib"] for r in rounds) * mib, 1),
        "peak_rss_tree_mib": round(max(r["tree_rss_kib"] for r in rounds) * mib, 1),
        "cpu_seconds_main": round(min(r["main_cpu"] for r in rounds), 2),
        "cpu_seconds_workers": round(min(r["worker_cpu"] for r in rounds), 2),
        "cpus": os.cpu_count(),
    }
    if parquet_files:
        figures.update(
            {
                "parquet_files": len(parquet_files),
                "parquet_bytes": sum(p.stat().st_size for p in parquet_files),
                "parquet_row_group": args.row_group,
                "parquet_pack_seconds": round(best("parquet_process_seconds"), 2),
                "parquet_pack_tokens_per_s": round(last["tokens"] / best("parquet_process_seconds")),
                "ratio_parquet_to_jsonl_gz": round(best("process_seconds") / best("parquet_process_seconds"), 3),
                "ratios_parquet_each_round": [
                    round(r["process_seconds"] / r["parquet_process_seconds"], 3) for r in rounds
                ],
                "parquet_cpu_s_main": round(min(r["parquet_main_cpu"] for r in rounds), 2),
                "parquet_cpu_s_workers": round(min(r["parquet_worker_cpu"] for r in rounds), 2),
                "parquet_peak_rss_main_mib": round(max(r["parquet_main_rss_kib"] for r in rounds) * mib, 1),
                "parquet_peak_rss_tree_mib": round(max(r["parquet_tree_rss_kib"] for r in rounds) * mib, 1),
            }
        )
    for name in remotes:
        figures.update(
            {
                f"{name}_pack_seconds": round(best(f"{name}_process_seconds"), 2),
                f"ratio_{name}_parquet_to_jsonl_gz": round(
                    best("process_seconds") / best(f"{name}_process_seconds"), 3
                ),
                f"ratios_{name}_each_round": [
                    round(r["process_seconds"] / r[f"{name}_process_seconds"], 3) for r in rounds
                ],
                f"{name}_cpu_s_main": round(min(r[f"{name}_main_cpu"] for r in rounds), 2),
                f"{name}_peak_rss_main_mib": round(max(r[f"{name}_main_rss_kib"] for r in rounds) * mib, 1),
            }
        )
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(
        f"corpus: {figures['files']} files, {figures['documents']:,} documents, {figures['text_tokens']:,} text "
        f"tokens ({figures['stored_tokens']:,} stored with EOS)"
    )
    print(f"best of {figures['rounds']} rounds:")
    print(
        f"  pack:              {figures['pack_tokens_per_s']:>12,} tokens/s  ({figures['pack_seconds']} s end to "
        f"end, {figures['shards']} shards)"
    )
    print(
        f"  encode_batch:      {figures['encode_batch_tokens_per_s']:>12,} tokens/s  (raw, in memory, batches of "
        f"{BATCH})"
    )
    print(f"  encode_batch_fast: {figures['encode_batch_fast_tokens_per_s']:>12,} tokens/s  (reference)")
    print(
        f"ratio pack/encode_batch: {figures['ratio_pack_to_encode_batch']:.3f}  (each round: "
        f"{figures['ratios_each_round']}; pack/encode_batch_fast {figures['ratio_pack_to_encode_batch_fast']:.3f})"
    )
    print(
        f"CPU seconds per million tokens: pack {figures['cpu_s_per_mtok_pack']}, encode_batch "
        f"{figures['cpu_s_per_mtok_encode_batch']}, "
        f"encode_batch_fast {figures['cpu_s_per_mtok_encode_batch_fast']}  (packing process "
        f"{figures['cpu_seconds_main']} s, workers {figures['cpu_seconds_workers']} s)"
    )
    print(f"bytes per token: {figures['bytes_per_token']:.4f}")
    print(
        f"peak RSS: packing process {figures['peak_rss_main_mib']} MiB (VmHWM), largest worker "
        f"{figures['peak_rss_worker_mib']} MiB (sampled), "
        f"whole process tree {figures['peak_rss_tree_mib']} MiB (sampled sum), on {figures['cpus']} cores"
    )
    if parquet_files:
        print(
            f"parquet: {figures['parquet_files']} files, {figures['parquet_bytes']:,} bytes, row groups of "
            f"{figures['parquet_row_group']:,} rows: pack {figures['parquet_pack_tokens_per_s']:,} tokens/s "
            f"({figures['parquet_pack_seconds']} s); ratio jsonl.gz/parquet time "
            f"{figures['ratio_parquet_to_jsonl_gz']:.3f} "
            f"(each round: {figures['ratios_parquet_each_round']}); CPU s packing process "
            f"{figures['parquet_cpu_s_main']} (jsonl.gz {figures['cpu_seconds_main']}), workers "
            f"{figures['parquet_cpu_s_workers']} (jsonl.gz {figures['cpu_seconds_workers']}); peak RSS packing process "
            f"{figures['parquet_peak_rss_main_mib']} MiB, tree {figures['parquet_peak_rss_tree_mib']} MiB; shards "
            "byte-identical to the jsonl.gz pack's"
        )
    for name in remotes:
        print(
            f"parquet over {name}: {figures[f'{name}_pack_seconds']} s; ratio jsonl.gz/{name} time "
            f"{figures[f'ratio_{name}_parquet_to_jsonl_gz']:.3f} (each round: {figures[f'ratios_{name}_each_round']}); "
            f"CPU s packing process {figures[f'{name}_cpu_s_main']}, peak RSS packing process "
            f"{figures[f'{name}_peak_rss_main_mib']} MiB; shards byte-identical to the jsonl.gz pack's"
        )


if __name__ == "__main__":
    main()
