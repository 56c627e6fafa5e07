"""What the always-on observation costs: the loader with and without it, every batching mode.

    python tools/bench_observe.py [--work bench-out] [--quick] [--workers 0,2] [--rounds 3] [--micro]

``tools/bench_checks.py``'s method: the wiki packs of ``tools/bench_load.py``, each batching mode
and worker count run in alternating passes in one process, with the observation as shipped and
with it taken out, so that both see the same machine; each pass reads whole epochs for at least
``--min-seconds``; the best tokens/s of each and their ratio are printed, and beside them the
least CPU seconds per million tokens of the loader's process and its workers (from /proc), which
a shared machine moves less than wall time. On a loaded 2-core machine both move by more than
the observation costs, so it first measures each always-on piece per call (``--micro``: that alone,
in seconds) and prints, per mode, their sum per batch over the measured time per batch: the
always-on share. Target (issue #34): at most 1% in every mode. The same table gives what one
``Loader.metrics()`` costs (a trainer logging every step calls it once a batch); target (issue
#43): at most 20 us.

"Taken out" puts back, for the measurement only, the stages as they were before the observation:
``transport.send_bundles`` without the worker's report, the stage timing and the board; no
``timed_reads`` around a worker's blocks; the ring's ``take`` without its timing; the loader's
batches without ``observe.observer.timed`` (the data wait) and ``Observer.handed`` (collate time).
Workers are forked after the swap, so they run the same code as the loader's process. What is
left in both: two clock reads around collation. Local shards only: the stores' counters (one
lock and two additions per remote read) are not on this path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_checks  # the modes
import bench_load  # the same packs and constants as the load benchmark

import wdsllm
from wdsllm.load import dataset, loader, transport
from wdsllm.observe import observer
from wdsllm.storage.counters import count_in


def _send_bundles_unobserved(bundles: Iterable[list], holder: transport.RingHolder) -> Iterator[Any]:
    """``transport.send_bundles`` without the report, the stage timing and the board."""
    info = transport.get_worker_info()
    ring = holder.ring
    for bundle in bundles:
        yield transport.packed(bundle, ring, info)


def _take_untimed(self: transport.TokenRing, msg: transport.RingBundle) -> Any:
    tokens = transport.np.frombuffer(self.mm, transport.np.dtype(msg.dtype), count=msg.count, offset=msg.offset).copy()
    self.taken[msg.worker] = msg.seq + 1
    return tokens


def _as_is(items: Iterator, *args: Any, **kwargs: Any) -> Iterator:
    return items


@contextmanager
def unobserved() -> Iterator[None]:
    """The stages as they were before the observation (see the module's docstring)."""
    saved = [
        (dataset, "send_bundles", _send_bundles_unobserved),
        (dataset, "timed_reads", _as_is),
        (transport, "timed_stream", _as_is),
        (transport.TokenRing, "take", _take_untimed),
        (loader, "timed", _as_is),
        (observer.Observer, "handed", lambda self, worker, seconds: None),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in saved]
    for owner, name, replacement in saved:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _worker_cpu(loader: Any) -> float:
    """CPU seconds of the loader's live (kept) DataLoader workers, from /proc."""
    iterator = getattr(loader._dataloader, "_iterator", None)
    total = 0.0
    for process in getattr(iterator, "_workers", None) or []:
        try:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _measure(data: str, workers: int, options: dict, min_seconds: float) -> tuple[float, float, float]:
    """(tokens per second, CPU seconds per million tokens of this process and its workers, seconds
    per batch) over whole epochs (at least ``min_seconds`` of them), as ``bench_checks.rate`` reads them."""
    loader = wdsllm.loader(data, num_workers=workers, persistent_workers=workers > 0, seed=0, **options)
    for _ in loader:  # warm: page cache, mappings, workers
        pass
    tokens, elapsed, cpu, epoch, batches = 0, 0.0, 0.0, 1, 0
    while elapsed < min_seconds:
        loader.set_epoch(epoch)
        lengths = []
        cpu_before, t = time.process_time() + _worker_cpu(loader), time.perf_counter()
        for batch in loader:
            lengths.append(batch["lengths"])
        elapsed += time.perf_counter() - t
        cpu += time.process_time() + _worker_cpu(loader) - cpu_before
        tokens += int(sum(int(x.sum()) for x in lengths))
        batches += len(lengths)
        epoch += 1
    loader.close()
    return tokens / elapsed, cpu / tokens * 1e6, elapsed / max(1, batches)


def rate(data: str, workers: int, observed: bool, options: dict, min_seconds: float) -> tuple[float, float, float]:
    """(tokens/s, CPU s per M tokens, s per batch) with the observation as shipped, or taken out."""
    if observed:
        return _measure(data, workers, options, min_seconds)
    with unobserved():
        return _measure(data, workers, options, min_seconds)


def _per_call(fn: Any, calls: int = 200_000) -> float:
    """Microseconds of this thread's CPU per call of ``fn`` (best of 5 runs of ``calls`` calls):
    on a shared machine, wall time would add the time the machine gave to other work."""
    best = float("inf")
    for _ in range(5):
        began = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, time.thread_time() - began)
    return best / calls * 1e6


def _zeros() -> Iterator[int]:
    while True:
        yield 0


def per_batch_us(costs: dict[str, float], workers: int, blocks_per_batch: float) -> float:
    """The always-on pieces' microseconds per batch: the trainer's thread's for each batch; in
    the loader's process (no workers) the stream's timing per batch, else a worker's report and
    its timing per message of up to 16 batches (counted as if each held only 1/16th: messages of
    fewer batches are rarer, at an epoch's start and end); the blocks' read timing."""
    bare = costs["next() of a bare iterator"]
    trainer = costs["timed next() (the data wait)"] - bare + costs["handed (collate time, worker)"]
    stream = costs["timed_stream, per batch or message"] - bare
    if workers:
        stream = (stream + costs["a worker's report, per message"]) / 16
    return trainer + stream + (costs["timed_reads, per block"] - bare) * blocks_per_batch


def blocks_per_batch(data: str, options: dict) -> float:
    """Blocks read per batch handed out, over one epoch (counted in a pass of its own)."""
    counted = [0]

    def counting(blocks: Iterator) -> Iterator:
        for block in blocks:
            counted[0] += 1
            yield block

    original = dataset.timed_reads
    dataset.timed_reads = counting
    try:
        with wdsllm.loader(data, num_workers=0, seed=0, **options) as loader:
            batches = sum(1 for _ in loader)
    finally:
        dataset.timed_reads = original
    return counted[0] / max(1, batches)


def observed_loader_state() -> Any:
    """An observer as a loader's looks after many steps with 2 workers reading from 2 stores: a
    full wait window, both workers' reports and waits, both stores' counters (what
    ``Loader.metrics()`` reads: ``Observer.metrics``)."""
    from wdsllm.load.options import ObserveOptions
    from wdsllm.observe.observer import Observer, timed
    from wdsllm.observe.report import WorkerReport
    from wdsllm.storage.counters import STORE_NAMES

    observer = Observer(ObserveOptions(watchdog_s=None))
    steps = timed(_zeros(), observer)
    for step in range(1000):
        observer.handed(step % 2, 1e-4)
        next(steps)
    for worker in (0, 1):
        observer.tally.add(WorkerReport(worker, 1, {"read": 0.5, "batch": 0.2}, {}, (1, 100)))
    for store in ("https://a.example", "s3://bucket"):
        for name in STORE_NAMES:
            count_in(store, name, 1)
    return observer


def micro() -> dict[str, float]:
    """What each always-on piece costs per call, in microseconds, on this machine: the trainer's
    thread per batch (the timed ``next()``, ``handed``, the wait charged), a worker per message
    (its report) and per block read (``timed_reads``); and ``Loader.metrics()``, which a trainer
    that logs every step calls once a batch (issue #43: at most 20 us)."""
    from wdsllm.load.options import ObserveOptions
    from wdsllm.observe.observer import Observer, timed
    from wdsllm.observe.report import Reporter, timed_reads, timed_stream

    observer = Observer(ObserveOptions(watchdog_s=None))
    steps = timed(_zeros(), observer)
    bare = _zeros()
    reads = timed_reads(_zeros())
    reporter = Reporter(0, None)
    streamed = timed_stream(_zeros(), "batch")
    logged = observed_loader_state()
    costs = {
        "next() of a bare iterator": _per_call(bare.__next__),
        "timed next() (the data wait)": _per_call(steps.__next__),
        "handed (collate time, worker)": _per_call(lambda: observer.handed(0, 1e-4)),
        "a worker's report, per message": _per_call(reporter.report, 50_000),
        "timed_reads, per block": _per_call(reads.__next__),
        "timed_stream, per batch or message": _per_call(streamed.__next__),
        "metrics() (2 workers, 2 stores, a full window)": _per_call(logged.metrics, 20_000),
        "metrics() after a store's counters moved (each call)": _per_call(lambda: _moved_then_metrics(logged), 20_000),
    }
    stepping = timed(_zeros(), logged)
    batch_and_metrics = _per_call(lambda: _stepped_then_metrics(logged, stepping), 20_000)
    step = costs["timed next() (the data wait)"] + costs["handed (collate time, worker)"]
    costs["metrics() after a batch and a store's move (each call; the batch's own cost taken off)"] = (
        batch_and_metrics - step
    )
    return costs


def _stepped_then_metrics(observer: Any, steps: Iterator[int]) -> dict[str, float]:
    """What a trainer logging every step meets: a batch handed out (the wait, the collate time:
    the window, the stages and the workers' figures move), a store counted a request, then
    ``metrics()``."""
    observer.handed(0, 1e-4)
    next(steps)
    count_in("s3://bucket", "requests")
    return observer.metrics()


def _moved_then_metrics(observer: Any) -> dict[str, float]:
    """A store counted a request, then ``metrics()``: its figures are made again (a loader
    without workers reading remote shards; with workers they move once per message)."""
    count_in("s3://bucket", "requests")
    return observer.metrics()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(bench_load.REPO / "bench-out"))
    ap.add_argument("--quick", action="store_true", help="one wiki file instead of eight")
    ap.add_argument("--workers", default="0,2", help="comma-separated worker counts")
    ap.add_argument("--rounds", type=int, default=3, help="alternating passes of each variant")
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument("--only", default="", help="substring: run only the modes whose name holds it")
    ap.add_argument("--json", default=None)
    ap.add_argument("--micro", action="store_true", help="only the per-call costs (seconds, no data)")
    args = ap.parse_args(argv)
    print("| always-on piece | microseconds per call |")
    print("|---|---|")
    costs = micro()
    for piece, us in costs.items():
        print(f"| {piece} | {us:.2f} |")
    print(flush=True)
    if args.micro:
        return costs
    import torch

    torch.set_num_threads(1)  # as bench_load: torch's parallel fills lose to contention on 2 cores
    paths = bench_load.prepare(args.work, args.quick)
    bench_load.warm_page_cache(paths)
    results = {}
    print(
        "| mode | workers | observed tokens/s | unobserved tokens/s | observed / unobserved "
        "| CPU s/M tokens, observed | unobserved | observed / unobserved | ms per batch | always-on us per batch "
        "| always-on share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (kind, options) in bench_checks.MODES.items():
        if args.only and args.only not in name:
            continue
        data = paths.docs if kind == "docs" else paths.packed
        for workers in (int(w) for w in args.workers.split(",")):
            best = {True: 0.0, False: 0.0}
            cpu = {True: float("inf"), False: float("inf")}
            batch_s = float("inf")
            for _ in range(args.rounds):
                for observed in (True, False):
                    speed, cost, per_batch = rate(data, workers, observed, options, args.min_seconds)
                    best[observed], cpu[observed] = max(best[observed], speed), min(cpu[observed], cost)
                    batch_s = min(batch_s, per_batch)
            overhead = per_batch_us(costs, workers, blocks_per_batch(data, options))
            share = overhead * 1e-6 / batch_s
            ratio, cpu_ratio = best[True] / best[False], cpu[True] / cpu[False]
            results[f"{name} | {workers}"] = {
                "observed": best[True],
                "unobserved": best[False],
                "ratio": ratio,
                "cpu_per_mtoken_observed": cpu[True],
                "cpu_per_mtoken_unobserved": cpu[False],
                "cpu_ratio": cpu_ratio,
                "seconds_per_batch": batch_s,
                "always_on_us_per_batch": overhead,
                "always_on_share": share,
            }
            print(
                f"| {name} | {workers} | {best[True] / 1e6:,.2f}M | {best[False] / 1e6:,.2f}M | {ratio:.3f}x "
                f"| {cpu[True]:.3f} | {cpu[False]:.3f} | {cpu_ratio:.3f}x | {batch_s * 1e3:.2f} | {overhead:.2f} "
                f"| {share:.3%} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
