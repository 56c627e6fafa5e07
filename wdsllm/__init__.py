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
    MissingDependencyError,
    MixtureError,
    NotFoundError,
    OtherRowsError,
    PackError,
    ReplicaError,
    ReplicaMismatchError,
    ShardError,
    SourceError,
    StateError,
    SteeringError,
    StorageError,
    TokenizerError,
    UsageError,
    WdsllmError,
    WorkerStalledError,
)

__version__ = "0.1.0"

#: the option records (``load/options.py``): importable without torch
OPTION_RECORDS = (
    "BatchOptions",
    "LayoutOptions",
    "ObserveOptions",
    "OrderOptions",
    "RawTextSource",
    "ReadingOptions",
    "SteerOptions",
    "WorkerOptions",
)

__all__ = [
    "BatchOptions",
    "ConfigError",
    "FormatError",
    "LayoutOptions",
    "Loader",
    "MergeError",
    "MissingDependencyError",
    "Mixture",
    "MixtureError",
    "NotFoundError",
    "ObserveOptions",
    "OrderOptions",
    "OtherRowsError",
    "PackError",
    "RawTextSource",
    "ReadingOptions",
    "ReplicaError",
    "ReplicaMismatchError",
    "Schedule",
    "ShardError",
    "SourceError",
    "StateError",
    "SteerOptions",
    "SteeringError",
    "StorageError",
    "TokenizerError",
    "UsageError",
    "WdsllmError",
    "WorkerOptions",
    "WorkerStalledError",
    "__version__",
    "dataset",
    "loader",
    "mean_losses",
    "ramp",
    "source_losses",
]


#: what the loader needs beyond a packing install, and the command that installs it
LOADER_EXTRA = ("torch", "webdataset")
LOADER_INSTALL = "pip install 'wdsllm[torch]'"


def __getattr__(name: str) -> Any:
    if name == "Mixture":  # no torch: a mixture is described (and checked) without the loader
        from .load.mixture import Mixture

        return Mixture
    if name in ("Schedule", "ramp"):  # no torch: schedules are checked before the loader
        from .load.steer import schedule as steering

        return getattr(steering, name)
    if name in OPTION_RECORDS:  # no torch either: records are built and checked before the loader
        from .load import options

        return getattr(options, name)
    if name not in ("dataset", "loader", "Loader", "source_losses", "mean_losses"):
        raise AttributeError(f"module 'wdsllm' has no attribute {name!r}")
    try:
        if name == "dataset":
            from .load.dataset import dataset

            return dataset
        if name in ("source_losses", "mean_losses"):
            from .load.steer import losses as sourceloss

            return getattr(sourceloss, name)
        from .load import loader as loader_module
    except ModuleNotFoundError as exc:
        if exc.name not in LOADER_EXTRA:
            raise
        raise MissingDependencyError(
            f"wdsllm.{name} needs {exc.name}, which is not installed: {LOADER_INSTALL} (packing works without it)"
        ) from exc
    return getattr(loader_module, name)
