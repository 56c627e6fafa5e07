"""wdsllm: pack text into WebDataset shards of pre-tokenized samples and stream them into PyTorch.

Two programs share one format: ``wdsllm.pack`` (text -> tokens -> shards) and ``wdsllm.load``
(shards -> plan -> batches), over ``wdsllm.format`` and ``wdsllm.storage``. The loader entry points
are imported lazily so that packing never pays for importing torch.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    ConfigError,
    FormatError,
    MergeError,
    NotFoundError,
    PackError,
    ShardError,
    SourceError,
    StateError,
    StorageError,
    TokenizerError,
    WdsllmError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "FormatError",
    "Loader",
    "MergeError",
    "NotFoundError",
    "PackError",
    "ShardError",
    "SourceError",
    "StateError",
    "StorageError",
    "TokenizerError",
    "WdsllmError",
    "__version__",
    "dataset",
    "loader",
]


def __getattr__(name: str) -> Any:
    if name == "dataset":
        from .load.dataset import dataset

        return dataset
    if name in ("loader", "Loader"):
        from .load import loader as loader_module

        return getattr(loader_module, name)
    raise AttributeError(f"module 'wdsllm' has no attribute {name!r}")
