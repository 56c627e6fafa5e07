"""Shuffle quality across epochs, and what it costs (issue #32).

    python tools/bench_shuffle.py [--data bench-out/wiki-docs] [--peers] [--no-cost | --no-quality]
                                  [--json out.json]

On one packed dataset (default: bench-out/wiki-docs, one shard of 13.4M tokens), for epochs 0
and 1 and the layouts 1 shard (as packed), 8 shards (the previous order over 8 shards: the same
documents as 8 equal blocks permuted per epoch, ``MIN_BLOCK_TOKENS`` set to an eighth; the blocks
order of 8 such shards is that of one, 48 blocks instead of 51), 2 workers, 2 ranks, and a
mixture of two one-shard sources (the dataset twice, under two names, each taken whole per epoch)
on 1 and 2 ranks:

- prefix overlap: of the documents in the first 30% of rank 0's stream in epoch e, the share also
  in the first 30% of its stream in epoch e+1. Independent shuffles with shares that move give
  0.30 / world; a fixed block order gives nearly 1;
- neighbours kept: of the adjacent pairs of epoch e's stream, the share still within 64 positions
  of each other in epoch e+1 (independent shuffles: about 2 x 64 / n);
- rank share kept (2 ranks): the share of rank 0's documents of epoch e that are rank 0's in e+1
  (independent: 0.5; a fixed split: 1).

Orders compared: "shards" (the previous order: whole shards, a fixed split, ``MIN_BLOCK_TOKENS``
set above any shard), "blocks" (this wdsllm: blocks of shards reseeded per epoch), and the peers
over the same documents, their shards / chunks cut every 64 MiB of token bytes as their default
``size_limit`` / ``chunk_bytes`` would: mosaic streaming's py1br and py1e and litdata's
FullShuffle. Without ``--peers`` they are the published algorithms re-implemented here in numpy;
with ``--peers`` the packages themselves (``mosaicml-streaming``, ``litdata`` from PyPI, in their
own virtualenv bench-out/peers-venv, made on first use with torch at tools/constraints.txt's pin)
run their own functions: mosaic's ``get_partitions`` + ``get_shuffle`` (its defaults: one
canonical node, shuffle block max(4M // nodes, 2^18) samples), litdata's
``FullShuffle.get_chunks_and_intervals_per_workers`` and its in-chunk shuffle (epochs from 1).

Cost: CPU seconds and wall seconds of one epoch through ``wdsllm.loader`` (0 workers, batch 64
documents) and GET requests of that epoch over HTTP (tests/remote_fixtures.HttpServer), shards
against blocks, alternating, best of --repeat; for the dataset and for the two-source mixture.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PEERS_VENV = REPO / "bench-out" / "peers-venv"
PEER_PACKAGES = ("mosaicml-streaming", "litdata")
sys.path.insert(0, str(REPO))  # this checkout's wdsllm (imported where used: the peers' venv has none)
sys.path.insert(0, str(REPO / "tests"))  # the counting HTTP server

PREFIX = 0.3
NEAR = 64
BATCH = 64
PEER_SHARD_BYTES = 64 << 20
WHOLE_SHARDS = 1 << 62
LAYOUTS = {
    "1 shard": dict(),
    "8 shards": dict(shards=8),
    "2 workers": dict(workers=2),
    "2 ranks": dict(world=2),
    "mixture": dict(mixture=True),
    "mixture 2 ranks": dict(mixture=True, world=2),
}


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


def mixture_of(data: str):
    """Two one-shard sources (the dataset under two names), each taken whole every epoch."""
    import wdsllm

    n = int(np.sum(_open(data).items_per_shard))
    return wdsllm.Mixture({"a": data, "b": data}, unit="items", epoch_items=2 * n)


def _open(data: str):
    from wdsllm.load.sources.open import open_source

    return open_source(data)


def our_streams(data: str, epoch: int, world: int = 1, workers: int = 0, mixture: bool = False) -> list[np.ndarray]:
    """Each rank's documents in reading order (workers' batches round-robin, as DataLoader)."""
    import wdsllm

    source = mixture_of(data) if mixture else data
    out = []
    n = max(1, workers)
    for rank in range(world):
        pipe = wdsllm.dataset(source, batch_size=BATCH, rank=rank, world_size=world, seed=0, equal_batches=False)
        pipe.set_epoch(epoch)
        per_worker = [[b["docs"][:, 0].numpy() for b in pipe.worker_iter(w, n)] for w in range(n)]
        turns = range(max(map(len, per_worker)))
        out.append(np.concatenate([w[t] for t in turns for w in per_worker if t < len(w)]))
    return out


def ours(data: str, min_block_tokens: int, layout: dict) -> dict:
    from wdsllm.load import plan

    plan.MIN_BLOCK_TOKENS = min_block_tokens
    if layout.get("shards"):
        tokens = int(_open(data).tokens_per_shard.sum())
        plan.MIN_BLOCK_TOKENS = tokens // layout["shards"]  # eight blocks: as eight shards read whole
    world, workers, mixture = layout.get("world", 1), layout.get("workers", 0), layout.get("mixture", False)
    return figures([our_streams(data, e, world, workers, mixture) for e in (0, 1)])


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


def peer_layout(data: str, layout: dict) -> np.ndarray:
    """Samples per peer shard of the layout (a mixture: the dataset's shards twice, each whole)."""
    source = _open(data)
    doc_tokens = source.lengths().whole().astype(np.int64)
    sizes = peer_shards(doc_tokens, np.dtype(source.index.dtype).itemsize, layout.get("shards"))
    return np.concatenate([sizes, sizes]) if layout.get("mixture") else sizes


def peers(data: str, layout: dict) -> dict:
    sizes = peer_layout(data, layout)
    world = layout.get("world", 1)
    out = {}
    for name, algo in (("mosaic py1br", mosaic_py1br), ("mosaic py1e", mosaic_py1e), ("litdata", litdata_full_shuffle)):
        out[name] = figures([split_ranks(algo(sizes, 0, e), world) for e in (0, 1)])
    return out


# ----------------------------------------------------------------------------------------------
# The peers' packages themselves, in their own virtualenv (this file runs there with --peer-run)


def peers_python() -> Path:
    """bench-out/peers-venv's python, the venv made and the packages installed on first use; torch
    at tools/constraints.txt's pin (its CPU wheel; the file's other pins conflict with
    mosaicml-streaming's google-cloud-storage range, so only torch's is kept)."""
    python = PEERS_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    torch_pin = next(x for x in (REPO / "tools" / "constraints.txt").read_text().split() if x.startswith("torch=="))
    pins = PEERS_VENV / "constraints.txt"
    pins.write_text(torch_pin + "\n")
    found = "import importlib.util as u, sys; sys.exit(not (u.find_spec('streaming') and u.find_spec('litdata')))"
    missing = subprocess.run([str(python), "-c", found], capture_output=True).returncode  # not imported: see below
    if missing:
        pip = [str(python), "-m", "pip", "install", "--quiet", "-c", str(pins)]
        subprocess.run([*pip, torch_pin, *PEER_PACKAGES], check=True)
    return python


def run_peers(data: str) -> dict:
    """The peers' figures for every layout, from their own packages (in their venv)."""
    with tempfile.TemporaryDirectory() as tmp:
        layouts = {name: peer_layout(data, lay).tolist() for name, lay in LAYOUTS.items()}
        worlds = {name: lay.get("world", 1) for name, lay in LAYOUTS.items()}
        workers = {name: lay.get("workers", 0) for name, lay in LAYOUTS.items()}
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"sizes": layouts, "world": worlds, "workers": workers}))
        out = Path(tmp) / "out.json"
        subprocess.run([str(peers_python()), __file__, "--peer-run", str(job), str(out)], check=True)
        return json.loads(out.read_text())


def _import_mosaic_shuffles() -> tuple:
    """streaming.base's shuffle and partition functions, without ``streaming/__init__`` (it
    imports torchvision, whose PyPI wheel does not load against the CPU torch wheel)."""
    if "streaming" not in sys.modules:
        package = types.ModuleType("streaming")
        package.__path__ = list(importlib.util.find_spec("streaming").submodule_search_locations)
        sys.modules["streaming"] = package
    from streaming.base.partition import get_partitions
    from streaming.base.shuffle import get_shuffle

    return get_partitions, get_shuffle


def mosaic_streams(sizes: np.ndarray, epoch: int, algo: str, world: int, workers: int) -> list[np.ndarray]:
    """Each rank's samples in reading order, as StreamingDataset's ``random`` batching makes them
    (``get_partitions`` of the epoch's positions, then ``get_shuffle``; one node, its defaults)."""
    get_partitions, get_shuffle = _import_mosaic_shuffles()
    nodes = 1
    block = max(4_000_000 // nodes, 1 << 18)
    ids = get_partitions("relaxed", int(sizes.sum()), nodes, 1, world, max(1, workers), BATCH)
    shuffle = get_shuffle(algo, sizes, nodes, 0, epoch, block)
    ids = np.where(ids != -1, shuffle[np.maximum(ids, 0)], -1)
    out = []
    for rank in range(world):
        per_rank = ids[0, rank].transpose(1, 0, 2).reshape(-1)  # batch b of worker 0, 1, ..., then b+1
        out.append(per_rank[per_rank != -1])
    return out


class _Chunks:
    """What litdata's shuffles read of a Cache: the chunks' sample intervals."""

    _reader = None

    def __init__(self, sizes: np.ndarray):
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        self.intervals = [[a, a, a + int(n), a + int(n)] for a, n in zip(starts, sizes.tolist())]

    def get_chunk_intervals(self) -> list:
        return self.intervals


def litdata_streams(sizes: np.ndarray, epoch: int, world: int, workers: int) -> list[np.ndarray]:
    """Each rank's samples in reading order, as litdata's StreamingDataset iterates FullShuffle:
    its chunks and intervals per worker, each chunk's samples in FullShuffle's order, the rank's
    workers' batches round-robin."""
    from litdata.streaming.shuffle import FullShuffle
    from litdata.utilities.env import _DistributedEnv

    chunks = _Chunks(sizes)
    shuffle = FullShuffle(chunks, seed=0, drop_last=False)
    n = max(1, workers)
    env = _DistributedEnv(world, 0, 1)
    per_worker, intervals = shuffle.get_chunks_and_intervals_per_workers(env, n, BATCH, epoch + 1)
    out = []
    for rank in range(world):
        streams = []
        for w in range(rank * n, (rank + 1) * n):
            parts = [
                shuffle(np.arange(iv[1], iv[2]), len(chunks.intervals), epoch + 1, int(c))
                for c, iv in zip(per_worker[w], intervals[w])
            ]
            streams.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        batches = [[s[i : i + BATCH] for i in range(0, len(s), BATCH)] for s in streams]
        turns = range(max(map(len, batches)))
        out.append(np.concatenate([b[t] for t in turns for b in batches if t < len(b)]))
    return out


def peer_run(job_path: str, out_path: str) -> None:
    """Inside the peers' venv: every layout's figures from the packages' own functions."""
    from importlib.metadata import version

    job = json.loads(Path(job_path).read_text())
    names = {
        "mosaic py1br": f"mosaic py1br ({version('mosaicml-streaming')})",
        "mosaic py1e": f"mosaic py1e ({version('mosaicml-streaming')})",
        "litdata": f"litdata FullShuffle ({version('litdata')})",
    }
    out: dict = {}
    for layout, sizes in job["sizes"].items():
        sizes = np.asarray(sizes, np.int64)
        world, workers = job["world"][layout], job["workers"][layout]
        row = {}
        for algo in ("py1br", "py1e"):
            streams = [mosaic_streams(sizes, e, algo, world, workers) for e in (0, 1)]
            row[names[f"mosaic {algo}"]] = figures(streams)
        row[names["litdata"]] = figures([litdata_streams(sizes, e, world, workers) for e in (0, 1)])
        out[layout] = row
    Path(out_path).write_text(json.dumps(out))


# ----------------------------------------------------------------------------------------------
# Cost: one epoch, whole shards against blocks, local CPU and remote requests


def one_epoch(source: Any, min_block_tokens: int, epoch: int) -> tuple[float, float]:
    import wdsllm
    from wdsllm.load import plan

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
    """Whole shards against blocks, for the dataset and the two-source mixture of it: one epoch
    locally (best of ``repeat``, alternating) and one over HTTP (its GETs counted)."""
    from remote_fixtures import HttpServer

    out: dict = {}
    server = HttpServer()
    server.root = Path(data).resolve().parent
    url = server.url_for(Path(data).resolve())
    orders = (("shards", WHOLE_SHARDS), ("blocks", 1 << 18))
    try:
        for what, local, remote in (("", data, url), ("mixture ", mixture_of(data), mixture_of(url))):
            for name, _ in orders:
                out[what + name] = {"wall_s": 1e9, "cpu_s": 1e9}
            for r in range(repeat):
                for name, mbt in orders:
                    wall, cpu = one_epoch(local, mbt, r)
                    out[what + name]["wall_s"] = min(out[what + name]["wall_s"], wall)
                    out[what + name]["cpu_s"] = min(out[what + name]["cpu_s"], cpu)
            for name, mbt in orders:
                server.reset()
                wall, cpu = one_epoch(remote, mbt, 0)
                out[what + name].update(http_wall_s=wall, http_cpu_s=cpu, http_gets=server.count("*.tar"))
    finally:
        server.close()
    return out


def _fmt(key: str, value: float | int) -> str:
    return f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"


def quality(data: str, with_packages: bool) -> dict:
    """Every layout's figures: ours (whole shards, blocks) and the peers' (re-implemented, or with
    ``with_packages`` their own packages)."""
    from wdsllm.load import plan

    default = plan.MIN_BLOCK_TOKENS
    packaged = run_peers(data) if with_packages else {}
    out: dict = {}
    for lname, layout in LAYOUTS.items():
        row = {}
        if layout.get("shards"):  # eight shards permuted per epoch: the previous order at 8 shards
            row["shards (previous)"] = ours(data, default, layout)
        else:
            row["shards (previous)"] = ours(data, WHOLE_SHARDS, layout)
            row["blocks (wdsllm)"] = ours(data, default, layout)
        row.update(packaged.get(lname) or peers(data, layout))
        out[lname] = row
        for name, f in row.items():
            print(f"{lname:15s} {name:28s} " + "  ".join(f"{k} {v:.3f}" for k, v in f.items()), flush=True)
    plan.MIN_BLOCK_TOKENS = default
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "bench-out" / "wiki-docs"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--peers", action="store_true", help="the peers' own packages (in bench-out/peers-venv)")
    ap.add_argument("--no-cost", action="store_true", help="shuffle quality only")
    ap.add_argument("--no-quality", action="store_true", help="cost only")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    results: dict = {"quality": {} if args.no_quality else quality(args.data, args.peers), "cost": {}}
    if not args.no_cost:
        results["cost"] = cost(args.data, args.repeat)
    for name, c in results["cost"].items():
        print(f"cost {name:16s} " + "  ".join(_fmt(k, v) for k, v in c.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer-run"]:
        peer_run(sys.argv[2], sys.argv[3])
    else:
        main()
