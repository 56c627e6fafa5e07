"""Accelerate loops with a ``wdsllm.loader``.

``accelerator.prepare(loader)`` returns our loader unchanged (it prepares only DataLoaders), and
``accelerator.prepare(DataLoader(wdsllm.dataset(...)))`` splits the rank's share across the ranks
again, which wdsllm refuses. :func:`prepare` is the one way: it checks that the loader's rank and
world size are the accelerator's, registers the loader for ``save_state``/``load_state``, and
returns an :class:`AcceleratedLoader` that puts batches on ``accelerator.device`` and tells
Accelerate's ``GradientState`` where each epoch ends (so ``accelerator.accumulate`` syncs on an
epoch's last batch, as it does for prepared DataLoaders).

Usage::

    accelerator = Accelerator()
    loader = prepare(accelerator, wdsllm.loader("data/wiki", batch_size=16, num_workers=2))
    model, optimizer = accelerator.prepare(model, optimizer)
    if resume:
        accelerator.load_state(checkpoint_dir)  # the loader's position too
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from . import _need, world_mismatch

_need("accelerate", "accelerate")

import torch  # noqa: E402
from accelerate.data_loader import DataLoaderStateMixin  # noqa: E402
from accelerate.state import GradientState  # noqa: E402

from ..errors import UsageError  # noqa: E402
from ..load.loader import Loader  # noqa: E402


class AcceleratedLoader(DataLoaderStateMixin):
    """A ``wdsllm.Loader`` as Accelerate's loops expect a prepared loader: batches on the device,
    the end of each epoch known to ``GradientState``. Everything else is the loader's
    (``set_epoch``, ``epoch``, ``len``, ``state_dict``, ``load_state_dict``)."""

    def __init__(self, loader: Loader, device: torch.device | None, non_blocking: bool = False) -> None:
        self.loader = loader
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = GradientState()
        self._drop_last = True  # there is no remainder to report: every batch is a full step

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict]:
        self.begin()
        try:
            for batch in self.loader:
                self.end_of_dataloader = self.loader.at_end_of_pass()
                yield self._placed(batch)
        finally:
            self.end()

    def _placed(self, batch: dict) -> dict:
        if self.device is None:
            return batch
        return {
            k: v.to(self.device, non_blocking=self.non_blocking) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, str]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def prepare(accelerator: Any, loader: Loader, *, device_placement: bool = True) -> AcceleratedLoader:
    """The loader for an Accelerate loop (see the module's docstring); call it after
    ``Accelerator()`` exists, and not ``accelerator.prepare`` on the loader."""
    if not isinstance(loader, Loader):
        raise UsageError(
            "wdsllm.integrations.accelerate.prepare takes a wdsllm.loader(...); a wdsllm.dataset(...) already yields "
            "each rank its own batches and must not be prepared"
        )
    loader._settle_world()
    if (loader.rank, loader.world_size) != (accelerator.process_index, accelerator.num_processes):
        raise UsageError(
            world_mismatch(
                loader.rank,
                loader.world_size,
                accelerator.process_index,
                accelerator.num_processes,
                "accelerator",
                "create Accelerator(cpu=True)",
            )
        )
    accelerator.register_for_checkpointing(loader)
    device = accelerator.device if device_placement else None
    return AcceleratedLoader(loader, device, bool(getattr(accelerator, "non_blocking", False)))


__all__ = ["AcceleratedLoader", "prepare"]
