"""`wdsllm merge` of many small parts (the output of a cluster pack): time, CPU and peak memory.

    python tools/bench_merge_parts.py [--parts 10000] [--docs 2,200] [--work /tmp/bench-merge-parts]

For each --docs value: one real part is packed with ``pack_part`` (that many synthetic documents
of about 100 tokens, GPT-2), then cloned into --parts parts (``part-NNNNN/``: the shards and side
files hard-linked, ``index.json`` rewritten with the clone's ``part_id``), and ``wdsllm merge DIR -o
DIR`` (in place, moving shards) runs in a child process, timed from outside: wall seconds, CPU
seconds (user + system) and the child's peak RSS. Equal peaks for parts of 2 and of 200 documents
say that memory follows the number of parts and shards, not the number of tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from wdsllm import format as fmt  # noqa: E402
from wdsllm.pack.part import PartOptions, pack_part, part_name  # noqa: E402

GPT2 = REPO.parent / "shared" / "data" / "tokenizers" / "gpt2.json"
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "as",
    "with",
    "by",
    "at",
    "from",
    "that",
    "his",
    "an",
    "are",
    "were",
    "which",
]


def records(docs: int):
    """Synthetic documents of about 100 tokens, each different."""
    for i in range(docs):
        yield {"text": " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(96)) + f" {i}"}


def make_parts(root: Path, parts: int, docs: int) -> int:
    """part-00000 packed for real, cloned into parts-1 more; returns the tokens of one part."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    manifest = pack_part(records(docs), 0, str(root), PartOptions.of(str(GPT2), sample_tokens=4096))
    template = root / part_name(0)
    index = fmt.Index.from_json((template / fmt.INDEX_NAME).read_text())
    names = [p.name for p in template.iterdir() if p.name != fmt.INDEX_NAME]
    for part_id in range(1, parts):
        clone = root / part_name(part_id)
        clone.mkdir()
        for name in names:
            os.link(template / name, clone / name)
        index.options["part_id"] = part_id
        (clone / fmt.INDEX_NAME).write_text(index.to_json())
    return manifest.tokens


CHILD = """
import resource, sys, time
from wdsllm.cli import main
sys.argv = ["wdsllm", "merge", sys.argv[1], "-o", sys.argv[1], "-q"]
start = time.perf_counter()
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
usage = resource.getrusage(resource.RUSAGE_SELF)
print(time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)
"""


def timed_merge(root: Path) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MiB) of `wdsllm merge root -o root`, in a child process of its own
    (its import time excluded from wall, included in CPU)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(root)], check=True, capture_output=True, text=True)
    wall, cpu, peak = map(float, out.stdout.split()[-3:])
    return wall, cpu, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=int, default=10_000)
    ap.add_argument("--docs", default="2,200", help="documents per part, one run per value")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-merge-parts"))
    args = ap.parse_args()
    print(f"{'parts':>6} {'docs/part':>9} {'tokens':>12} {'build s':>8} {'merge s':>8} {'cpu s':>7} {'peak MiB':>9}")
    for docs in (int(d) for d in args.docs.split(",")):
        root = args.work / f"docs{docs}"
        start = time.perf_counter()
        tokens = make_parts(root, args.parts, docs)
        built = time.perf_counter() - start
        wall, cpu, peak = timed_merge(root)
        index = fmt.Index.from_json((root / fmt.INDEX_NAME).read_text())
        assert index.documents == docs * args.parts, "the merge lost or added documents"
        total = tokens * args.parts
        print(f"{args.parts:>6} {docs:>9} {total:>12,} {built:>8.1f} {wall:>8.1f} {cpu:>7.1f} {peak:>9.0f}", flush=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
