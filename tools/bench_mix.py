"""Mixtures (#12): mixed loading speed against single-source speed, and how closely windows of
batches hold the weights, against litdata and mosaic streaming on the same data.

    python tools/bench_mix.py [--work bench-out] [--quick] [--peers] [--json results.json]

Packs the wiki corpus (GPT-2) into WORK once whole ("single") and once split into three sources
(files 0-2, 3-5, 6-7; with --quick one file each and a one-file single), unless they are there.
Then, in one run:

- throughput: ``wdsllm.loader`` over the mixture (weights 0.5/0.3/0.2 by tokens, an epoch of the
  sources' total tokens) against the single dataset, same mode and settings (docs: batch 64,
  max_len 2048; pack: rows of 2048, batch 8), 0 workers, best of --repeat passes, alternating;
- deviation: over windows of 10 consecutive batches, the largest gap between a source's share of
  the window's tokens and its weight (max over windows and sources), ours from the same runs.
- with --peers: the same deviation for litdata's ``CombinedStreamingDataset(weights=...)`` and
  mosaic streaming's ``Stream(proportion=...)`` over the same documents (written in their formats),
  both installed in a virtualenv this tool makes under WORK (never in the project's). Peers weigh
  samples, so they get the token weights turned into sample weights (divided by each source's mean
  document length, renormalised): the fairest setting a user could write.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's wdsllm, not an installed one
DATA = REPO.parent / "shared" / "data"
WIKI = sorted(str(p) for p in (DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))
TOKENIZER = str(DATA / "tokenizers" / "gpt2.json")
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}
WINDOW = 10
BATCH = 64
SEQ_LEN = 2048


def pack(inputs: list[str], out: Path) -> None:
    if (out / "index.json").exists():
        return
    cmd = [sys.executable, "-m", "wdsllm", "pack", *inputs, "-o", str(out), "--tokenizer", TOKENIZER, "--workers", "2"]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def datasets(work: Path, quick: bool) -> tuple[dict[str, str], str]:
    parts = {"a": WIKI[:1], "b": WIKI[1:2], "c": WIKI[2:3]} if quick else {"a": WIKI[:3], "b": WIKI[3:6], "c": WIKI[6:]}
    tag = "quick" if quick else "full"
    sources = {}
    for name, files in parts.items():
        pack(files, work / f"mix-{tag}-{name}")
        sources[name] = str(work / f"mix-{tag}-{name}")
    single = work / f"mix-{tag}-single"
    pack(WIKI[:1] if quick else WIKI, single)
    return sources, str(single)


MODES = {
    "docs": dict(batch_size=BATCH, max_len=SEQ_LEN),
    "pack": dict(batching="pack", seq_len=SEQ_LEN, batch_size=8),
}


def one_pass(source, mode: str, epoch: int) -> tuple[float, float, int, list[np.ndarray]]:
    """(seconds, CPU seconds, tokens, per-batch tokens by source) of one epoch, 0 workers."""
    import torch

    import wdsllm

    torch.set_num_threads(1)
    loader = wdsllm.loader(source, seed=0, rank=0, world_size=1, **MODES[mode])
    loader.set_epoch(epoch)
    kept = []  # each batch's small (lengths, sources) tensors; its tokens are let go, as a training loop does
    t, cpu = time.perf_counter(), time.process_time()
    for b in loader:
        kept.append((b["lengths"], b.get("sources")))
        del b
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = 0
    per_batch = []
    for lengths, src in kept:
        lengths = lengths.numpy()
        tokens += int(lengths.sum())
        if src is not None:
            src = src.numpy()
            if src.ndim == 1:
                per_batch.append(np.bincount(src, weights=lengths, minlength=3))
            else:  # rows: a row's tokens by its documents' sources needs the segments; count rows' first source
                per_batch.append(np.bincount(src[:, 0], weights=lengths, minlength=3))
    return seconds, cpu, tokens, per_batch


def deviation(per_batch: list[np.ndarray], weights: list[float], window: int = WINDOW) -> float:
    """Largest |share - weight| over windows of ``window`` consecutive batches and sources."""
    if len(per_batch) < window:
        return float("nan")
    arr = np.asarray(per_batch, np.float64)
    sums = np.cumsum(np.vstack([np.zeros(arr.shape[1]), arr]), axis=0)
    win = sums[window:] - sums[:-window]
    shares = win / win.sum(axis=1, keepdims=True)
    return float(np.abs(shares - np.asarray(weights)).max())


def measure(sources: dict[str, str], single: str, repeat: int) -> dict:
    import wdsllm

    total = sum(wdsllm.loader(s, batch_size=1).catalog.index.tokens for s in sources.values())
    mix = wdsllm.Mixture(sources, weights=WEIGHTS, epoch_tokens=total)
    out = {}
    for mode in MODES:
        best = {"mix": 0.0, "single": 0.0}
        best_cpu = {"mix": 0.0, "single": 0.0}  # tokens per CPU second: what a busy machine disturbs least
        dev = None
        for r in range(repeat):
            for kind, src in (("single", single), ("mix", mix)):
                seconds, cpu, tokens, per_batch = one_pass(src, mode, r)
                best[kind] = max(best[kind], tokens / seconds)
                best_cpu[kind] = max(best_cpu[kind], tokens / cpu)
                if kind == "mix" and mode == "docs" and dev is None:
                    dev = deviation(per_batch, list(WEIGHTS.values()))
        out[mode] = {
            "single_tokens_per_s": best["single"],
            "mix_tokens_per_s": best["mix"],
            "ratio": best["mix"] / best["single"],
            "cpu_ratio": best_cpu["mix"] / best_cpu["single"],
        }
        if dev is not None:
            out[mode]["deviation"] = dev
        print(
            f"{mode:5s} single {best['single'] / 1e6:8.1f}M tok/s   mix {best['mix'] / 1e6:8.1f}M tok/s   "
            f"ratio {best['mix'] / best['single']:.2f}x (per CPU second {out[mode]['cpu_ratio']:.2f}x)"
            + (f"   window deviation {dev:.4f}" if dev is not None else ""),
            flush=True,
        )
    return out


# ----------------------------------------------------------------------------------------------
# Peers, in a virtualenv of their own

PEER_PACKAGES = ["litdata", "mosaicml-streaming"]


def peer_venv(work: Path) -> Path:
    """A virtualenv under WORK with litdata and mosaic streaming; torch and numpy come from this
    interpreter's site-packages through a .pth file (not installed twice)."""
    venv = work / "peers-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = subprocess.run(
            [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        ours = [p for p in sys.path if p.endswith("site-packages")]
        Path(site, "project-site.pth").write_text("\n".join(ours) + "\n")
    have = subprocess.run([str(python), "-c", "import litdata, streaming"], capture_output=True)
    if have.returncode:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", *PEER_PACKAGES], check=True)
    return python


def peer_documents(sources: dict[str, str], limit: int) -> dict[str, list[np.ndarray]]:
    """Each source's first ``limit`` documents' tokens, read through our loader (plan order)."""
    import wdsllm

    out = {}
    for name, path in sources.items():
        docs = []
        for item in wdsllm.dataset(path, batch_size=None, shuffle=False, rank=0, world_size=1):
            docs.append(item["input_ids"].numpy().astype(np.int32))
            if len(docs) >= limit:
                break
        out[name] = docs
    return out


def peers(work: Path, sources: dict[str, str], limit: int, tag: str) -> dict:
    python = peer_venv(work)
    for name, docs in peer_documents(sources, limit).items():
        np.savez(work / f"peer-{tag}-{name}.npz", **{str(i): d for i, d in enumerate(docs)})
    env = {**os.environ, "BENCH_MIX_WORK": str(work.resolve()), "BENCH_MIX_TAG": tag}
    script = REPO / "tools" / "bench_mix_peers.py"
    proc = subprocess.run(
        [str(python), str(script), json.dumps(WEIGHTS)], capture_output=True, text=True, check=False, env=env
    )
    if proc.returncode:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(REPO / "bench-out"))
    ap.add_argument("--quick", action="store_true", help="one wiki file per source")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--peers", action="store_true", help="also measure litdata and mosaic streaming (a venv in WORK)")
    ap.add_argument("--peer-docs", type=int, default=20_000, help="documents per source written for the peers")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sources, single = datasets(work, args.quick)
    result = {"measure": measure(sources, single, args.repeat)}
    if args.peers:
        result["peers"] = peers(work, sources, args.peer_docs, "quick" if args.quick else "full")
        print("peers:", json.dumps(result["peers"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
