"""What entering remote shards at a group (groups.npy, format 2) saves when ranks split a shard.

    python tools/bench_ranged.py [--work bench-out] [--worlds 1,4,16]

Packs the wiki corpus (GPT-2, packed rows of 2,048) into one shard in --work once
(``wiki-packed-v2``; format 2, so it has groups.npy), makes a format-1 copy of it without
groups.npy (``wiki-packed-v1``), and serves both with the test fixtures' HTTP server in a process of
its own. For each world size W it streams one epoch of every rank 0..W-1 in turn (explicit
``rank=``, 0 workers, batch 8, no cache): the ranks' shares are contiguous ranges of rows, so all
but rank 0 begin inside the shard. Reported per W and format: body bytes received from the server
by all ranks together (``storage.stats()["received_bytes"]``), as a multiple of the shard's size,
and the wall time of the W epochs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_remote import DATA, start_server  # noqa: E402

import wdsllm  # noqa: E402
from wdsllm import format as fmt  # noqa: E402
from wdsllm import storage  # noqa: E402


def ensure_datasets(work: Path) -> tuple[Path, Path]:
    v2, v1 = work / "wiki-packed-v2", work / "wiki-packed-v1"
    index = v2 / fmt.INDEX_NAME
    if not index.exists() or json.loads(index.read_text()).get("version", 1) < 2:
        cmd = [
            sys.executable,
            "-m",
            "wdsllm.cli",
            "pack",
            str(DATA / "corpora/wiki/wiki-*.jsonl.gz"),
            "-o",
            str(v2),
            "-t",
            str(DATA / "tokenizers/gpt2.json"),
            "--mode",
            "packed",
            "--seq-len",
            "2048",
            "--overwrite",
            "-q",
        ]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    shutil.rmtree(v1, ignore_errors=True)
    shutil.copytree(v2, v1)
    body = json.loads((v1 / fmt.INDEX_NAME).read_text())
    body["version"] = 1
    body.pop("groups_file", None)
    (v1 / fmt.INDEX_NAME).write_text(json.dumps(body, indent=1))
    (v1 / fmt.GROUPS_NAME).unlink()
    return v2, v1


def epoch_of_every_rank(url: str, world: int) -> tuple[int, float, int]:
    """(bytes received, seconds, rows) for one epoch of each rank of ``world``, one after another."""
    storage.reset_stats()
    t0 = time.perf_counter()
    rows = 0
    for rank in range(world):
        loader = wdsllm.loader(url, batch_size=8, seed=0, rank=rank, world_size=world, equal_batches=False)
        rows += sum(len(b["rows"]) for b in loader)
    return storage.stats()["received_bytes"], time.perf_counter() - t0, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(REPO / "bench-out"))
    ap.add_argument("--worlds", default="1,4,16")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    v2, v1 = ensure_datasets(Path(args.work))
    shard_bytes = sum(e.bytes for e in fmt.Index.from_json((v2 / fmt.INDEX_NAME).read_text()).shards)
    server, base = start_server("http", Path(args.work))
    try:
        print(f"one shard of {shard_bytes / 1e6:.1f} MB; HTTP server {base}\n")
        print("| ranks | format | received | x shard | time |")
        print("|---|---|---|---|---|")
        for world in (int(w) for w in args.worlds.split(",")):
            for name, path in (("1 (no groups.npy)", v1), ("2 (groups.npy)", v2)):
                received, seconds, _rows = epoch_of_every_rank(f"{base}/{path.name}/", world)
                print(
                    f"| {world} | {name} | {received / 1e6:,.1f} MB | {received / shard_bytes:.2f} | {seconds:.2f} s |",
                    flush=True,
                )
    finally:
        server.stdin.close()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
