"""Raw-text streaming (#15): tokens/s of wdsllm.loader(..., tokenizer=) against the tokenizer alone,
against HF datasets streaming with .map, and the time to the first batch after a resume at 90%.

    python tools/bench_raw.py [--work bench-out/raw] [--files 2] [--skip-hf]

Writes the first ``--files`` wiki files (../shared/data/corpora/wiki) as plain .jsonl in WORK (so
that files divide into byte-range units) and measures in one run, GPT-2 tokenizer, EOS appended:

- baseline: ``Tokenizer.encode_batch_fast`` on one thread over the same texts (parsed beforehand),
  batches of 1,000: the ceiling of one core.
- ``wdsllm.loader(files, tokenizer=..., batch_size=64, max_len=2048)`` with 1 and 2 workers, one
  epoch: tokens/s, and per core against the baseline (target >= 0.85x). Per core is measured two
  ways: wall time / workers, and tokens per CPU second of the main process and its workers (which
  a busy shared machine disturbs far less than wall time).
- HF datasets: ``load_dataset("json", data_files=..., streaming=True).map(tokenize, batched=True)``
  into a ``torch.utils.data.DataLoader`` with the same worker counts and batch size (collate pads);
  run with a virtualenv the tool makes under WORK (``datasets`` is not our dependency; torch,
  tokenizers and transformers come from the running interpreter's site-packages, after the venv's
  own). Target: wdsllm >= 2x. Two tokenize functions: the recipe of HF's docs and ``run_clm.py``
  (a ``transformers`` fast tokenizer called on the batch: what users write), and the tokenizers
  library's ``encode_batch_fast`` (the cheapest call there is: HF's overhead alone).
- time to first batch with a count sidecar: a fresh start, and a resume from a state saved at 90%
  of the epoch (target <= 2x), 1 worker.
- the same without a sidecar, over the files as one ``.jsonl.zst`` (one unit: nothing to seek to):
  the resume passes over the first 90% by decompressing and parsing only, never tokenizing, in
  every batching mode (fixed, token budget, documents split into pieces, pack, concat).
  ``--resume-only`` measures these resumes alone.

The machine is shared: figures are the best of ``--repeat`` runs, ratios from the same run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
WIKI = sorted((DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))
TOKENIZER = str(DATA / "tokenizers" / "gpt2.json")
BATCH = 64
MAX_LEN = 2048

HF_SCRIPT = r"""
import json, sys, time
import torch
from datasets import load_dataset
from tokenizers import Tokenizer
files, workers, batch = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
eos = 50256
if sys.argv[5] == "transformers":  # the recipe of HF's docs and run_clm.py: the tokenizer called on the batch
    from transformers import PreTrainedTokenizerFast
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=sys.argv[4])
    def tokenize(b):
        return {"input_ids": [ids[:2047] + [eos] for ids in hf_tok(b["text"])["input_ids"]]}
else:  # the fastest call the tokenizers library has
    tok = Tokenizer.from_file(sys.argv[4])
    def tokenize(b):
        return {"input_ids": [e.ids[:2047] + [eos] for e in tok.encode_batch_fast(b["text"], add_special_tokens=False)]}
def collate(rows):
    n = max(len(r["input_ids"]) for r in rows)
    out = torch.full((len(rows), n), eos, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
    return out, sum(len(r["input_ids"]) for r in rows)
ds = load_dataset("json", data_files=files, split="train", streaming=True)
ds = ds.map(tokenize, batched=True, remove_columns=["id", "title", "text"])
loader = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=collate)
import resource
def cpu():
    use = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in use)
t = time.perf_counter(); c = cpu(); tokens = 0
for _, n in loader:
    tokens += n
del loader
print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t, "cpu": cpu() - c}))
"""


#: how the HF runs tokenize: as HF's docs and examples do, and with the tokenizers library's fastest call
HF_RECIPES = {
    "transformers": "PreTrainedTokenizerFast called on the batch",
    "tokenizers": "Tokenizer.encode_batch_fast",
}


def prepare(work: Path, files: int) -> tuple[list[str], list[str]]:
    paths, texts = [], []
    for src in WIKI[:files]:
        dst = work / Path(src.name).with_suffix("")  # wiki-00.jsonl
        if not dst.exists():
            with gzip.open(src, "rb") as f, open(f"{dst}.tmp", "wb") as g:
                g.write(f.read())
            os.replace(f"{dst}.tmp", dst)
        paths.append(str(dst))
        with open(dst, encoding="utf-8") as f:
            texts += [t for t in (json.loads(line)["text"] for line in f) if t.strip()]
    return paths, texts


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (DataLoader workers): what a run costs,
    whatever else the machine runs."""
    return sum(
        resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )


def baseline(texts: list[str]) -> tuple[float, float]:
    """(tokens per wall second, per CPU second) of encode_batch_fast on one thread."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    t, c = time.perf_counter(), cpu_seconds()
    tokens = 0
    for i in range(0, len(texts), 1000):
        tokens += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts[i : i + 1000], add_special_tokens=False))
    return tokens / (time.perf_counter() - t), tokens / (cpu_seconds() - c)


def wdsllm_rate(paths: list[str], workers: int) -> tuple[float, float]:
    """(tokens per wall second, per CPU second of the main process and its workers) of one epoch."""
    import wdsllm

    loader = wdsllm.loader(
        paths, tokenizer=TOKENIZER, batch_size=BATCH, max_len=MAX_LEN, num_workers=workers, unit_bytes=4 << 20
    )
    t, c = time.perf_counter(), cpu_seconds()
    tokens = sum(int(b["lengths"].sum()) for b in loader)
    wall = time.perf_counter() - t
    del loader
    return tokens / wall, tokens / (cpu_seconds() - c)


def hf_venv(work: Path) -> str:
    venv = work / "hf-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # tokenizers and torch come from this interpreter's site-packages (the same versions as ours)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "datasets"], check=True)
    return str(python)


def hf_rate(python: str, paths: list[str], workers: int, recipe: str) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"], TOKENIZERS_PARALLELISM="false")
    # the venv's own packages come first; torch (and the tokenizers wheel) from this interpreter's
    out = subprocess.run(
        [python, "-c", HF_SCRIPT, json.dumps(paths), str(workers), str(BATCH), TOKENIZER, recipe],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["tokens"] / r["seconds"], r["tokens"] / r["cpu"]


def first_batch(paths: list[str], counts: str) -> tuple[float, float]:
    """(seconds to the first batch of a fresh start, of a resume at 90%), 1 worker, counts given."""
    import wdsllm

    def make():
        return wdsllm.loader(
            paths, tokenizer=TOKENIZER, batch_size=BATCH, num_workers=1, counts=counts, unit_bytes=4 << 20
        )

    run = make()
    total = len(run)
    it = iter(run)
    for _ in range(int(total * 0.9)):
        next(it)
    state = run.state_dict()
    del it, run
    fresh, resumed, _ = first_batches(make, state)
    return fresh, resumed


def first_batches(make, state: dict) -> tuple[float, float, dict]:
    """(seconds to the first batch of a fresh loader, of one resumed from ``state``; that batch)."""
    t = time.perf_counter()
    next(iter(make()))
    fresh = time.perf_counter() - t
    t = time.perf_counter()
    resumed = make()
    resumed.load_state_dict(state)
    batch = next(iter(resumed))
    return fresh, time.perf_counter() - t, batch


def compressed_first_batch(path: str, mode: dict) -> tuple[float, float]:
    """(seconds to the first batch of a fresh start, of a resume at 90%) of one .jsonl.zst, no
    sidecar, 1 worker; the resumed batch checked against the uninterrupted run's."""
    import wdsllm

    def make():
        source = wdsllm.RawTextSource(path, tokenizer=TOKENIZER)
        return wdsllm.loader(source, num_workers=1, seed=1, **mode)

    run = make()
    batches = sum(1 for _ in run)
    it = iter(run)
    for _ in range(int(batches * 0.9)):
        next(it)
    state = run.state_dict()
    expected = next(it)["input_ids"]
    del it, run
    fresh, elapsed, batch = first_batches(make, state)
    got = batch["input_ids"]
    assert got.equal(expected), "the resumed batch differs from the uninterrupted run's"
    return fresh, elapsed


def resume_without_sidecar(work: Path, texts: list[str], repeat: int) -> None:
    import zstandard

    path = work / "all.jsonl.zst"
    if not path.exists():
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    for name, mode in (
        ("fixed", dict(batch_size=BATCH, max_len=MAX_LEN, max_len_mode="truncate")),
        ("budget", dict(batching="bucket", max_tokens=BATCH * 512, batch_size=None)),
        ("pieces", dict(batch_size=BATCH, max_len=512)),  # documents split at max_len: the state's mark
        ("pack", dict(batching="pack", seq_len=MAX_LEN, batch_size=8)),
        ("concat", dict(batching="concat", seq_len=MAX_LEN, batch_size=8)),  # the hint: a document and a token
    ):
        fresh, resumed = min(compressed_first_batch(str(path), mode) for _ in range(repeat))
        print(
            f"first batch, one .jsonl.zst of {path.stat().st_size >> 20} MiB, no sidecar, {name}: fresh {fresh:.2f}s, "
            f"resumed at 90% {resumed:.2f}s = {resumed / fresh:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="bench-out/raw")
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--resume-only", action="store_true", help="only the resumes without a sidecar")
    args = ap.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    paths, texts = prepare(work, args.files)
    print(f"{len(paths)} files, {len(texts)} documents; os.cpu_count()={os.cpu_count()}")
    if args.resume_only:
        resume_without_sidecar(work, texts, args.repeat)
        return
    python = None if args.skip_hf else hf_venv(work)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeat):  # interleaved, so that each figure sees the same load on a shared machine
        runs = {"base": lambda: baseline(texts)}
        for workers in (1, 2):
            runs[f"wdsllm{workers}"] = lambda w=workers: wdsllm_rate(paths, w)
            if python:
                for recipe in HF_RECIPES:
                    runs[f"hf-{recipe}{workers}"] = lambda w=workers, r=recipe: hf_rate(python, paths, w, r)
        for name, run in runs.items():
            wall, cpu = run()
            old = best.get(name, (0.0, 0.0))
            best[name] = (max(old[0], wall), max(old[1], cpu))
    base, base_cpu = best["base"]
    print(f"encode_batch_fast, 1 thread: {base / 1e6:.3f}M tokens/s, {base_cpu / 1e6:.3f}M per CPU second")
    for workers in (1, 2):
        rate, cpu = best[f"wdsllm{workers}"]
        print(
            f"wdsllm raw, {workers} worker(s): {rate / 1e6:.3f}M tokens/s ({rate / workers / base:.2f}x per core by "
            f"wall time), {cpu / 1e6:.3f}M per CPU second = {cpu / base_cpu:.2f}x the tokenizer's"
        )
        for recipe, what in HF_RECIPES.items() if python else ():
            hf, hf_cpu = best[f"hf-{recipe}{workers}"]
            print(
                f"HF datasets streaming .map ({what}), {workers} worker(s): {hf / 1e6:.3f}M tokens/s, "
                f"{hf_cpu / 1e6:.3f}M per CPU second; wdsllm = {rate / hf:.2f}x by wall time, "
                f"{cpu / hf_cpu:.2f}x per CPU second"
            )
    counts = str(work / "counts.npz")
    subprocess.run(
        [sys.executable, "-m", "wdsllm", "count", *paths, "-t", TOKENIZER, "--unit-bytes", str(4 << 20), "-o", counts],
        check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    fresh, resumed = min(first_batch(paths, counts) for _ in range(args.repeat))
    print(f"first batch: fresh {fresh:.2f}s, resumed at 90% {resumed:.2f}s = {resumed / fresh:.2f}x")
    resume_without_sidecar(work, texts, args.repeat)


if __name__ == "__main__":
    main()
