"""The Hugging Face Trainer with a ``wdsllm.loader``: correct by construction.

``transformers.Trainer(train_dataset=wdsllm.dataset(...))`` goes wrong three ways: it
wraps the dataset in a DataLoader with ``per_device_train_batch_size`` (our batches batched again),
``accelerator.prepare`` splits the rank's share across the ranks again, and a resume skips batches
by replaying them through ``loader.dataset``. :class:`Trainer` takes the loader instead and hands
it to the training loop unchanged: the loader already batches and already splits the epoch
across ranks. Each checkpoint gets every rank's ``loader.state_dict()``
(``checkpoint-N/wdsllm_loader_rank{R}.json``), and ``train(resume_from_checkpoint=...)`` loads it
and tells the Trainer not to skip batches, so the resumed run trains on exactly the batches the
uninterrupted one would have, with the Trainer's own step and epoch bookkeeping unchanged
(gradient accumulation included).

Usage::

    from wdsllm.integrations.hf import Trainer

    loader = wdsllm.loader("data/wiki-2048", batch_size=8, boundaries=True, num_workers=2)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir="run", ...), train_loader=loader)
    trainer.train(resume_from_checkpoint=last)  # None on a first run, else a checkpoint path

(``resume_from_checkpoint=True`` raises "No valid checkpoint found" when ``output_dir`` has none.)
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any

from . import _need

_need("transformers", "transformers")

import transformers  # noqa: E402
import transformers.trainer as hf_trainer  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from ..errors import StateError, UsageError  # noqa: E402
from ..load.dataset import WdsPipeline  # noqa: E402
from ..load.loader import Loader  # noqa: E402
from ..observe.export import DEFAULT_KEYS, MetricsLog, selected  # noqa: E402
from . import model_inputs, world_mismatch  # noqa: E402

#: the loader's state in a checkpoint directory, one file per rank
STATE_FILE = "wdsllm_loader_rank{rank}.json"


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains on ``train_loader=wdsllm.loader(...)`` as it is.

    Every other argument is the Trainer's. ``per_device_train_batch_size`` is not used for
    training batches (the loader's ``batch_size`` is), and ``train_dataset`` must not be given.
    """

    def __init__(self, *args: Any, train_loader: Loader | None = None, **kwargs: Any) -> None:
        dataset = kwargs.get("train_dataset")
        if isinstance(dataset, (WdsPipeline, Loader)):
            raise UsageError(
                "train_dataset= would be batched again by the Trainer's DataLoader and split across ranks again by "
                "accelerate: pass train_loader=wdsllm.loader(...) instead"
            )
        if not isinstance(train_loader, Loader):
            raise UsageError("wdsllm.integrations.hf.Trainer needs train_loader=wdsllm.loader(...)")
        super().__init__(*args, **kwargs)
        self.train_loader = train_loader

    # -- data ----------------------------------------------------------------------------------
    def get_train_dataloader(self) -> Loader:
        """The loader itself: no DataLoader around it, no ``accelerator.prepare``."""
        loader = self.train_loader
        loader._settle_world()
        if (loader.rank, loader.world_size) != (self.args.process_index, self.args.world_size):
            raise UsageError(
                world_mismatch(
                    loader.rank,
                    loader.world_size,
                    self.args.process_index,
                    self.args.world_size,
                    "Trainer",
                    "pass TrainingArguments(use_cpu=True)",
                )
            )
        return loader

    def compute_loss(self, model: Any, inputs: dict, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loss on the batch's model inputs (bookkeeping keys dropped; packed rows
        with the keys HF models read and ``use_cache=False``)."""
        return super().compute_loss(model, model_inputs(inputs), *args, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        super()._save_checkpoint(model, trial, *args, **kwargs)
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE.format(rank=self.args.process_index))
        with open(path + ".tmp", "w") as f:
            json.dump(self.train_loader.state_dict(kept_per_rank=True), f)  # a file per rank
        os.replace(path + ".tmp", path)

    def _load_loader_state(self, checkpoint: str) -> None:
        mine = os.path.join(checkpoint, STATE_FILE.format(rank=self.args.process_index))
        path = mine if os.path.exists(mine) else os.path.join(checkpoint, STATE_FILE.format(rank=0))
        if not os.path.exists(path):
            raise StateError(
                f"{checkpoint} holds no {STATE_FILE.format(rank='R')}: it was not saved by "
                "wdsllm.integrations.hf.Trainer, so where the data stood is unknown"
            )
        with open(path) as f:
            self.train_loader.load_state_dict(json.load(f))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """``transformers.Trainer.train``; a resume also restores the loader's position."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            self.train_loader._settle_world()
            self._load_loader_state(resume_from_checkpoint)
        with _no_skipping(self.train_loader):
            return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)


@contextmanager
def _no_skipping(loader: Loader):
    """While training, the Trainer's ``skip_first_batches`` leaves our loader alone: it already
    stands where the checkpoint was taken. (``ignore_data_skip=True`` would also stop the skip,
    but restarts the Trainer's step count within the epoch, which shifts gradient accumulation.)"""
    original = hf_trainer.skip_first_batches
    hf_trainer.skip_first_batches = lambda dl, num_batches=0: dl if dl is loader else original(dl, num_batches)
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original


class LoaderMetrics(transformers.TrainerCallback):
    """Adds the loader's metrics (``data/data_wait_share``, ...: ``observe.export.DEFAULT_KEYS``, or
    ``keys``; None: all) to every log of the Trainer, and writes every key to ``jsonl`` if given.

    The Trainer calls its reporters (TensorBoard, W&B) before the callbacks passed to it, so put
    this one first for them to see the figures:
    ``trainer.callback_handler.callbacks.insert(0, LoaderMetrics(loader))``."""

    def __init__(self, loader: Loader, keys: tuple[str, ...] | None = DEFAULT_KEYS, jsonl: str | None = None):
        self.loader, self.keys = loader, keys
        self.jsonl = MetricsLog(jsonl) if jsonl is not None else None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        metrics = self.loader.metrics()
        if logs is not None:
            logs.update(selected(metrics, self.keys))
        if self.jsonl is not None and state.is_world_process_zero:
            self.jsonl.write(state.global_step, metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.jsonl is not None:
            self.jsonl.close()


__all__ = ["STATE_FILE", "LoaderMetrics", "Trainer", "model_inputs"]
