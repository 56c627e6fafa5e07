"""Train a tiny GPT on packed wdsllm shards with DistributedDataParallel (gloo, CPU).

    wdsllm pack ../shared/data/corpora/tinyshakespeare.txt -o demo-out/shakespeare-packed \\
        -t ../shared/data/tokenizers/gpt2.json --mode packed --seq-len 128
    torchrun --nproc_per_node 2 examples/train_ddp.py --data demo-out/shakespeare-packed --steps 20 --workers 1

Every rank reads its own part of each epoch through ``wdsllm.loader`` (rank and world size come
from the initialised process group), and every rank yields the same number of batches per epoch
(equal batches are the default when the world size is above 1), so no rank waits forever in an
all-reduce. At the end each rank prints one JSON line with the steps it took and the row ids it
trained on; ``--out DIR`` also writes it to DIR/rank{r}.json.

Checkpoints (``--save-every K``, ``--resume PATH``) hold the model, the optimizer, the step and
every rank's ``loader.state_dict()``, so a resumed run trains on exactly the batches the
uninterrupted run would have (another world size or worker count is re-planned by the loader:
the rest of the epoch, every row once, in another order).

Runs without torchrun too (one process, no DDP): ``python examples/train_ddp.py --data DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_gpt import GPTConfig, TinyGPT, lm_loss

import wdsllm

CHECKPOINT_VERSION = 1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data",
        required=True,
        help="packed-mode dataset (directory or URL holding index.json), or a mixture file of them (.yaml)",
    )
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps in all (over as many epochs as needed)")
    ap.add_argument("--batch-size", type=int, default=8, help="rows per rank per step")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", default=None, help="directory for rank{r}.json and checkpoint.pt")
    ap.add_argument(
        "--boundaries", action="store_true", help="position ids restart per document; attention stays within documents"
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save a checkpoint every K steps (and at the end); needs --out or --checkpoint",
    )
    ap.add_argument("--checkpoint", default=None, help="checkpoint path [default: OUT/checkpoint.pt]")
    ap.add_argument("--resume", default=None, metavar="PATH", help="continue from this checkpoint")
    args = ap.parse_args(argv)
    if args.checkpoint is None and args.out is not None:
        args.checkpoint = os.path.join(args.out, "checkpoint.pt")
    if args.save_every and args.checkpoint is None:
        ap.error("--save-every needs --out or --checkpoint")
    return args


# ------------------------------------------------------------------------------------------------
# Distributed set-up


def setup_distributed() -> tuple[int, int]:
    """Join the torchrun group (gloo) when launched by torchrun; else one process."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ------------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(path: str, model: torch.nn.Module, optimizer, loader, step: int, rank: int, world: int) -> None:
    """Every rank calls this at the same step (the loader states are gathered); rank 0 writes."""
    loader_states = all_gather(loader.state_dict())
    if rank == 0:
        state = {
            "version": CHECKPOINT_VERSION,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "loader": loader_states,  # one per rank, in rank order
        }
        tmp = f"{path}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, path)  # a crash while saving leaves the previous checkpoint whole
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path: str, model: torch.nn.Module, optimizer, loader, rank: int, world: int) -> int:
    """Restore model, optimizer and the data stream; returns the step."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {state.get('version')}, this script reads {CHECKPOINT_VERSION}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # Each rank loads its own state; with another world size any rank's state will do (with equal
    # batches every rank stood at the same batch) and the loader re-plans the rest of the epoch.
    states = state["loader"]
    loader.load_state_dict(states[rank] if len(states) == world else states[0])
    return int(state["step"])


# ------------------------------------------------------------------------------------------------
# Training


def build_loader(args: argparse.Namespace):
    loader = wdsllm.loader(
        args.data,
        batch_size=args.batch_size,
        seed=args.seed,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        boundaries=args.boundaries,
    )
    index = loader.catalog.index
    if index is None or index.mode != "packed" or not index.seq_len:
        raise SystemExit(
            f"{args.data}: needs a packed-mode dataset with an index.json (wdsllm pack --mode packed --seq-len N)"
        )
    return loader


def build_model(args: argparse.Namespace, index) -> TinyGPT:
    tok = index.tokenizer
    specials = [i for i in (tok.bos_id, tok.eos_id, tok.pad_id) if i is not None]
    vocab = max([tok.vocab_size, *(i + 1 for i in specials)])
    cfg = GPTConfig(
        vocab_size=vocab, max_len=index.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
    )
    return TinyGPT(cfg)


def train(args: argparse.Namespace) -> dict:
    rank, world = setup_distributed()
    torch.manual_seed(args.seed)
    loader = build_loader(args)
    model = build_model(args, loader.catalog.index)
    ddp = DDP(model) if dist.is_initialized() else model  # DDP broadcasts rank 0's weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    step = 0
    if args.resume:
        step = load_checkpoint(args.resume, model, optimizer, loader, rank, world)
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}, epoch {loader.epoch}", flush=True)

    rows: list[int] = []
    losses: list[float] = []
    batches = 0
    window = {"loss": 0.0, "n": 0, "tokens": 0.0, "t": time.perf_counter()}
    epoch = loader.epoch  # 0, or where a restored loader stands

    while step < args.steps:
        loader.set_epoch(epoch)  # a restored loader continues its epoch from the saved batch
        yielded = 0
        for batch in loader:
            yielded += 1  # noqa: SIM113 - the count is read after the loop
            ddp.train()
            position_ids = batch["position_ids"] if args.boundaries else None
            logits = ddp(batch["input_ids"], position_ids)
            loss = lm_loss(logits, batch["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            step += 1
            batches += 1
            loss_value = float(loss.detach())
            losses.append(loss_value)
            rows.extend(batch["rows"].tolist())
            window["loss"] += loss_value
            window["n"] += 1
            window["tokens"] += float(batch["lengths"].sum())

            if step % args.log_every == 0 or step == args.steps:
                loss_sum, n, tokens = all_reduce_sum([window["loss"], window["n"], window["tokens"]])
                now = time.perf_counter()
                if rank == 0:
                    print(
                        f"step {step:6d}  epoch {epoch}  loss {loss_sum / n:.4f}  "
                        f"tokens/s {tokens / (now - window['t']):,.0f}",
                        flush=True,
                    )
                    if loader.catalog.mixing is not None:  # the realized mix of this epoch, next to the plan
                        mix = loader.mix_stats()
                        shares = "  ".join(
                            f"{n} {m['share']:.3f}/{m['target_share']:.3f}/{m['epoch_target_share']:.3f}"
                            for n, m in mix.items()
                        )
                        print(f"             mix (share/phase target/epoch target)  {shares}", flush=True)
                window = {"loss": 0.0, "n": 0, "tokens": 0.0, "t": now}
            if args.save_every and (step % args.save_every == 0 or step == args.steps):
                save_checkpoint(args.checkpoint, model, optimizer, loader, step, rank, world)
            if step >= args.steps:
                break
        else:
            if yielded == 0 and len(loader) == 0:
                raise SystemExit(
                    f"rank {rank}: epoch {epoch} yields no batches; the dataset is smaller than one batch per rank"
                )
            epoch += 1

    report = {
        "rank": rank,
        "world_size": world,
        "steps": step,
        "batches": batches,
        "epochs": epoch + 1,
        "losses": losses,
        "final_loss": losses[-1] if losses else None,
        "finite": all(math.isfinite(x) for x in losses),
        "rows": rows,
    }
    line = json.dumps(report)
    if dist.is_initialized():
        dist.barrier()  # rank 0's last log line first, then the reports
    print(line, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, f"rank{rank}.json").write_text(line + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return report


def main(argv=None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
