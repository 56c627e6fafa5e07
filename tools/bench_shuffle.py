"""Shuffle quality across epochs, and what it costs (issue #32).

    python tools/bench_shuffle.py [--data bench-out/wiki-docs] [--json out.json]

On one packed dataset (default: bench-out/wiki-docs, one shard of 13.4M tokens), for epochs 0
and 1 and the layouts 1 shard (as packed), 8 shards (the previous order over 8 shards: the same
documents as 8 equal blocks permuted per epoch, ``MIN_BLOCK_TOKENS`` set to an eighth; the blocks
order of 8 such shards is that of one, 48 blocks instead of 51), 2 workers and 2 ranks:

- prefix overlap: of the documents in the first 30% of rank 0's stream in epoch e, the share also
  in the first 30% of its stream in epoch e+1. Independent shuffles with shares that move give
  0.30 / world; a fixed block order gives nearly 1;
- neighbours kept: of the adjacent pairs of epoch e's stream, the share still within 64 positions
  of each other in epoch e+1 (independent shuffles: about 2 x 64 / n);
- rank share kept (2 ranks): the share of rank 0's documents of epoch e that are rank 0's in e+1
  (independent: 0.5; a fixed split: 1).

Orders compared: "shards" (the previous order: whole shards, a fixed split, ``MIN_BLOCK_TOKENS``
set above any shard), "blocks" (this wdsllm: blocks of shards reseeded per epoch), and the
published algorithms of mosaic streaming (py1br, py1e) and litdata, re-implemented here over the
same documents in numpy (their packages are not installed by this tool): their shards / chunks are
cut every 64 MiB of token bytes, as their default ``size_limit`` / ``chunk_bytes`` would.

Cost: CPU seconds and wall seconds of one epoch through ``wdsllm.loader`` (0 workers, batch 64
documents) and GET requests of that epoch over HTTP (tests/remote_fixtures.HttpServer), shards
against blocks, alternating, best of --repeat.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's wdsllm
sys.path.insert(0, str(REPO / "tests"))  # the counting HTTP server

import wdsllm  # noqa: E402
from wdsllm.load import plan  # noqa: E402
from wdsllm.load.sources.open import open_source  # noqa: E402

PREFIX = 0.3
NEAR = 64
BATCH = 64
PEER_SHARD_BYTES = 64 << 20
WHOLE_SHARDS = 1 << 62
LAYOUTS = {"1 shard": dict(), "8 shards": dict(shards=8), "2 workers": dict(workers=2), "2 ranks": dict(world=2)}


# ----------------------------------------------------------------------------------------------
# Figures of two orders


def prefix_overlap(a: np.ndarray, b: np.ndarray) -> float:
    n = int(len(a) * PREFIX)
    return len(np.intersect1d(a[:n], b[: int(len(b) * PREFIX)])) / max(1, n)


def neighbours_kept(a: np.ndarray, b: np.ndarray) -> float:
    """Share of adjacent pairs of ``a`` within NEAR positions of each other in ``b`` (absent: not)."""
    where = dict(zip(b.tolist(), range(len(b))))
    pos = np.array([where.get(x, -(10**12)) for x in a.tolist()], np.int64)
    both = (pos[:-1] >= 0) & (pos[1:] >= 0)
    return float(np.mean(both & (np.abs(pos[1:] - pos[:-1]) <= NEAR)))


def figures(streams: list[list[np.ndarray]]) -> dict:
    """streams[epoch][rank]: documents in reading order."""
    e0, e1 = streams[0], streams[1]
    out = {"prefix_overlap": prefix_overlap(e0[0], e1[0]), "neighbours_kept": neighbours_kept(e0[0], e1[0])}
    if len(e0) > 1:
        out["rank_share_kept"] = len(np.intersect1d(e0[0], e1[0])) / len(e0[0])
    return out


# ----------------------------------------------------------------------------------------------
# Our orders, from the loader's own plan (every document read, in process)


def our_streams(data: str, epoch: int, world: int = 1, workers: int = 0) -> list[np.ndarray]:
    """Each rank's documents in reading order (workers' batches round-robin, as DataLoader)."""
    out = []
    n = max(1, workers)
    for rank in range(world):
        pipe = wdsllm.dataset(data, batch_size=BATCH, rank=rank, world_size=world, seed=0)
        pipe.set_epoch(epoch)
        per_worker = [[b["docs"][:, 0].numpy() for b in pipe.worker_iter(w, n)] for w in range(n)]
        turns = range(max(map(len, per_worker)))
        out.append(np.concatenate([w[t] for t in turns for w in per_worker if t < len(w)]))
    return out


def ours(data: str, min_block_tokens: int, layout: dict) -> dict:
    plan.MIN_BLOCK_TOKENS = min_block_tokens
    if layout.get("shards"):
        tokens = int(open_source(data).tokens_per_shard.sum())
        plan.MIN_BLOCK_TOKENS = tokens // layout["shards"]  # eight blocks: as eight shards read whole
    world, workers = layout.get("world", 1), layout.get("workers", 0)
    return figures([our_streams(data, e, world, workers) for e in (0, 1)])


# ----------------------------------------------------------------------------------------------
# The peers' published algorithms over the same documents (ids in index order)


def peer_shards(doc_tokens: np.ndarray, itemsize: int, n_shards: int | None) -> np.ndarray:
    """Documents per peer shard: a new shard every PEER_SHARD_BYTES of tokens (or n equal ones)."""
    if n_shards:
        return np.diff(np.linspace(0, len(doc_tokens), n_shards + 1).astype(np.int64))
    cut = np.searchsorted(np.cumsum(doc_tokens * itemsize), np.arange(1, 1 << 20) * PEER_SHARD_BYTES)
    cut = np.unique(np.concatenate([cut[cut < len(doc_tokens)], [len(doc_tokens)]]))
    return np.diff(np.concatenate([[0], cut]))


def _shard_spans(sizes: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return [np.arange(starts[s], starts[s] + sizes[s]) for s in rng.permutation(len(sizes))]


def mosaic_py1br(sizes: np.ndarray, seed: int, epoch: int, block: int = 1 << 18) -> np.ndarray:
    """streaming.base.shuffle.py1br: shards in a random order, samples cut into blocks of random
    size (0.75-1.25 x block), each block shuffled."""
    rng = np.random.default_rng(seed + epoch)
    ids = np.concatenate(_shard_spans(sizes, rng))
    out, at = [], 0
    while at < len(ids):
        size = int(rng.integers(int(0.75 * block), int(1.25 * block) + 1))
        out.append(rng.permutation(ids[at : at + size]))
        at += size
    return np.concatenate(out)


def mosaic_py1e(sizes: np.ndarray, seed: int, epoch: int, block: int = 1 << 18) -> np.ndarray:
    """streaming.base.shuffle.py1e: shards in a random order, each sample moved by a random offset
    within +-block/2 (bounded by its shard's span) and sorted by the moved positions."""
    rng = np.random.default_rng(seed + epoch)
    ids = np.concatenate(_shard_spans(sizes, rng))
    moved = np.arange(len(ids)) + rng.uniform(-block / 2, block / 2, len(ids))
    return ids[np.argsort(moved, kind="stable")]


def litdata_full_shuffle(sizes: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """litdata.streaming.shuffle.FullShuffle: chunks in an order from (seed, epoch), the samples
    of each chunk in a random order."""
    rng = np.random.default_rng(seed + epoch)
    return np.concatenate([rng.permutation(span) for span in _shard_spans(sizes, rng)])


def split_ranks(order: np.ndarray, world: int) -> list[np.ndarray]:
    """Both peers split the epoch's order into contiguous per-rank parts."""
    return [order[len(order) * r // world : len(order) * (r + 1) // world] for r in range(world)]


def peers(data: str, layout: dict) -> dict:
    source = open_source(data)
    doc_tokens = source.lengths().whole().astype(np.int64)
    sizes = peer_shards(doc_tokens, np.dtype(source.index.dtype).itemsize, layout.get("shards"))
    world = layout.get("world", 1)
    out = {}
    for name, algo in (("mosaic py1br", mosaic_py1br), ("mosaic py1e", mosaic_py1e), ("litdata", litdata_full_shuffle)):
        out[name] = figures([split_ranks(algo(sizes, 0, e), world) for e in (0, 1)])
    return out


# ----------------------------------------------------------------------------------------------
# Cost: one epoch, whole shards against blocks, local CPU and remote requests


def one_epoch(source: str, min_block_tokens: int, epoch: int) -> tuple[float, float]:
    plan.MIN_BLOCK_TOKENS = min_block_tokens
    loader = wdsllm.loader(source, batch_size=BATCH, seed=0, num_workers=0)
    loader.set_epoch(epoch)
    w, c = time.perf_counter(), time.process_time()
    for _ in loader:
        pass
    out = time.perf_counter() - w, time.process_time() - c
    loader.close()
    return out


def cost(data: str, repeat: int) -> dict:
    from remote_fixtures import HttpServer

    out: dict = {}
    server = HttpServer()
    server.root = Path(data).resolve().parent
    url = server.url_for(Path(data).resolve())
    try:
        for name in ("shards", "blocks"):
            out[name] = {"wall_s": 1e9, "cpu_s": 1e9}
        for r in range(repeat):
            for name, mbt in (("shards", WHOLE_SHARDS), ("blocks", 1 << 18)):
                wall, cpu = one_epoch(data, mbt, r)
                out[name]["wall_s"] = min(out[name]["wall_s"], wall)
                out[name]["cpu_s"] = min(out[name]["cpu_s"], cpu)
        for name, mbt in (("shards", WHOLE_SHARDS), ("blocks", 1 << 18)):
            server.reset()
            wall, cpu = one_epoch(url, mbt, 0)
            out[name].update(http_wall_s=wall, http_cpu_s=cpu, http_gets=server.count("*.tar"))
    finally:
        server.close()
    return out


def _fmt(key: str, value: float | int) -> str:
    return f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "bench-out" / "wiki-docs"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    default = plan.MIN_BLOCK_TOKENS
    results: dict = {"quality": {}, "cost": {}}
    for lname, layout in LAYOUTS.items():
        row = {}
        if layout.get("shards"):  # eight shards permuted per epoch: the previous order at 8 shards
            row["shards (previous)"] = ours(args.data, default, layout)
        else:
            row["shards (previous)"] = ours(args.data, WHOLE_SHARDS, layout)
            row["blocks (wdsllm)"] = ours(args.data, default, layout)
        row.update(peers(args.data, layout))
        results["quality"][lname] = row
        for name, f in row.items():
            print(f"{lname:10s} {name:18s} " + "  ".join(f"{k} {v:.3f}" for k, v in f.items()), flush=True)
    plan.MIN_BLOCK_TOKENS = default
    results["cost"] = cost(args.data, args.repeat)
    for name, c in results["cost"].items():
        print(
            f"cost {name:7s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items())
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
