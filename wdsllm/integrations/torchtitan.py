"""torchtitan: a data loader that its trainer builds from the config (docs/integrations.md, "torchtitan").

:class:`WdsllmDataLoader` is a torchtitan ``BaseDataLoader``. Set ``config.dataloader =
WdsllmDataLoader.Config(dataset_path="s3://bucket/corpus")`` and the trainer builds it with the
keywords its builder passes (``dp_rank``, ``dp_world_size``, ``seq_len``, ``local_batch_size``;
the others are not needed). It yields ``({"input": ..., "positions": ...}, labels)``, int64 as
torchtitan's own loader does, ``labels`` the next tokens (the loader's ``shift_labels``: rows of
``seq_len + 1`` tokens, no label lost at a row's end), ``positions`` each document's (``-100``
where a document ends) or the row's. It streams endlessly with the same number of batches on
every data-parallel rank, epoch after epoch. Its state goes through ``CheckpointManager``: under
torchtitan's one key ``dataloader`` where any rank's state resumes every rank (also on another
data-parallel size), else under one key per data-parallel rank (``dp_rank_R``), as torchtitan's
own loader stores it. Context parallelism is torchtitan's trainer's: it cuts whole rows itself
(``prepare_context_parallel_input``), so the loader hands every CP peer the whole row.

The config's fields are the loader's options (``load/options.py``) that apply here, with this
adapter's defaults where they differ (:data:`DEFAULTS`); the trainer gives the batch size and the
row length. Without a mesh, the peers that must get the same batches (tensor, context, pipeline
parallel) are found by one gather of the data-parallel ranks when the loader is built, so the
agreement check runs; a trainer that has the data-loading mesh may pass it (``mesh=``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Annotated, Any

from . import _need

_need("torchtitan", "torchtitan")

import torch  # noqa: E402
import tyro  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402

from ..errors import ConfigError  # noqa: E402
from ..load.loader import Loader, loader  # noqa: E402
from ..load.options import FACE_RECORDS  # noqa: E402
from ..load.sources.open import open_source  # noqa: E402

log = logging.getLogger(__name__)

#: the loader options a torchtitan config takes: the trainer gives the batch size and row length,
#: the builder the data-parallel rank; labels are always the next tokens, and ``docs`` is not read
OPTIONS = (
    *("seed", "shuffle", "shuffle_buffer", "epochs", "equal_batches", "uneven"),
    *("batching", "window", "max_len", "max_len_mode", "pad_id", "boundaries", "max_segments", "drop_last"),
    *("num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "multiprocessing_context"),
    *("cache_dir", "cache_size", "on_error", "check_groups", "fetch_process", "replicas", "agree_every"),
    *("wait_window", "reduce_every", "watchdog_s", "watchdog_raise"),
)
#: where this adapter's default is not the loader's: torchtitan trains for ``training.steps`` on an
#: endless stream with full batches of equal count on every rank (its gradient accumulation and
#: microbatches count on ``local_batch_size``), positions per document as its own loader gives them;
#: ``batching=None``: a packed dataset's rows, else documents concatenated into rows
DEFAULTS: dict[str, Any] = {"epochs": None, "equal_batches": True, "boundaries": True, "drop_last": True}
DEFAULTS["batching"] = None
#: what an option means here where it means more than in the loader
DOCS = {"batching": "None: a packed dataset's rows as they are, documents concatenated into rows ('concat'); or 'pack'"}
#: the data-loading mesh torchtitan 0.3 builds (``ParallelDims.build_mesh``): ``batch`` splits the data
DATA_MESH_DIMS = ("pp", "batch", "cp", "tp")


def _fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """The config's fields, from the option records: each option's type, default and doc."""
    declared = {f.name: f for record in FACE_RECORDS for f in dataclasses.fields(record)}
    out = []
    for name in OPTIONS:
        f = declared[name]
        kind = eval(f.type, {})  # the record's own annotation ("int | None"): builtins only
        default = DEFAULTS.get(name, f.default)
        if default is None and "None" not in f.type:
            kind = kind | None
        doc = DOCS.get(name, f.metadata["doc"])
        out.append((name, Annotated[kind, tyro.conf.arg(help=doc)], dataclasses.field(default=default, kw_only=True)))
    return out


def _config_class() -> type:
    doc = (
        "A wdsllm source for torchtitan: ``dataset_path`` is a dataset directory or URL holding index.json, "
        "or a mixture file; the other fields are the loader's options (docs/loader.md)."
    )
    return dataclasses.make_dataclass(
        "Config",
        _fields(),
        bases=(BaseDataLoader.Config,),
        kw_only=True,
        slots=True,
        namespace={"__doc__": doc, "__module__": __name__, "__qualname__": "WdsllmDataLoader.Config"},
    )


class WdsllmDataLoader(BaseDataLoader):
    """A ``wdsllm.loader`` as torchtitan's trainer takes a data loader (see the module's docstring)."""

    Config = _config_class()

    def __init__(
        self,
        config: Any,
        *,
        dp_rank: int,
        dp_world_size: int,
        seq_len: int,
        local_batch_size: int,
        tokenizer: Any = None,
        mesh: Any = None,
        **_unused: Any,  # snapshot_every_n_steps: every step's state is exact
    ) -> None:
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        source = config.dataset_path or config.dataset
        if not source:
            raise ConfigError(
                "set dataloader.dataset_path to a wdsllm dataset (a directory or URL holding index.json) or a "
                "mixture file"
            )
        catalog = open_source(source, on_error=config.on_error)
        options = {k: v for k, v in dataclasses.asdict(config).items() if k in OPTIONS}
        options["batching"] = _batching(catalog, options["batching"], seq_len)
        rows = None if catalog.mode == "packed" else seq_len
        layout = _layout(dp_rank, dp_world_size, mesh)
        self.loader: Loader = loader(
            catalog, batch_size=local_batch_size, seq_len=rows, shift_labels=True, docs=False, **options, **layout
        )
        if (self.loader.rank, self.loader.world_size) != (dp_rank, dp_world_size):
            raise ConfigError(
                f"the layout makes this process data-parallel rank {self.loader.rank} of {self.loader.world_size}; "
                f"torchtitan's builder says {dp_rank} of {dp_world_size}"
            )
        _check_tokenizer(self.loader, tokenizer)
        #: where only each rank's own state resumes it, states are kept per data-parallel rank
        self.per_rank = not self.loader.one_state_for_all

    @property
    def state_key(self) -> str:
        """The key of this rank's state where states are kept per data-parallel rank."""
        return f"dp_rank_{self.dp_rank}"

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.loader:
            yield titan_batch(batch)

    def state_dict(self) -> dict[str, Any]:
        state = self.loader.state_dict(kept_per_rank=self.per_rank)
        return {self.state_key: state} if self.per_rank else dict(state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # nothing was saved (as torchtitan's own loader takes it)
            return
        self.loader.load_state_dict(state_dict[self.state_key] if self.per_rank else state_dict)

    def close(self) -> None:
        """Stop the loader's workers and downloads."""
        self.loader.close()


def titan_batch(batch: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A wdsllm batch as torchtitan's training step takes it: only what its model's forward takes
    (every other key of the dict becomes a keyword of it), with positions always (its CP cut needs
    them): each document's, or the row's."""
    inputs = batch["input_ids"]
    positions = batch.get("position_ids")
    if positions is None:
        n, width = inputs.shape
        positions = torch.arange(width, dtype=torch.long).repeat(n, 1)
    return {"input": inputs, "positions": positions}, batch["shift_labels"]


def _batching(catalog: Any, batching: str | None, seq_len: int) -> str:
    """The batching mode that makes rows of ``seq_len`` positions from this dataset."""
    if catalog.mode == "packed":
        rows = catalog.index.seq_len if catalog.index is not None else None
        if rows is not None and rows != seq_len + 1:
            raise ConfigError(
                f"the dataset's rows hold {rows} tokens: with next-token labels a row gives {rows - 1} positions, "
                f"and training.seq_len is {seq_len}; pack with --seq-len {seq_len + 1} (one more token than the model "
                f"sees, the last one only a label), or set training.seq_len = {rows - 1}"
            )
        return batching or "fixed"
    batching = batching or "concat"
    if batching not in ("concat", "pack"):
        raise ConfigError(
            f"batching={batching!r} makes padded documents; torchtitan trains on rows of training.seq_len: "
            "batching='concat' or 'pack' (or a packed dataset)"
        )
    return batching


def _layout(dp_rank: int, dp_world_size: int, mesh: Any) -> dict[str, Any]:
    """The loader's layout: the data-loading mesh where given, else the peers of this data-parallel
    rank found by a gather of every process's rank (a collective: every rank builds its loader at
    the same point), else the data-parallel rank alone."""
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if "batch" not in names:
            raise ConfigError(
                f"mesh= is the data-loading mesh torchtitan builds, with dims {DATA_MESH_DIMS} (this one has "
                f"{names}): parallel_dims.get_optional_mesh({list(DATA_MESH_DIMS)}, include_singleton_axes=True)"
            )
        return {"mesh": mesh, "dp": "batch"}
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == dp_world_size:
        return {"rank": dp_rank, "world_size": dp_world_size}
    return _peer_groups(dist, dp_rank, dp_world_size)


def _peer_groups(dist: Any, dp_rank: int, dp_world_size: int) -> dict[str, Any]:
    """``dp_group=`` and ``replica_group=`` from every process's data-parallel rank: the processes
    of one rank are its peers (in global rank order); the n-th peers of every rank form a
    data-parallel group."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dp_rank)
    peers = [[g for g, r in enumerate(every) if r == d] for d in range(dp_world_size)]
    if sorted(set(every)) != list(range(dp_world_size)) or len({len(p) for p in peers}) != 1:
        raise ConfigError(
            f"the processes' data-parallel ranks are {every}: every rank of 0..{dp_world_size - 1} needs as many "
            "processes as the others"
        )
    replica_group, _ = dist.new_subgroups_by_enumeration(peers)
    dp_group, _ = dist.new_subgroups_by_enumeration([list(column) for column in zip(*peers)])
    return {"dp_group": dp_group, "replica_group": replica_group}


def _check_tokenizer(ld: Loader, tokenizer: Any) -> None:
    """Warn where torchtitan's tokenizer is plainly not the dataset's (another vocabulary size or
    end-of-text id): the model would learn ids that mean other words to it."""
    info = ld.catalog.index.tokenizer if ld.catalog.index is not None else None
    if tokenizer is None or info is None:
        return
    theirs = (tokenizer.get_vocab_size(), tokenizer.eos_id)
    if theirs != (info.vocab_size, info.eos_id):
        log.warning(
            "the dataset was tokenized with %s (vocabulary %d, eos id %s); torchtitan's tokenizer has vocabulary %s, "
            "eos id %s: check model.hf_assets_path",
            info.source,
            info.vocab_size,
            info.eos_id,
            *theirs,
        )


__all__ = ["DEFAULTS", "OPTIONS", "WdsllmDataLoader", "titan_batch"]
