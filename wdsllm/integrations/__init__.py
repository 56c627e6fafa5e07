"""Thin adapters for the training stacks people use (docs/integrations.md).

Each module imports its library when imported itself, never from ``import wdsllm``:

- :mod:`wdsllm.integrations.hf`: a ``transformers.Trainer`` that takes a ``wdsllm.loader`` as it
  is (no second batching, no second sharding, resume from the loader's own state);
- :mod:`wdsllm.integrations.accelerate`: ``prepare(accelerator, loader)`` for Accelerate loops;
- :mod:`wdsllm.integrations.lightning`: a callback that keeps the loader's epoch in step;
- :mod:`wdsllm.integrations.torchtitan`: a data loader torchtitan's trainer builds from its config.

:func:`model_inputs` is shared by all of them: a batch as keyword arguments of a Hugging Face
model. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: keys of a wdsllm batch that describe it and are no model input (a model whose forward takes no
#: ``**kwargs`` raises TypeError on any of them)
META_KEYS = ("docs", "rows", "lengths", "epoch", "cu_seqlens", "max_seqlen", "sources")
#: the padding-free packing keys of Hugging Face models (FlashAttention's varlen path)
FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def model_inputs(batch: Mapping[str, Any], *, flash_keys: bool = True) -> dict[str, Any]:
    """``batch`` as ``model(**model_inputs(batch))`` for a Hugging Face causal LM.

    Bookkeeping keys are dropped. Packed rows (``position_ids``) also get ``use_cache=False``:
    with a cache, transformers skips the mask that keeps each document's attention to itself
    (``masking_utils`` detects packing only without a cache and without an attention mask).
    ``flash_keys=False`` leaves out ``cu_seq_lens_q/k`` and ``max_length_q/k`` for a model whose
    forward takes no such keyword arguments.
    """
    drop = META_KEYS if flash_keys else META_KEYS + FLASH_KEYS
    out = {k: v for k, v in batch.items() if k not in drop}
    if "position_ids" in out:
        out["use_cache"] = False
    return out


def world_mismatch(loader_rank: int, loader_world: int, rank: int, world: int, who: str, cpu_fix: str) -> str:
    """Why the loader's (rank, world size) are not the trainer's, and what to do about it.

    The loader reads them from torch.distributed. ``accelerate launch --multi_gpu`` on a machine
    without GPUs starts the process group but leaves an ``Accelerator()`` without ``cpu=True``
    undistributed (one process), so the two disagree although no rank was given."""
    import torch.distributed as dist

    said = f"the loader is rank {loader_rank} of {loader_world}, the {who} is rank {rank} of {world}"
    group = dist.is_available() and dist.is_initialized()
    if group and world < dist.get_world_size() == loader_world:
        return (
            f"{said}: torch.distributed runs {loader_world} processes but the {who} runs as {world} (what a launch "
            f"with --multi_gpu gives on a machine without GPUs); on CPUs, {cpu_fix}"
        )
    if not group and world > 1:
        return (
            f"{said}: torch.distributed is not initialized in this process; create the {who} (which starts the "
            "process group) before the loader iterates"
        )
    return f"{said}: build the loader without rank=/world_size= (it reads them from torch.distributed)"


def _need(module: str, extra: str) -> None:
    """Raise MissingDependencyError naming the pip command when ``module`` is not installed."""
    import importlib.util

    from ..errors import MissingDependencyError

    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(f"this integration needs {module}, which is not installed: pip install {extra}")


__all__ = ["FLASH_KEYS", "META_KEYS", "model_inputs", "world_mismatch"]
