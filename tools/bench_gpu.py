#!/usr/bin/env python
"""Does the GPU wait for data? A training loop fed by ``wdsllm.loader`` against the same loop on
batches that are already on the GPU (issue #44).

    python tools/bench_gpu.py                        # both models on the GPU (bench-out/wiki-docs, packed once)
    python tools/bench_gpu.py --data DIR --steps 300 # a docs-mode dataset of your own
    python tools/bench_gpu.py --dry-run --data DIR   # on CPU: tiny sizes, a few steps (the test suite runs it)

The model is ``examples/tiny_gpt.py``'s GPT at two sizes: about 124M parameters (GPT-2 small:
width 768, 12 layers) with batches of 16 x 1,024 tokens, and about 10M (width 160, 6 layers)
with batches of 64 x 1,024, where a step is short and the loader is under the most pressure. Each
step runs under bf16 autocast with fused AdamW.

For each model, two runs of ``--warmup`` + ``--steps`` steps:

- synthetic: batches made on the GPU before the clock starts (the rate the GPU can do);
- fed: ``wdsllm.loader`` over a docs-mode dataset, ``batching="pack"`` into rows of 1,024,
  ``pin_memory=True``, ``--workers`` DataLoader workers (4), each batch copied to the GPU with
  ``non_blocking=True``.

Reported per model: tokens/s of both and their ratio (the goal: at least 0.98 for 124M and 0.95
for 10M), the trainer's own wait share (seconds in ``next(loader)`` over the loop's seconds), the
loader's ``data_wait_share`` (its metrics), and whether batches arrived pinned. One torch thread
in this process (``--torch-threads``): the workers and the GPU do the work.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "tools"))

SEQ_LEN = 1024
VOCAB = 50257  # GPT-2, the tokenizer of the packed corpus
#: name -> (width, layers, heads, rows per batch, goal: fed over synthetic tokens/s)
SIZES = {
    "124M": (768, 12, 12, 16, 0.98),
    "10M": (160, 6, 5, 64, 0.95),
}
#: the dry run's models: tiny, for a few steps on CPU
DRY_SIZES = {
    "124M": (16, 1, 2, 2, 0.98),
    "10M": (8, 1, 2, 4, 0.95),
}
DRY_SEQ_LEN = 32


@dataclass
class Run:
    """One model's two runs."""

    model: str
    params: int
    batch: str
    device: str
    synthetic_tokens_per_s: float
    fed_tokens_per_s: float
    ratio: float
    goal: float
    trainer_wait_share: float  # seconds in next(loader) over the loop's seconds
    loader_data_wait_share: float | None  # the loader's own measure (its metrics)
    pinned: bool  # every batch arrived in pinned memory
    steps: int


def make_model(size: tuple, seq_len: int, device, fused: bool):
    import torch
    from tiny_gpt import GPTConfig, TinyGPT

    width, layers, heads, _rows, _goal = size
    model = TinyGPT(GPTConfig(vocab_size=VOCAB, max_len=seq_len, d_model=width, n_layers=layers, n_heads=heads))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused)
    return model, opt


def train(model, opt, batches, device, *, steps: int, warmup: int, autocast: bool) -> tuple[float, float, bool]:
    """(seconds of the measured steps, of them in next(batches), every batch pinned)."""
    import torch
    from tiny_gpt import lm_loss

    pinned = True
    waited = 0.0
    start = time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start, waited = time.perf_counter(), 0.0
        asked = time.perf_counter()
        batch = next(batches)
        waited += time.perf_counter() - asked
        ids, labels = batch["input_ids"], batch["labels"]
        if ids.device.type == "cpu":  # from the loader (synthetic batches are made on the device)
            pinned = pinned and ids.is_pinned() and labels.is_pinned()
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(ids), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - start, waited, pinned


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_batches(rows: int, seq_len: int, device):
    """A few batches made on the device before the clock starts, taken in turn."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    made = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (rows, seq_len), device=device, generator=g)
        made.append({"input_ids": ids, "labels": ids.clone()})
    return itertools.cycle(made)


def measure(name: str, size: tuple, args, device, seq_len: int) -> Run:
    import torch

    import wdsllm

    cuda = device.type == "cuda"
    rows, goal = size[3], size[4]
    tokens = args.steps * rows * seq_len
    torch.manual_seed(0)
    model, opt = make_model(size, seq_len, device, fused=cuda)
    params = sum(p.numel() for p in model.parameters())
    seconds, _, _ = train(
        model,
        opt,
        synthetic_batches(rows, seq_len, device),
        device,
        steps=args.steps,
        warmup=args.warmup,
        autocast=cuda,
    )
    synthetic = tokens / seconds

    torch.manual_seed(0)
    model, opt = make_model(size, seq_len, device, fused=cuda)
    loader = wdsllm.loader(
        str(args.data),
        batching="pack",
        seq_len=seq_len,
        batch_size=rows,
        epochs=None,  # endless: a run longer than the corpus goes on into the next epoch
        pin_memory=True,
        num_workers=args.workers,
        seed=0,
    )
    with loader:
        fed_s, waited, pinned = train(
            model, opt, iter(loader), device, steps=args.steps, warmup=args.warmup, autocast=cuda
        )
        share = loader.metrics().get("data_wait_share")
    fed = tokens / fed_s
    return Run(
        model=name,
        params=params,
        batch=f"{rows} x {seq_len}",
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        synthetic_tokens_per_s=synthetic,
        fed_tokens_per_s=fed,
        ratio=fed / synthetic,
        goal=goal,
        trainer_wait_share=waited / fed_s,
        loader_data_wait_share=share,
        pinned=pinned and cuda,
        steps=args.steps,
    )


def table(runs: list[Run]) -> str:
    lines = [
        "| model | batch | synthetic tokens/s | fed tokens/s | fed / synthetic (goal) | trainer's wait share "
        "| loader's data_wait_share | pinned |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        share = "–" if r.loader_data_wait_share is None else f"{r.loader_data_wait_share:.1%}"
        lines.append(
            f"| {r.model} ({r.params / 1e6:.1f}M) | {r.batch} | {r.synthetic_tokens_per_s:,.0f} | "
            f"{r.fed_tokens_per_s:,.0f} | {r.ratio:.3f} (≥ {r.goal}) | {r.trainer_wait_share:.1%} | {share} "
            f"| {'yes' if r.pinned else 'no'} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=None, help="a docs-mode dataset (default: the wiki corpus, packed)")
    ap.add_argument("--work", type=Path, default=REPO / "bench-out", help="where the wiki corpus is packed")
    ap.add_argument("--models", default=",".join(SIZES), help=f"among {','.join(SIZES)}")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per run [200; dry run 2]")
    ap.add_argument("--warmup", type=int, default=None, help="steps before the clock starts [20; dry run 1]")
    ap.add_argument("--workers", type=int, default=None, help="DataLoader workers [4; dry run 1]")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads of this process [1]")
    ap.add_argument("--dry-run", action="store_true", help="on CPU: tiny models, a few steps")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    dry = args.dry_run
    args.steps = args.steps if args.steps is not None else (2 if dry else 200)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 20)
    args.workers = args.workers if args.workers is not None else (1 if dry else 4)
    return args


def main(argv=None) -> list[Run]:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    if args.dry_run:
        device, sizes, seq_len = torch.device("cpu"), DRY_SIZES, DRY_SEQ_LEN
    elif torch.cuda.is_available():
        device, sizes, seq_len = torch.device("cuda"), SIZES, SEQ_LEN
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        raise SystemExit("no CUDA device: this measures a GPU's training loop (--dry-run runs it on CPU, tiny)")
    if args.data is None:  # the wiki corpus in docs mode, as bench_load.py packs it (one file for a dry run)
        import bench_load

        args.data = Path(bench_load.pack_corpus(str(args.work), args.dry_run, "docs"))
    runs = []
    for name in [m for m in args.models.split(",") if m]:
        if name not in sizes:
            raise SystemExit(f"unknown model {name!r}; choose among {list(sizes)}")
        runs.append(measure(name, sizes[name], args, device, seq_len))
        print(f"  {name}: {runs[-1].fed_tokens_per_s:,.0f} tokens/s fed, ratio {runs[-1].ratio:.3f}", flush=True)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{runs[0].device if runs else device}, torch {torch.__version__}, {os.cpu_count()} cores (load {load}); "
        f"{args.steps} steps after {args.warmup}, {args.workers} workers, data {args.data}\n"
    )
    print(table(runs))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    return runs


if __name__ == "__main__":
    main()
