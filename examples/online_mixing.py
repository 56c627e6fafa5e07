"""Online data mixing: a small DoReMi/ODM-style controller that re-weights a mixture while it trains.

    python examples/online_mixing.py --out demo-out/online --steps 40 --every 10
    python examples/online_mixing.py --out demo-out/online --steps 40 --every 10 --stop-at 20   # then:
    python examples/online_mixing.py --out demo-out/online --steps 40 --every 10 --resume

Two small real corpora (Tiny Shakespeare and WikiText-2, packed once into ``--data`` (default ``--out/data``) with the
GPT-2 tokenizer) are mixed 50/50 by tokens and read as packed rows with document boundaries. Each
step the tiny GPT's per-token losses are charged to their sources (``wdsllm.source_losses``);
every ``--every`` steps the controller moves the weights towards the sources whose loss is
highest (an exponentiated-gradient step, smoothed towards uniform) and calls
``loader.set_weights``, which takes effect at the next planned step on every rank. A checkpoint
holds the model, the optimizer, the controller and ``loader.state_dict()`` (which records every
change), so a resumed run trains on exactly the batches, and sets exactly the weights, of the
uninterrupted one. Each step prints a JSON line: the step, the weights in force, the per-source
losses and a digest of the batch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_gpt import GPTConfig, TinyGPT

import wdsllm

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
CORPORA = {
    "shakespeare": DATA / "corpora" / "tinyshakespeare.txt",
    "wikitext": DATA / "corpora" / "wikitext-2-valid.txt",
}
TOKENIZER = DATA / "tokenizers" / "gpt2.json"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the checkpoint")
    ap.add_argument("--data", default=None, help="directory for the packed corpora (default: OUT/data)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10, help="steps between weight updates")
    ap.add_argument("--eta", type=float, default=1.0, help="the controller's step size")
    ap.add_argument("--smoothing", type=float, default=0.2, help="mixed in of the uniform weights")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--stop-at", type=int, default=None, help="save a checkpoint after this step and stop")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    return ap.parse_args(argv)


def packed_corpora(data: Path) -> dict[str, str]:
    """Each corpus packed once (docs mode, a paragraph a document)."""
    from wdsllm.pack.job import PackConfig, pack

    roots = {}
    for name, text in CORPORA.items():
        root = data / name
        if not (root / "index.json").exists():
            pack(PackConfig(inputs=[str(text)], output=str(root), tokenizer=str(TOKENIZER), split="paragraph"))
        roots[name] = str(root)
    return roots


class Controller:
    """Exponentiated-gradient weights from the sources' mean losses over the last window."""

    def __init__(self, names: list[str], eta: float, smoothing: float):
        self.names, self.eta, self.smoothing = names, eta, smoothing
        self.weights = [1.0 / len(names)] * len(names)
        self.sums = torch.zeros(len(names), dtype=torch.float64)
        self.counts = torch.zeros(len(names), dtype=torch.float64)

    def add(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        self.sums += sums.cpu()
        self.counts += counts.cpu()

    def update(self) -> dict[str, float]:
        """New weights from the window's losses (a source unseen in it keeps its log-weight)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.sums)  # every rank steers by the same figures
            torch.distributed.all_reduce(self.counts)
        means = wdsllm.mean_losses(self.sums, self.counts)
        seen = ~torch.isnan(means)
        centred = torch.where(seen, means - means[seen].mean(), torch.zeros_like(means))
        logits = torch.log(torch.tensor(self.weights, dtype=torch.float64)) + self.eta * centred
        raw = torch.softmax(logits, 0)
        mixed = (1 - self.smoothing) * raw + self.smoothing / len(self.names)
        self.weights = [round(float(w), 6) for w in mixed / mixed.sum()]
        self.sums.zero_()
        self.counts.zero_()
        return dict(zip(self.names, self.weights))

    def state_dict(self) -> dict:
        return {"weights": self.weights, "sums": self.sums, "counts": self.counts}

    def load_state_dict(self, state: dict) -> None:
        self.weights, self.sums, self.counts = list(state["weights"]), state["sums"], state["counts"]


def token_losses(model: TinyGPT, batch: dict) -> torch.Tensor:
    """[B, T - 1] next-token losses (the model's own shift), 0 where a label is ignored."""
    logits = model(batch["input_ids"], position_ids=batch.get("position_ids"))
    labels = batch["labels"]
    flat = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="none",
    )
    return flat.view(labels.shape[0], -1)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    roots = packed_corpora(Path(args.data) if args.data else out / "data")
    names = sorted(roots)
    mix = wdsllm.Mixture(roots, weights={n: 1.0 for n in names}, unit="tokens")
    options = dict(batching="pack", seq_len=args.seq_len, batch_size=args.batch_size, boundaries=True)
    loader = wdsllm.loader(mix, seed=0, num_workers=args.workers, **options)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50304, max_len=args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    controller = Controller(names, args.eta, args.smoothing)
    step, epoch = 0, 0
    checkpoint = out / "checkpoint.pt"
    if args.resume:
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        controller.load_state_dict(saved["controller"])
        loader.load_state_dict(saved["loader"])
        step, epoch = saved["step"], loader.epoch
    while step < args.steps:
        loader.set_epoch(epoch)
        for batch in loader:
            loss_per_token = token_losses(model, batch)
            counted = (batch["labels"][:, 1:] != -100).sum().clamp(min=1)
            loss = loss_per_token.sum() / counted
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            controller.add(*wdsllm.source_losses(loss_per_token.detach(), batch, len(names)))
            step += 1
            digest = hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]
            line = {"step": step, "weights": controller.weights, "loss": round(loss.item(), 4), "batch": digest}
            print(json.dumps(line), flush=True)
            if step % args.every == 0:
                loader.set_weights(controller.update())
            if step == args.stop_at or step == args.steps:
                break
        if step == args.stop_at or step == args.steps:
            break
        epoch += 1
    if args.stop_at is not None and step == args.stop_at:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save({**state, "controller": controller.state_dict(), "loader": loader.state_dict()}, checkpoint)
    loader.close()
    if not math.isfinite(loss.item()):
        raise SystemExit("the loss is not finite")


if __name__ == "__main__":
    main()
