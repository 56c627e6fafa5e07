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


class Epoch:
    """What one epoch of docs-mode batches held. With ``max_len`` a longer document comes as
    several pieces (items of their own, numbered in ``docs[:, 1]``): it is counted once, by its
    first piece, and the pieces apart."""

    def __init__(self) -> None:
        self.batches = self.documents = self.pieces = self.tokens = 0

    def add(self, batch: dict) -> None:
        self.batches += 1
        self.pieces += len(batch["lengths"])
        self.documents += int((batch["docs"][:, 1] == 0).sum())
        self.tokens += int(batch["lengths"].sum())

    def summary(self, seconds: float) -> str:
        return (
            f"{self.batches} batches, {self.documents:,} documents in {self.pieces:,} pieces, {self.tokens:,} tokens "
            f"in {seconds:.2f} s ({self.tokens / seconds / 1e6:.1f}M tokens/s)"
        )


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
    epoch = Epoch()
    for batch in loader:
        if epoch.batches < args.batches:
            print(
                f"  batch {epoch.batches}: input_ids {tuple(batch['input_ids'].shape)}, "
                f"real tokens {int(batch['attention_mask'].sum())}, first doc id {int(batch['docs'][0, 0])}"
            )
        epoch.add(batch)
    print(f"  one epoch: {epoch.summary(time.perf_counter() - t0)}")

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
