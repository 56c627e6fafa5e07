"""wdsllm: pack text into WebDataset shards of pre-tokenized samples and stream them into PyTorch.

The loader entry points are imported lazily so that packing never pays for importing torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["dataset", "loader", "Loader", "__version__"]


def __getattr__(name: str):
    if name == "dataset":
        from .pipeline import dataset

        return dataset
    if name in ("loader", "Loader"):
        from . import loaders

        return getattr(loaders, name)
    raise AttributeError(f"module 'wdsllm' has no attribute {name!r}")
