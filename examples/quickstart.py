"""Pack a real local corpus and stream batches from it: the project's main job, end to end.

    python examples/quickstart.py [--corpus GLOB] [--tokenizer PATH] [--out DIR]

Defaults use ../shared/data (Wikipedia, GPT-2 tokenizer); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import wdsllm

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(DATA / "corpora" / "wiki" / "wiki-0[01].jsonl.gz"))
    ap.add_argument("--tokenizer", default=str(DATA / "tokenizers" / "gpt2.json"))
    ap.add_argument("--out", default=str(REPO / "demo-out"))
    ap.add_argument("--batches", type=int, default=5)
    args = ap.parse_args()

    docs_dir, packed_dir = f"{args.out}/docs", f"{args.out}/packed"
    for out, extra in ((docs_dir, []), (packed_dir, ["--mode", "packed", "--seq-len", "1024"])):
        cmd = ["wdsllm", "pack", args.corpus, "-o", out, "-t", args.tokenizer, "--overwrite", *extra]
        print("$", " ".join(cmd), flush=True)
        subprocess.run([sys.executable, "-m", "wdsllm.cli", *cmd[1:]], check=True)

    print("\nstreaming docs-mode batches (batch 16, max_len 512, 2 workers):")
    loader = wdsllm.loader(docs_dir, batch_size=16, max_len=512, num_workers=2, seed=0)
    t0 = time.perf_counter()
    tokens = docs = batches = 0
    for batch in loader:
        if batches < args.batches:
            print(
                f"  batch {batches}: input_ids {tuple(batch['input_ids'].shape)}, "
                f"real tokens {int(batch['attention_mask'].sum())}, first doc id {int(batch['docs'][0, 0])}"
            )
        batches += 1
        tokens += int(batch["lengths"].sum())
        docs += len(batch["lengths"])
    dt = time.perf_counter() - t0
    print(
        f"  one epoch: {batches} batches, {docs:,} documents, {tokens:,} tokens in {dt:.2f} s "
        f"({tokens / dt / 1e6:.1f}M tokens/s)"
    )

    print("\nstreaming packed rows (batch 8 x 1024, document boundaries):")
    loader = wdsllm.loader(packed_dir, batch_size=8, boundaries=True, seed=0)
    for i, batch in enumerate(loader):
        if i >= args.batches:
            break
        print(
            f"  batch {i}: input_ids {tuple(batch['input_ids'].shape)}, documents in row 0: "
            f"{int((batch['docs'][0] >= 0).sum())}, max_seqlen {batch['max_seqlen']}"
        )
    print(f"\nshards and index in {args.out}; inspect with: wdsllm info {docs_dir}")


if __name__ == "__main__":
    main()
