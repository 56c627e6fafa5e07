"""What the always-on observation costs: the loader with and without it, every batching mode.

    python tools/bench_observe.py [--work bench-out] [--quick] [--workers 0,2] [--rounds 3]

``tools/bench_checks.py``'s method: the wiki packs of ``tools/bench_load.py``, each batching mode
and worker count run in alternating passes in one process, with the observation as shipped and
with it taken out, so that both see the same machine; each pass reads whole epochs for at least
``--min-seconds``; the best tokens/s of each and their ratio are printed. Target (issue #34):
at least 0.99x in every mode.

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
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_checks  # the modes
import bench_load  # the same packs and constants as the load benchmark

from wdsllm.load import dataset, loader, transport
from wdsllm.load.batching import Batch
from wdsllm.observe import observer


def _send_bundles_unobserved(bundles: Iterable[list], holder: transport.RingHolder) -> Iterator[Any]:
    """``transport.send_bundles`` without the report, the stage timing and the board."""
    info = transport.get_worker_info()
    ring = holder.ring
    for bundle in bundles:
        msg = None
        if ring is not None and ring.usable and info is not None and info.id < ring.workers:
            msg = ring.pack(info.id, bundle)
        if msg is None:
            for batch in bundle:
                if isinstance(batch, Batch):
                    batch.items = batch.items.compact()
        yield bundle if msg is None else msg


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


def rate(data: str, workers: int, observed: bool, options: dict, min_seconds: float) -> float:
    """Tokens per second over whole epochs (at least ``min_seconds`` of them)."""
    if observed:
        return bench_checks.rate(data, workers, True, options, min_seconds)
    with unobserved():
        return bench_checks.rate(data, workers, True, options, min_seconds)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(bench_load.REPO / "bench-out"))
    ap.add_argument("--quick", action="store_true", help="one wiki file instead of eight")
    ap.add_argument("--workers", default="0,2", help="comma-separated worker counts")
    ap.add_argument("--rounds", type=int, default=3, help="alternating passes of each variant")
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument("--only", default="", help="substring: run only the modes whose name holds it")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as bench_load: torch's parallel fills lose to contention on 2 cores
    paths = bench_load.prepare(args.work, args.quick)
    bench_load.warm_page_cache(paths)
    results = {}
    print("| mode | workers | observed tokens/s | unobserved tokens/s | observed / unobserved |")
    print("|---|---|---|---|---|")
    for name, (kind, options) in bench_checks.MODES.items():
        if args.only and args.only not in name:
            continue
        data = paths.docs if kind == "docs" else paths.packed
        for workers in (int(w) for w in args.workers.split(",")):
            best = {True: 0.0, False: 0.0}
            for _ in range(args.rounds):
                for observed in (True, False):
                    best[observed] = max(best[observed], rate(data, workers, observed, options, args.min_seconds))
            ratio = best[True] / best[False]
            results[f"{name} | {workers}"] = {"observed": best[True], "unobserved": best[False], "ratio": ratio}
            print(
                f"| {name} | {workers} | {best[True] / 1e6:,.2f}M | {best[False] / 1e6:,.2f}M | {ratio:.3f}x |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
