"""Who is iterating a pipeline: refuse the wrappers that would batch or shard its batches again.

``wdsllm.dataset(...)`` yields whole batches of this rank's share. Two everyday wirings silently
train on the wrong data: a DataLoader with a ``batch_size`` (the Hugging Face
Trainer builds one from ``per_device_train_batch_size``) stacks several of our batches into one,
and accelerate's ``prepare`` splits the rank's share across the ranks again (``IterableDatasetShard``)
or reads rank 0's share for everybody (``DataLoaderDispatcher``). Both call ``iter(pipeline)`` a
few frames up from a frame whose ``self`` says so: torch's ``_IterableDatasetFetcher`` has
``auto_collation`` exactly when its DataLoader has a batch size. That holds in the main process
and in DataLoader workers alike, and is looked at once per pass.
"""

from __future__ import annotations

import sys

from ..errors import UsageError

#: frames above ``WdsPipeline.__iter__`` that are looked at
DEPTH = 12

DOUBLE_BATCHING = (
    "wdsllm.dataset(...) yields whole batches, and a DataLoader with batch_size set is batching them again "
    "(the Hugging Face Trainer does this with per_device_train_batch_size). Use DataLoader(pipe, batch_size=None), "
    "or with the Trainer pass train_loader=wdsllm.loader(...) to wdsllm.integrations.hf.Trainer "
    "(docs/integrations.md)"
)
SHARDED = (
    "accelerate is splitting wdsllm's batches across ranks again, but wdsllm.dataset(...) already yields each rank "
    "its own share: do not accelerator.prepare() it; use wdsllm.integrations.accelerate.prepare(accelerator, "
    "wdsllm.loader(...)) (docs/integrations.md)"
)
DISPATCHED = (
    "accelerate's dispatch_batches reads rank 0's share and splits it across the ranks, but wdsllm.dataset(...) "
    "already yields each rank its own share: do not accelerator.prepare() it; use "
    "wdsllm.integrations.accelerate.prepare(accelerator, wdsllm.loader(...)) (docs/integrations.md)"
)


def _world() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def wrapper_problem(skip: int = 2) -> str | None:
    """What is wrong with the iteration in progress (a message), or None; ``skip`` frames are
    this function's and its caller's."""
    frame = sys._getframe(skip)
    for _ in range(DEPTH):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        name = type(owner).__name__ if owner is not None else ""
        if name == "_IterableDatasetFetcher" and getattr(owner, "auto_collation", False):
            return DOUBLE_BATCHING
        if name == "IterableDatasetShard" and getattr(owner, "num_processes", 1) > 1:
            return SHARDED
        if name == "DataLoaderDispatcher" and _world() > 1:
            return DISPATCHED
        frame = frame.f_back
    return None


def refuse_rewrapping() -> None:
    """Raise UsageError when the caller's iteration would batch or shard our batches again."""
    problem = wrapper_problem(skip=3)
    if problem is not None:
        raise UsageError(problem)
