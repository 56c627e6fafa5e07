"""Train a tiny language model on wdsllm batches under a 2-D DeviceMesh (gloo, CPU): dp2 x tp2
(tensor parallel, ``torch.distributed.tensor.parallel``) or dp2 x cp2 (context parallel).

    wdsllm pack ../shared/data/corpora/tinyshakespeare.txt -o demo-out/shakespeare-packed \\
        -t ../shared/data/tokenizers/gpt2.json --mode packed --seq-len 128
    torchrun --nproc-per-node 4 examples/train_parallel.py --data demo-out/shakespeare-packed --layout dp2tp2
    torchrun --nproc-per-node 4 examples/train_parallel.py --data demo-out/shakespeare-packed --layout dp2cp2

The loader takes the mesh and the name of its data-parallel dim: the two data-parallel ranks
read disjoint halves of each epoch, and the peers on the other dim get the same batch (tensor
parallel: the whole batch; context parallel: each its slice of every row, labels shifted before
the cut, ``shift_labels``, with the true ``position_ids``). The first batch of every epoch is
compared across the peers (a digest all-gathered), so peers built differently fail at once.

The model embeds each token and its position and predicts the next token through an MLP: no
attention, so a context-parallel rank can compute its slice's loss alone (a real model under CP
attends across slices: ring attention, e.g. ``torch.distributed.tensor.experimental
.context_parallel``). Gradients are averaged over the data-parallel dim (and summed over CP
slices); the loss is the mean over every labelled token of the data-parallel rank's batch. Each
rank prints one JSON line: its coordinates, its steps and its losses (``--out DIR``: also
DIR/rank{r}.json). Tensor-parallel peers print the same losses.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import wdsllm


class TinyLM(nn.Module):
    """Token and position embeddings, an MLP, a head: per-token, so any slice of a row stands alone."""

    def __init__(self, vocab: int, d_model: int, max_pos: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_pos, d_model)
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids) + self.positions(position_ids.clamp(max=self.positions.num_embeddings - 1))
        return self.head(x + self.down(torch.nn.functional.gelu(self.up(x))))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a packed-mode dataset (rows of a seq_len that 4 divides)")
    ap.add_argument("--layout", choices=["dp2tp2", "dp2cp2"], default="dp2tp2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4, help="rows per data-parallel rank per step")
    ap.add_argument("--replicas", choices=["read", "broadcast"], default="read")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # every rank starts from the same weights
    other = args.layout[3:5]  # "tp" or "cp"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", other))
    layout = {"mesh": mesh, "dp": "dp", "replicas": args.replicas}
    if other == "cp":
        layout["cp"] = "cp"
    loader = wdsllm.loader(args.data, batch_size=args.batch_size, boundaries=True, seed=1, epochs=None, **layout)
    vocab = loader.catalog.index.tokenizer.vocab_size if loader.catalog.index.tokenizer else 50304
    model = TinyLM(vocab, d_model=32, max_pos=4096)
    if other == "tp":
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train(model, optimizer, loader, mesh, other, args.steps)
    report = {"coords": dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())), "steps": len(losses), "losses": losses}
    print(json.dumps(report), flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(report, f)
    loader.close()
    dist.destroy_process_group()


def train(model: nn.Module, optimizer, loader, mesh, other: str, steps: int) -> list[float]:
    """``steps`` optimizer steps; the loss of each (the mean over the data-parallel rank's tokens)."""
    dp_group = mesh.get_group("dp")
    cp_group = mesh.get_group("cp") if other == "cp" else None
    losses = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        labels = batch["shift_labels"] if "shift_labels" in batch else _shifted(batch["labels"])
        logits = model(batch["input_ids"], batch["position_ids"])
        total = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        counted = torch.tensor([float((labels != -100).sum())])
        if cp_group is not None:  # the mean over the whole row: every CP slice's tokens
            dist.all_reduce(counted, group=cp_group)
        loss = total / counted.clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        _sync_gradients(model, dp_group, cp_group)
        optimizer.step()
        shown = loss.detach().clone()
        if cp_group is not None:
            dist.all_reduce(shown, group=cp_group)
        losses.append(round(float(shown), 6))
    return losses


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(labels, -100)
    out[:, :-1] = labels[:, 1:]
    return out


def _sync_gradients(model: nn.Module, dp_group, cp_group) -> None:
    """Sum the CP slices' gradients (parts of one loss), then average over data-parallel ranks."""
    dp_size = dist.get_world_size(dp_group)
    for p in model.parameters():
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if cp_group is not None:
            dist.all_reduce(grad, group=cp_group)
        dist.all_reduce(grad, group=dp_group)
        grad /= dp_size


if __name__ == "__main__":
    main()
