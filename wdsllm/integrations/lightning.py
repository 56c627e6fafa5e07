"""Lightning with a ``wdsllm.loader`` returned from ``train_dataloader()``.

Lightning passes a loader that is not a DataLoader through unchanged (no sampler is injected) and
saves and restores its ``state_dict`` with its checkpoints, so mid-epoch resumption works as it
is. What it does not do is tell the loader the epoch: it calls ``set_epoch`` only on samplers, and
it stops an epoch after ``len(loader)`` (or ``limit_train_batches``) batches without exhausting
the iterator. The loader closes an epoch whose last batch was handed out by itself, but an epoch
cut short by ``limit_train_batches`` would repeat. :class:`LoaderEpochs` sets the loader's epoch
to the trainer's at the start of every epoch, as Lightning does for a DistributedSampler.

Usage::

    trainer = L.Trainer(..., use_distributed_sampler=False, callbacks=[LoaderEpochs()])

with ``train_dataloader()`` returning ``wdsllm.loader(...)`` (built there, once the process group
is up).
"""

from __future__ import annotations

from typing import Any

from . import _need

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    _need("pytorch_lightning", "lightning")
    import pytorch_lightning as pl

from ..errors import UsageError
from ..load.loader import Loader
from ..observe.export import DEFAULT_KEYS, MetricsLog, selected


def _loaders(obj: Any) -> list[Loader]:
    """The wdsllm loaders in what ``train_dataloader()`` returned (one, or a collection)."""
    if isinstance(obj, Loader):
        return [obj]
    if isinstance(obj, dict):
        return [ld for v in obj.values() for ld in _loaders(v)]
    if isinstance(obj, (list, tuple)):
        return [ld for v in obj for ld in _loaders(v)]
    return []


class LoaderEpochs(pl.Callback):
    """Keeps every wdsllm loader of the fit in step with the trainer's epoch, and checks that it
    reads the share of the trainer's rank."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        for loader in _loaders(trainer.train_dataloader):
            if (loader.rank, loader.world_size) != (trainer.global_rank, trainer.world_size):
                raise UsageError(
                    f"the loader is rank {loader.rank} of {loader.world_size}, the trainer's process is rank "
                    f"{trainer.global_rank} of {trainer.world_size}: build the loader in train_dataloader() without "
                    "rank=/world_size="
                )
            loader.set_epoch(trainer.current_epoch)


__all__ = ["LoaderEpochs"]


class LoaderMetrics(pl.Callback):
    """Logs the loader's metrics (``data/data_wait_share``, ...: ``observe.export.DEFAULT_KEYS``, or
    ``keys``; None: all) every ``every`` training steps through the module's ``log_dict`` (to
    whatever logger the Trainer has), and writes every key to ``jsonl`` if given (rank 0)."""

    def __init__(self, every: int = 50, keys: tuple[str, ...] | None = DEFAULT_KEYS, jsonl: str | None = None):
        self.every, self.keys = every, keys
        self.jsonl = MetricsLog(jsonl) if jsonl is not None else None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        for loader in _loaders(trainer.train_dataloader)[:1]:
            metrics = loader.metrics()
            pl_module.log_dict(selected(metrics, self.keys), on_step=True, on_epoch=False)
            if self.jsonl is not None and trainer.is_global_zero:
                self.jsonl.write(step, metrics)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
