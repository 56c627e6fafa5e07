"""Where one epoch's time goes when streaming from a store: wall time, and CPU per thread.

    python tools/bench_remote_epoch.py http [--epochs 25] [--mode packed] [--workers 2]

Starts the store of ``SCHEME`` (``local``, ``http``, ``s3``, ``gs``, ``az``, ``hf``) as
tools/bench_remote.py does, with the dataset of ``--mode`` from its --work folder (packed there
on first use), makes one loader (0 workers, or ``--workers`` kept between epochs; no cache) and
streams ``--epochs`` epochs after two warm-up epochs. Prints the median epoch's wall time, its
first batch's wait and this process's CPU, then the CPU of each thread of this process per epoch
(from /proc: the loader's thread, fsspec's IO loop, the block readers), and the CPU of the
server's process where it runs in one: on a 2-core machine these compete for the same cores, and
the loader thread and the IO loop for the same GIL. With workers, the CPU of this process's other
children is theirs.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_remote

import wdsllm


def thread_cpu() -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds of every thread of this process, by Python thread name (digits
    dropped): system time is mostly the kernel copying received bytes, with the GIL released."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "other").rstrip("0123456789_")
        user, system = out.get(name, (0.0, 0.0))
        out[name] = (user + int(fields[11]) / tick, system + int(fields[12]) / tick)
    return out


def server_pid(server) -> int | None:
    """The process of a server started by bench_remote (a Popen, or a fixture holding one)."""
    pid = getattr(server, "pid", None)
    return pid if pid is not None else getattr(getattr(server, "_proc", None), "pid", None)


def child_cpu(servers: list) -> float:
    """CPU seconds of this process's children that are not servers: the fetch process, or the
    DataLoader workers."""
    import psutil

    server_pids = {server_pid(server) for server in servers}
    total = 0.0
    for proc in psutil.Process().children():
        if proc.pid in server_pids:
            continue
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def server_cpu(servers: list) -> float:
    import psutil

    total = 0.0
    for server in servers:
        pid = server_pid(server)
        if pid is None:
            continue
        try:
            for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scheme", choices=["local", "http", "s3", "gs", "az", "hf"])
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--mode", default="packed", choices=list(bench_remote.MODES))
    ap.add_argument("--work", default=str(bench_remote.REPO / "bench-out"))
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers, kept between epochs")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    work = Path(args.work)
    data = bench_remote.ensure_dataset(work, args.mode)
    name = bench_remote.MODES[args.mode]["dirname"]
    servers, roots = ([], {}) if args.scheme == "local" else bench_remote.start_servers(work, [name], [args.scheme])
    source = str(data) if args.scheme == "local" else roots[args.scheme].format(name=name)
    try:
        kept = {"persistent_workers": True} if args.workers else {}
        loader = wdsllm.loader(
            source, num_workers=args.workers, seed=0, **kept, **bench_remote.MODES[args.mode]["load"]
        )
        for epoch in range(2):  # warm-up: imports, connections, page cache
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        epochs, firsts, tokens = [], [], 0
        threads0, server0, child0, t0 = thread_cpu(), server_cpu(servers), child_cpu(servers), time.perf_counter()
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            w, c = time.perf_counter(), time.process_time()
            tokens, first = 0, None
            for batch in loader:
                first = time.perf_counter() - w if first is None else first
                tokens += int(batch["lengths"].sum())
            epochs.append((time.perf_counter() - w, time.process_time() - c))
            firsts.append(first)
        elapsed = time.perf_counter() - t0
        threads1, server1, child1 = thread_cpu(), server_cpu(servers), child_cpu(servers)
    finally:
        for server in servers:
            server.terminate() if hasattr(server, "terminate") else server.close()
    wall, cpu = sorted(epochs)[len(epochs) // 2]
    n = args.epochs
    print(
        f"{args.scheme} {args.mode}: median epoch {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU of this process, "
        f"{tokens / wall / 1e6:.1f}M tokens/s; mean epoch {elapsed / n * 1e3:.1f} ms; "
        f"first batch of an epoch after {sorted(firsts)[len(firsts) // 2] * 1e3:.1f} ms (median)"
    )
    per_thread = {
        k: ((u - threads0.get(k, (0.0, 0.0))[0]) / n * 1e3, (s - threads0.get(k, (0.0, 0.0))[1]) / n * 1e3)
        for k, (u, s) in threads1.items()
    }
    print(
        "CPU per epoch (of which system): "
        + ", ".join(
            f"{k} {u + s:.1f} ms ({s:.1f})"
            for k, (u, s) in sorted(per_thread.items(), key=lambda kv: -sum(kv[1]))
            if u + s > 0
        )
        + (
            f", {'workers' if args.workers else 'fetch process'} {(child1 - child0) / n * 1e3:.1f} ms"
            if child1 > child0
            else ""
        )
        + (f", server process {(server1 - server0) / n * 1e3:.1f} ms" if servers else "")
    )


if __name__ == "__main__":
    main()
