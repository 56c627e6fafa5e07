"""A mixture as one source: the sources' units end to end in one numbering, so that the stages
after the plan see ordinary items (ids ``(unit << 32) | ordinal`` stay unique and say their
source), and the plan is the mixture's (``mixplan``). Not a second pipeline.

Each of its sources is a ``MixturePart``: the source, its name, and the source as an index
describes it (what must agree between sources, and what the plan reads its counts from).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ... import format as fmt
from ... import storage
from ...errors import ConfigError, MixtureError, TokenizerError
from ..counts import head_tokens
from ..mixplan import DEFAULT_MIX_WINDOW, Mixing, MixPlanner, MixturePlan
from ..mixture import Mixture
from ..plan import Slice
from ..stream import StreamSpec, slice_items
from .lengths import JoinedLengths
from .protocol import Source, UnitReader


@dataclass
class MixturePart:
    """One source of a mixture: its name, the source, and ``index``, the source as an index
    describes it (``describe_for_mixture``): tokenizer, mode, dtype, per-unit counts."""

    name: str
    source: Source
    index: fmt.Index

    def items_per_shard(self) -> np.ndarray:
        """Items (documents, or rows of packed data) per unit, int64."""
        return self.index.shards.column("rows" if self.index.mode == "packed" else "documents")

    def tokens_per_shard(self) -> np.ndarray:
        return self.index.shards.column("tokens")

    def item_lengths(self, unit: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Token count of each item [start, stop) of one unit, in unit order."""
        return slice_items(self.source, Slice(unit, start, stop), StreamSpec(0, 0, 0, 1, 0, 1))

    def range_tokens(self, units: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Tokens of items [firsts[i], firsts[i] + counts[i]) of unit ``units[i]``, for every i (the
        lengths read for them checked)."""
        ends, read = head_tokens(self.source, units, firsts + counts)
        starts, read_starts = head_tokens(self.source, units, firsts)
        if read or read_starts:
            self.source.lengths().check(read + read_starts)
        return ends - starts


class _JoinedUrls(Sequence):
    """The sources' unit names end to end (made when asked for)."""

    def __init__(self, parts: list[Sequence[str]], bases: np.ndarray):
        self.parts = parts
        self.bases = bases

    def __len__(self) -> int:
        return int(self.bases[-1])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        s = int(np.searchsorted(self.bases, i, side="right")) - 1
        return self.parts[s][i - int(self.bases[s])]

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


@dataclass
class MixtureSource:
    """The sources' units in one numbering: part s owns units [bases[s], bases[s+1])."""

    urls: Sequence[str]
    index: fmt.Index
    mixture: Mixture
    parts: list[MixturePart]
    bases: np.ndarray
    side_cache: Any = field(default=None, repr=False)
    planner: MixPlanner | None = field(default=None, repr=False)
    _mixing: Mixing | None = field(default=None, repr=False)
    _lengths: JoinedLengths | None = field(default=None, repr=False)

    @classmethod
    def build(cls, mixture: Mixture, parts: list[MixturePart]) -> MixtureSource:
        _check_compatible(mixture, [p.index for p in parts])
        bases = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p.source.urls) for p in parts], out=bases[1:])
        return cls(
            urls=_JoinedUrls([p.source.urls for p in parts], bases),
            index=_combined_index(mixture, parts),
            mixture=mixture,
            parts=list(parts),
            bases=bases,
            _mixing=Mixing(tuple(int(b) for b in bases)),
        )

    # -- units and counts ----------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.index.mode

    @property
    def opens_units(self) -> bool:
        return any(p.source.opens_units for p in self.parts)

    @property
    def items_per_shard(self) -> np.ndarray:
        return self.index.shards.column("rows" if self.mode == "packed" else "documents")

    @property
    def tokens_per_shard(self) -> np.ndarray:
        return self.index.shards.column("tokens")

    def lengths(self) -> JoinedLengths | None:
        """The sources' lengths end to end; None when one of them has none."""
        if self._lengths is None:
            parts = [p.source.lengths() for p in self.parts]
            if any(x is None for x in parts):
                return None
            self._lengths = JoinedLengths(parts, self.bases)
        return self._lengths

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for p in self.parts:
            h.update(f"{p.name}:{p.source.fingerprint()}|".encode())
        h.update(json.dumps(self.mixture.describe(), sort_keys=True).encode())
        return h.hexdigest()[:16]

    def tokenizer_json(self) -> str:
        """The tokenizer.json of the first source that carries one (all sources share it)."""
        error: TokenizerError | None = None
        for p in sorted(self.parts, key=lambda p: bool(p.index.options.get("raw"))):  # packed sources first
            try:
                return p.source.tokenizer_json()
            except TokenizerError as exc:
                error = error or exc
        raise error

    def reads_remote(self) -> bool:
        return any(p.source.reads_remote() for p in self.parts)

    def describe_for_mixture(self, name: str) -> fmt.Index:
        raise MixtureError(f"mixture source {name!r} is itself a mixture; list its sources instead")

    # -- the plan --------------------------------------------------------------------------------
    @property
    def mixing(self) -> Mixing:
        return self._mixing

    def default_plan(self, epoch: int) -> MixturePlan:
        return MixturePlan(self.mix_planner(), self._mixing, epoch)

    def has_step_schedule(self) -> bool:
        return any(p.at_step is not None for p in self.mixture.phases)

    def bind(self, cfg: Any, world: int) -> None:
        """Settle what depends on the loader's settings: the pass orders (seed, shuffle),
        stratified groups of batch_size, the units of a step; refuse what a mixture cannot do."""
        if cfg.resample:
            raise ConfigError("resample=True draws shards with replacement; a mixture's quotas decide what is drawn")
        group = 0
        if self.mixture.stratified:
            if cfg.batching != "fixed" or not cfg.batch_size:
                raise ConfigError("a stratified mixture needs batching='fixed' with a batch_size")
            group = int(cfg.batch_size)
        self._mixing = Mixing(self._mixing.bases, group, DEFAULT_MIX_WINDOW)
        self.planner = MixPlanner(self.mixture, self.parts, self.bases, cfg.seed, cfg.shuffle)
        self.planner.step_units = _step_units(self, cfg, world)
        self.planner.check_rounds(self._mixing.block_size(cfg.spec(0, 0, world, 0, 1)))
        self.planner.phases()  # an at_step schedule without a known step size is refused here, at bind, not mid-epoch
        for p in self.parts:
            p.source.side_cache = self.side_cache
            p.source.bind(cfg, world)

    def mix_planner(self) -> MixPlanner:
        """The planner bound to the loader's settings, or (not bound yet) one of seed 0, shuffled."""
        if self.planner is None:
            self.planner = MixPlanner(self.mixture, self.parts, self.bases, 0, True)
        return self.planner

    def names(self) -> list[str]:
        return self.mixture.names

    # -- reading: by the source that owns the unit -----------------------------------------------
    def components(self) -> list[Source]:
        return [p.source for p in self.parts]

    def reader(self, unit: int) -> tuple[UnitReader, int]:
        s = int(np.searchsorted(self.bases, unit, side="right")) - 1
        return self.parts[s].source.reader(unit - int(self.bases[s]))


def _step_units(source: MixtureSource, cfg: Any, world: int) -> int | None:
    """Units of the run per step (one batch on every rank), where a step is a fixed amount."""
    if not cfg.batch_size:
        return None
    rows = source.mode == "packed" or cfg.mode.rows
    if source.mixture.unit == "items" and cfg.batching == "fixed":  # a batch is batch_size items
        return int(cfg.batch_size) * world
    if source.mixture.unit == "tokens" and rows and cfg.batching in ("fixed", "concat"):
        seq_len = cfg.seq_len if cfg.mode.rows else source.index.seq_len
        return int(cfg.batch_size) * int(seq_len) * world
    return None


def _check_compatible(mixture: Mixture, indexes: list[fmt.Index]) -> None:
    names = mixture.names
    first = indexes[0]

    def how(a: fmt.Index, b: fmt.Index) -> str:
        raw = a.options.get("raw") or b.options.get("raw")
        return "tokenize with" if raw else "were packed with"

    for name, ix in zip(names[1:], indexes[1:]):
        if ix.tokenizer.sha256 != first.tokenizer.sha256:
            raise MixtureError(
                f"mixture sources {names[0]!r} and {name!r} {how(first, ix)} different tokenizers "
                f"({first.tokenizer.source!r} sha256 {first.tokenizer.sha256[:12]}..., {ix.tokenizer.source!r} "
                f"sha256 {ix.tokenizer.sha256[:12]}...)"
            )
        for special in ("bos", "eos"):
            a, b = first.options.get(special), ix.options.get(special)
            if a is not None and b is not None and bool(a) != bool(b):
                raise MixtureError(
                    f"mixture sources {names[0]!r} ({special.upper()} {'added' if a else 'not added'}) and {name!r} "
                    f"({special.upper()} {'added' if b else 'not added'}) {how(first, ix)} different BOS/EOS rules"
                )
            ida, idb = getattr(first.tokenizer, f"{special}_id"), getattr(ix.tokenizer, f"{special}_id")
            if a and b and ida != idb:
                raise MixtureError(
                    f"mixture sources {names[0]!r} ({special.upper()} id {ida}) and {name!r} ({special.upper()} id "
                    f"{idb}) add different {special.upper()} tokens"
                )
        if ix.mode != first.mode:
            raise MixtureError(
                f"mixture sources {names[0]!r} ({first.mode}) and {name!r} ({ix.mode}) differ in mode: "
                "documents and packed rows cannot be mixed"
            )
        if ix.mode == "packed" and ix.seq_len != first.seq_len:
            raise MixtureError(
                f"mixture sources {names[0]!r} (seq_len {first.seq_len}) and {name!r} (seq_len {ix.seq_len}) "
                "are packed with different seq_len"
            )
        kinds = {np.dtype(first.dtype).kind, np.dtype(ix.dtype).kind}
        if kinds != {"u"}:
            raise MixtureError(
                f"mixture sources {names[0]!r} ({first.dtype}) and {name!r} ({ix.dtype}) have token dtypes that "
                "cannot be combined"
            )


def _combined_index(mixture: Mixture, parts: list[MixturePart]) -> fmt.Index:
    """An index describing the mixture as one dataset: the first packed source's identity (its
    tokenizer.json), the widest dtype, every unit (named ``source/unit``), the longest document."""
    indexes = [p.index for p in parts]
    first = next((ix for ix in indexes if not ix.options.get("raw")), indexes[0])
    columns = np.concatenate([ix.shards.columns for ix in indexes])
    names = [f"{p.name}/{storage.redact(u).rsplit('/', 1)[-1]}" for p in parts for u in p.source.urls]
    table = fmt.ShardTable(columns, names=names)
    dtype = max((np.dtype(ix.dtype) for ix in indexes), key=lambda d: d.itemsize).name
    longest = max(int((ix.doc_lengths or {}).get("max", 0) or 0) for ix in indexes)
    packed = None
    if first.mode == "packed":
        segs = [(ix.packed or {}).get("max_row_segments") for ix in indexes]
        packed = {"max_row_segments": max(segs) if all(segs) else None}
    return replace(
        first,
        dtype=dtype,
        shards=table,
        doc_lengths={"max": longest},
        options={},
        inputs=[],
        skipped={},
        lengths_file=None,
        groups_file=None,
        shards_file=None,
        packed=packed,
    )
