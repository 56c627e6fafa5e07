"""Streaming throughput from every remote scheme (http, s3, gs, az, hf) next to local disk, in one run.

    python tools/bench_remote.py [--work bench-out] [--seconds 2] [--repeats 5]

Packs the shared Wikipedia corpus with the GPT-2 tokenizer in docs mode and in packed mode
(seq_len 2048), each as one shard, and in packed mode again in 4 MiB shards, into --work once
(``wiki-docs``, ``wiki-packed``, ``wiki-packed-4mib``; reused when present), starts
the test fixtures' servers on 127.0.0.1, each in a process of its own (the HTTP server with Range
and keep-alive, moto S3, the GCS emulator, Azurite when node has it, the fake Hub), puts the
datasets there, and streams each dataset from local disk and every scheme with ``wdsllm.loader``
at num_workers 0 and 2 (``--schemes`` picks some). Workers are kept between epochs for every
source (``--persistent-workers on``, the default): the loader keeps them over remote shards, and
local shards read with kept workers are the stricter baseline (local epochs with fresh workers are
slower); ``off`` forks fresh ones each epoch for every source, ``default`` leaves each loader its
own default (kept over remote shards, fresh over local ones). A run streams whole epochs
(reshuffled, no cache) until --seconds have passed. The datasets are small (an epoch of packed
rows is 40 ms from local disk), so these runs weigh each epoch's start (the first request; with
fresh workers also the workers forked again and their clients built) as much as the streaming
itself. ``--endless`` streams one endless loader instead (``epochs=None``, as
pretraining runs read: one DataLoader iteration across epochs, each epoch reshuffled) and measures
read speed with the start-up counted once. Each configuration runs --repeats times, interleaved
across sources. Reported: the best tokens/s of the repeats (other processes on the machine only
ever slow a run down, so the best is the least disturbed) and the median time to the first batch.

- tokens/s: real tokens (not padding) delivered per second, counted from the loader's creation;
- first batch: seconds from creating the loader (which reads index.json) to the first batch;
- ratio: remote tokens/s over the local figure of the same configuration. The target is 1;
- received: body bytes received from the store per byte of the dataset per epoch (0 workers:
  the counters are per process), 1.00 when every consumer reads just its share.

The loader collates in this process with torch, whose intra-op threads stall when another
process holds the other core; ``torch.set_num_threads(--torch-threads)`` (default 1), as in
tools/bench_load.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import wdsllm  # noqa: E402

DATA = REPO.parent / "shared" / "data"
MODES = {
    "docs": dict(dirname="wiki-docs", pack=[], load=dict(batch_size=32)),
    "packed": dict(dirname="wiki-packed", pack=["--mode", "packed", "--seq-len", "2048"], load=dict(batch_size=8)),
    # the same rows in 7 shards of 4 MiB: the next shard is prefetched while one is consumed
    "packed-4MiB": dict(
        dirname="wiki-packed-4mib",
        pack=["--mode", "packed", "--seq-len", "2048", "--shard-size", "4MiB"],
        load=dict(batch_size=8),
    ),
}


def ensure_dataset(work: Path, mode: str) -> Path:
    spec = MODES[mode]
    out = work / spec["dirname"]
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
            *spec["pack"],
            "--overwrite",
            "-q",
        ]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    return out


SERVER = r"""
import logging, pathlib, sys
sys.path.insert(0, sys.argv[1])
import remote_fixtures
logging.getLogger("werkzeug").setLevel(logging.ERROR)
# The fixture's handler writes headers and body separately; without TCP_NODELAY each response
# can wait out a delayed ACK (40 ms), which would measure the server, not the client.
remote_fixtures._Handler.disable_nagle_algorithm = True
if sys.argv[2] == "http":
    server = remote_fixtures.HttpServer()
    server.root = sys.argv[3]
    print(server.url, flush=True)
elif sys.argv[2] == "hf":
    import cloud_fixtures
    cloud_fixtures._HubHandler.disable_nagle_algorithm = True
    server = cloud_fixtures.FakeHub()
    work = pathlib.Path(sys.argv[3])
    files = {f"{d}/{p.name}": p.read_bytes() for d in sys.argv[4:] for p in sorted((work / d).iterdir())}
    server.add_repo("bench/wiki", files)
    print(server.endpoint, flush=True)
else:
    server = remote_fixtures.S3Server()
    print(server.endpoint, flush=True)
sys.stdin.read()  # until the benchmark closes the pipe, or dies
"""


def start_server(kind: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """A server of the test fixtures in a process of its own: in this process it would compete
    with the loader for the GIL and measure itself."""
    args = [sys.executable, "-c", SERVER, str(REPO / "tests"), kind, *extra]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return proc, proc.stdout.readline().strip()


def start_servers(work: Path, dirnames: list[str], schemes: list[str]):
    """(things to stop, {scheme: root URL template with {name}}) with the datasets in every store."""
    import boto3

    sys.path.insert(0, str(REPO / "tests"))
    import cloud_fixtures

    stop: list = []
    roots: dict[str, str] = {}
    http, http_url = start_server("http", str(work))
    stop.append(http)
    roots["http"] = http_url + "/{name}/"
    s3, endpoint = start_server("s3")
    stop.append(s3)
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
    )
    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    bucket = "wdsllm-bench"
    client.create_bucket(Bucket=bucket)
    for name in dirnames:
        for path in sorted((work / name).iterdir()):
            client.upload_file(str(path), bucket, f"{name}/{path.name}")
    roots["s3"] = f"s3://{bucket}/{{name}}/"
    if "gs" in schemes:
        gcs = cloud_fixtures.GcsEmulator()
        gcs.install_env()
        stop.append(gcs)
        gbucket = gcs.new_bucket("bench")
        for name in dirnames:
            for path in sorted((work / name).iterdir()):
                gcs.put(gbucket, f"{name}/{path.name}", path.read_bytes())
        roots["gs"] = f"gs://{gbucket}/{{name}}/"
    binary = cloud_fixtures.find_azurite()
    if "az" in schemes and binary:
        azurite = cloud_fixtures.Azurite(binary)
        azurite.install_env()
        stop.append(azurite)
        container = azurite.new_container("bench")
        cc = azurite.service().get_container_client(container)
        for name in dirnames:
            for path in sorted((work / name).iterdir()):
                cc.upload_blob(f"{name}/{path.name}", path.read_bytes())
        roots["az"] = f"az://{container}/{{name}}/"
    if "hf" in schemes:
        hub, hub_url = start_server("hf", str(work), *dirnames)
        stop.append(hub)
        os.environ.update({"HF_ENDPOINT": hub_url, "HF_TOKEN": "hf_bench", "HF_HUB_DISABLE_TELEMETRY": "1"})
        roots["hf"] = "hf://datasets/bench/wiki@main/{name}/"
    return stop, {k: v for k, v in roots.items() if k in schemes}


def stream(source: str, workers: int, load: dict, seconds: float, endless: bool = False) -> dict:
    """Whole epochs from ``source`` until ``seconds`` have passed (or one endless stream)."""
    from wdsllm import storage

    storage.reset_stats()
    t0 = time.perf_counter()
    loader = wdsllm.loader(source, num_workers=workers, seed=0, **({"epochs": None} if endless else {}), **load)
    first = None
    tokens = epochs = 0
    if endless:
        for batch in loader:  # the loader is dropped on return, which stops its workers
            if first is None:
                first = time.perf_counter() - t0
            tokens += int(batch["lengths"].sum())
            if time.perf_counter() - t0 >= seconds:
                break
        epochs = 1
    else:
        while time.perf_counter() - t0 < seconds or not epochs:
            loader.set_epoch(epochs)
            for batch in loader:
                if first is None:
                    first = time.perf_counter() - t0
                tokens += int(batch["lengths"].sum())
            epochs += 1
    elapsed = time.perf_counter() - t0
    size = sum(e.bytes for e in loader.catalog.shard_entries or []) if hasattr(loader, "catalog") else 0
    received = storage.stats()["received_bytes"] / (size * epochs) if size and not workers and not endless else None
    return {
        "tokens_per_s": tokens / elapsed,
        "first_batch_s": first,
        "epochs": epochs,
        "tokens": tokens,
        "received": received,
    }


def raw_read(url: str, prefetch: bool) -> float:
    """MB/s of reading one whole object through storage (what the loader's reader sits on)."""
    from wdsllm import storage

    t0 = time.perf_counter()
    streams = storage.prefetch_iter([url]) if prefetch else None
    f = next(streams) if streams is not None else storage.open_stream(url)
    n = 0
    while chunk := f.read(1 << 16):
        n += len(chunk)
    f.close()
    if streams is not None:
        streams.close()
    return n / (time.perf_counter() - t0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(REPO / "bench-out"))
    ap.add_argument("--seconds", type=float, default=2.0, help="minimum streaming time per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--schemes", default="http,s3,gs,az,hf")
    ap.add_argument(
        "--persistent-workers",
        choices=("on", "off", "default"),
        default="on",
        help="keep DataLoader workers between epochs (on), fork fresh ones each epoch (off), or leave each loader "
        "its default (kept over remote shards only)",
    )
    ap.add_argument(
        "--endless", action="store_true", help="one endless stream per run (epochs=None): read speed, start-up once"
    )
    ap.add_argument(
        "--fetch-process",
        choices=("auto", "on", "off"),
        default="auto",
        help="the loader's fetch_process (auto: its default, None)",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads in this process (0: torch's default; see docs/benchmarks.md, load)",
    )
    args = ap.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    logging.basicConfig(level=logging.WARNING)
    t_start = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    dirs = {mode: ensure_dataset(work, mode) for mode in modes}
    schemes = args.schemes.split(",")
    servers, roots = start_servers(work, [MODES[m]["dirname"] for m in modes], schemes)
    load_before = os.getloadavg()[0]
    try:
        rows = []
        for mode in modes:
            name = MODES[mode]["dirname"]
            sources = {"local": str(dirs[mode]), **{k: v.format(name=name) for k, v in roots.items()}}
            for source in sources.values():  # warm-up, not counted: imports, page cache, boto3 models
                stream(source, 0, MODES[mode]["load"], 0)
            for workers in (int(w) for w in args.workers.split(",")):
                runs: dict[str, list[dict]] = {k: [] for k in sources}
                load = dict(MODES[mode]["load"])
                if args.persistent_workers != "default":
                    load["persistent_workers"] = args.persistent_workers == "on"
                if args.fetch_process != "auto":
                    load["fetch_process"] = args.fetch_process == "on"
                for _ in range(args.repeats):
                    for kind, source in sources.items():
                        runs[kind].append(stream(source, workers, load, args.seconds, args.endless))
                local = max(r["tokens_per_s"] for r in runs["local"])
                for kind in sources:
                    rate = max(r["tokens_per_s"] for r in runs[kind])
                    first = statistics.median(r["first_batch_s"] for r in runs[kind])
                    got = [r["received"] for r in runs[kind] if r["received"] is not None]
                    received = f"{statistics.median(got):.2f}" if got and kind != "local" else "-"
                    rows.append((mode, workers, kind, rate, first, rate / local, received))
                    print(
                        f"{mode} workers={workers} {kind}: {rate / 1e6:.2f}M tokens/s, first batch "
                        f"{first * 1000:.0f} ms, "
                        f"{rate / local:.2f}x local, received {received}",
                        flush=True,
                    )
        raw = []
        name = MODES[modes[0]]["dirname"]
        shard = f"{name}/shard-000000.tar"
        urls = {"local": str(work / shard)}
        urls.update({k: v.format(name=name) + "shard-000000.tar" for k, v in roots.items()})
        for kind, url in urls.items():
            for prefetch in (False, True):
                raw.append((kind, prefetch, max(raw_read(url, prefetch) for _ in range(args.repeats))))
    finally:
        for proc in servers:
            if isinstance(proc, subprocess.Popen):
                proc.terminate()
                proc.wait(10)
            else:
                proc.close()
    print()
    print(
        f"| mode | workers | source | tokens/s (best of {args.repeats}) | first batch (median) | remote / local "
        "| received / dataset |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, workers, kind, rate, first, ratio, received in rows:
        print(f"| {mode} | {workers} | {kind} | {rate / 1e6:.2f}M | {first * 1000:.0f} ms | {ratio:.2f} | {received} |")
    print(
        f"\nreading {shard} ({(work / shard).stat().st_size / 1e6:.0f} MB) through wdsllm.storage, best of "
        f"{args.repeats}:"
    )
    print("| source | open_stream | prefetch_iter (read-ahead thread) |")
    print("|---|---|---|")
    for kind in urls:
        plain, ahead = (r for k, p, r in sorted(raw, key=lambda x: x[1]) if k == kind)
        print(f"| {kind} | {plain:,.0f} MB/s | {ahead:,.0f} MB/s |")
    print(
        f"\n{os.cpu_count()} CPUs, load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after the runs; "
        f"bench_remote took {time.perf_counter() - t_start:.0f} s"
    )


if __name__ == "__main__":
    main()
