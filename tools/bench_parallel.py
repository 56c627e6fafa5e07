"""What replica peers cost per batch: reading for themselves against one reader broadcasting, the
agreement check, and the context-parallel split, in CPU seconds (and wall) per batch.

    python tools/bench_parallel.py [--data bench-out/wiki-docs] [--batches 200]

Two processes on this machine form one replica group (gloo on 127.0.0.1, CPU tensors), as the
two tensor-parallel peers of one data-parallel rank would; each builds the loader with
``dp_group`` (itself) and ``replica_group`` (both), over the same batches, two shapes of them:
packed rows (``batching="pack"``, 8 x 2048, with boundaries) and padded documents (batch 32),
from the packed dataset, and padded documents from the raw Wikipedia text (tokenized by the reader).
- ``read``: each peer reads and batches; CPU per batch of each.
- ``broadcast``: rank 0 reads and sends, rank 1 receives; CPU per batch of each.
- the agreement check alone (digest + all-gather of one int64), per batch, on both;
- the CP split (zigzag, CP 2 and 4) of the same batches, in one process;
- the header a pipeline's first stage sends its middle stages each step under ``read`` (the
  middle view ``{"epoch"}`` and the progress, no tensors), rank 0 to rank 1; ``--feed-only``
  measures this alone.
Ratios are against ``read`` measured in the same run. The dataset is the docs-mode Wikipedia
pack of ``tools/bench_batching.py`` (made by it where missing).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
import time
from itertools import islice
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {
    "rows 8x2048": {"batching": "pack", "batch_size": 8, "seq_len": 2048, "boundaries": True},
    "docs 32": {"batch_size": 32, "max_len": 2048, "pad_to_multiple_of": 8},
    "raw text, docs 32": {"batch_size": 32, "max_len": 2048, "pad_to_multiple_of": 8},
}
#: the one shape read from raw text (tokenized on the way in): where reading costs most
RAW = "raw text, docs 32"
DATA = REPO.parent / "shared" / "data"


def _timed(batches) -> tuple[float, float, list]:
    """CPU and wall seconds to draw every batch of ``batches``, and the batches."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = list(batches)
    return time.process_time() - cpu, time.perf_counter() - wall, out


def _feed_header(rank: int, steps: int) -> dict:
    """CPU and wall per step of the first stage's header to a middle stage (rank 0 to rank 1)."""
    import torch
    import torch.distributed as dist

    from wdsllm.load.cursor import Progress
    from wdsllm.load.layout import ReplicaGroup
    from wdsllm.load.replicas import Wire

    wire = Wire(ReplicaGroup(dist.group.WORLD, rank, 2, 0), torch.device("cpu"))
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for step in range(steps):
        if rank == 0:  # the progress of a reader with 2 workers, as a middle stage mirrors it
            positions = {0: (0, step // 2 + 1, None), 1: (0, (step + 1) // 2, None)}
            wire.send({"epoch": 0}, Progress(0, step + 1, None, 0, 0, positions, step % 2, [0, 1]))
        else:
            wire.receive()
    return {"cpu": (time.process_time() - cpu) / steps, "wall": (time.perf_counter() - wall) / steps}


def _peer(rank: int, port: int, data: str, batches: int, results, feed_only: bool = False) -> None:
    import torch
    import torch.distributed as dist

    import wdsllm
    from wdsllm.load.agree import Agreement

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)  # as in every measuring process (docs/benchmarks.md)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    alone = [dist.new_group([r]) for r in range(2)]
    out = {("pp feed header", "step"): _feed_header(rank, max(batches, 1000))}
    for shape, kw in {} if feed_only else SHAPES.items():
        for mode in ("read", "broadcast"):
            source = _raw_source() if shape == RAW else data
            loader = wdsllm.loader(
                source, dp_group=alone[rank], replica_group=dist.group.WORLD, replicas=mode, seed=1, **kw
            )
            next(iter(loader))  # opened, first pass begun: not what a batch costs
            dist.barrier()
            cpu, wall, got = _timed(islice(iter(loader), batches))
            dist.barrier()
            out[(shape, mode)] = {"cpu": cpu / len(got), "wall": wall / len(got)}
            loader.close()
        agreement = Agreement(loader.layout, loader.description.settings())
        dist.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        for batch in got:
            agreement.check(batch, "bench")
        out[(shape, "check")] = {
            "cpu": (time.process_time() - cpu) / len(got),
            "wall": (time.perf_counter() - wall) / len(got),
        }
        if rank == 0:
            out[(shape, "cp")] = _cp_split(got)
    results.put((rank, {f"{k[0]}|{k[1]}": v for k, v in out.items()}))
    dist.barrier()
    dist.destroy_process_group()


def _raw_source():
    import wdsllm

    wiki = sorted(str(p) for p in (DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))
    return wdsllm.RawTextSource(wiki, tokenizer=str(DATA / "tokenizers" / "gpt2.json"))


def _cp_split(batches: list) -> dict:
    from wdsllm.load.cpsplit import cp_slice
    from wdsllm.load.layout import CpSlice

    out = {}
    for size in (2, 4):
        cpu = time.process_time()
        for batch in batches:
            for r in range(size):  # every rank's slice: the cost of one rank is this / size
                cp_slice(batch, CpSlice(r, size, "zigzag"))
        out[f"cpu_cp{size}"] = (time.process_time() - cpu) / len(batches) / size
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(REPO / "bench-out" / "wiki-docs"))
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--feed-only", action="store_true", help="only the pipeline feed header per step")
    args = ap.parse_args()
    if not args.feed_only and not (Path(args.data) / "index.json").exists():
        from bench_batching import ensure_docs_dataset  # packs the corpus once

        ensure_docs_dataset(Path(args.data).parent)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_peer, args=(r, port, args.data, args.batches, results, args.feed_only)) for r in range(2)
    ]
    for p in procs:
        p.start()
    got = {}
    while len(got) < len(procs):
        try:
            rank, figures = results.get(timeout=5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a peer failed (exit codes {dead}); its traceback is above") from None
            continue
        got[rank] = figures
    for p in procs:
        p.join()
    report(got, args.batches, {} if args.feed_only else SHAPES)


def report(got: dict, batches: int, shapes: dict) -> None:
    lead, peer = got[0], got[1]
    sender, receiver = lead["pp feed header|step"], peer["pp feed header|step"]
    print(f"pipeline feed header per step, CPU ms (wall ms): first stage {sender['cpu'] * 1e3:.3f}", end=" ")
    print(f"({sender['wall'] * 1e3:.3f}), middle stage {receiver['cpu'] * 1e3:.3f} ({receiver['wall'] * 1e3:.3f})")
    summary = {"pp feed header": {"first stage": sender, "middle stage": receiver}}
    if shapes:
        print(f"per batch over {batches} batches; CPU ms (wall ms); ratios against read")
    for shape in shapes:
        read = (lead[f"{shape}|read"]["cpu"] + peer[f"{shape}|read"]["cpu"]) / 2
        rows = {
            "read, each peer": (read, (lead[f"{shape}|read"]["wall"] + peer[f"{shape}|read"]["wall"]) / 2),
            "broadcast, reader": (lead[f"{shape}|broadcast"]["cpu"], lead[f"{shape}|broadcast"]["wall"]),
            "broadcast, receiver": (peer[f"{shape}|broadcast"]["cpu"], peer[f"{shape}|broadcast"]["wall"]),
            "agreement check": (lead[f"{shape}|check"]["cpu"], lead[f"{shape}|check"]["wall"]),
            "CP split, zigzag CP=2 (one rank)": (lead[f"{shape}|cp"]["cpu_cp2"], None),
            "CP split, zigzag CP=4 (one rank)": (lead[f"{shape}|cp"]["cpu_cp4"], None),
        }
        print(f"\n{shape}")
        for name, (cpu, wall) in rows.items():
            shown = f"{cpu * 1e3:8.3f}" + (f" ({wall * 1e3:7.3f})" if wall is not None else " " * 10)
            print(f"  {name:34s} {shown}   x{cpu / read:5.2f}")
        summary[shape] = {k: {"cpu_s": v[0], "wall_s": v[1], "ratio": v[0] / read} for k, v in rows.items()}
    print("\n" + json.dumps(summary))


if __name__ == "__main__":
    main()
