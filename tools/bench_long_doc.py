#!/usr/bin/env python
"""Peak memory of `wdsllm pack` for one long document (issue #19, item 8; `--max-doc-bytes`).

Packs, in a fresh process each, a jsonl of a few short lines and one document of N MiB (wiki text
repeated), with --max-doc-bytes above N so that it is encoded, and reports the peak RSS of the
packing process (VmHWM) and of the largest tokenizer worker (sampled every 50 ms), and the peak of
the worker per MiB of document above its baseline (a pack of the short lines alone). Then packs a
line of --skip-mib MiB under the default limit: it is skipped (too_long), never read whole.

    python tools/bench_long_doc.py                  # 1, 4 and 16 MiB, then a 50 MiB line skipped
    python tools/bench_long_doc.py --sizes 1 2 --skip-mib 20
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path

from bench_pack import DATA, run_pack


def write_input(path: Path, doc_mib: float) -> None:
    with gzip.open(DATA / "corpora" / "wiki" / "wiki-00.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(2000), f)]
    body = "\n".join(texts)
    target = int(doc_mib * (1 << 20))
    long_text = (body * (target // max(1, len(body.encode())) + 1)).encode()[:target].decode("utf-8", "ignore")
    with open(path, "w", encoding="utf-8") as out:
        for t in texts[:20]:
            out.write(json.dumps({"text": t}) + "\n")
        if doc_mib:
            out.write(json.dumps({"text": long_text}, ensure_ascii=False) + "\n")
        for t in texts[20:40]:
            out.write(json.dumps({"text": t}) + "\n")


def measure(tmp: Path, doc_mib: float, max_doc_bytes: int | None, tokenizer: Path) -> dict:
    source = tmp / f"doc-{doc_mib}.jsonl"
    write_input(source, doc_mib)
    cfg_extra = {"on_error": "skip"} | ({"max_doc_bytes": max_doc_bytes} if max_doc_bytes else {})
    result = run_pack([source], tokenizer, tmp / "out", 1, **cfg_extra)
    source.unlink()
    shutil.rmtree(tmp / "out", ignore_errors=True)
    return {
        "doc_mib": doc_mib,
        "main_mib": result["main_rss_kib"] / 1024,
        "worker_mib": result["worker_rss_kib"] / 1024,
        "seconds": result["process_seconds"],
        "documents": result["documents"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16], help="document sizes in MiB to encode")
    ap.add_argument("--skip-mib", type=float, default=50, help="a line this long is packed under the default limit")
    ap.add_argument("--tokenizer", type=Path, default=DATA / "tokenizers" / "gpt2.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-long-doc-"))
    try:
        base = measure(tmp, 0, None, args.tokenizer)
        print(
            f"baseline (short lines only): packing process {base['main_mib']:.0f} MiB, "
            f"worker {base['worker_mib']:.0f} MiB"
        )
        for size in args.sizes:
            m = measure(tmp, size, int((size + 1) * (1 << 20)), args.tokenizer)
            per = (m["worker_mib"] - base["worker_mib"]) / size
            print(
                f"{size:g} MiB document encoded: packing process {m['main_mib']:.0f} MiB, worker {m['worker_mib']:.0f} "
                f"MiB, {per:.0f} MiB of worker per MiB of document, {m['seconds']:.1f} s"
            )
        m = measure(tmp, args.skip_mib, None, args.tokenizer)
        print(
            f"{args.skip_mib:g} MiB line under the default --max-doc-bytes (skipped, too_long): packing process "
            f"{m['main_mib']:.0f} MiB, worker {m['worker_mib']:.0f} MiB, {m['documents']} documents packed, "
            f"{m['seconds']:.1f} s"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
