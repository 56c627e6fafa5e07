"""A mixture as one catalog: the sources' shards end to end in one shard numbering, so that the
stages after the plan see ordinary items (ids ``(shard << 32) | ordinal`` stay unique and say
their source), and the plan is the mixture's (``mixplan``). Not a second pipeline.

``MixSource`` is the seam: what a mixture needs of one source. A packed dataset (a ``Catalog``)
is one (``CatalogSource``); raw text with its count sidecar is another (``mixraw.RawSource``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from .. import format as fmt
from .. import storage
from ..errors import ConfigError, MixtureError, WdsllmError
from .block import Block
from .catalog import Catalog, open_catalog
from .mixplan import DEFAULT_MIX_WINDOW, Mixing, MixPlanner, MixturePlan
from .mixture import Mixture, load_mixture_file
from .plan import Slice
from .stream import StreamSpec, slice_items


class MixSource(Protocol):
    """What a mixture needs of one source: its shards' counts (to plan from the index alone), an
    item's length (to cut a token quota inside a shard), what must agree between sources, and the
    catalog its shards are read through."""

    name: str

    def items_per_shard(self) -> np.ndarray:
        """Items (documents, or rows of packed data) per shard, int64."""
        ...

    def tokens_per_shard(self) -> np.ndarray: ...

    def item_lengths(self, shard: int) -> np.ndarray:
        """Token count of each item of one shard, in shard order."""
        ...

    def reader(self) -> Catalog:
        """The catalog that reads this source's shards (its shard numbers are the source's own)."""
        ...

    def index(self) -> fmt.Index | None:
        """The source as an index describes it (tokenizer, mode, dtype, shard counts): what must
        agree between sources, and what the mixture's combined index is made of."""
        ...


@dataclass
class CatalogSource:
    """A packed dataset as a mixture source."""

    name: str
    catalog: Catalog

    def items_per_shard(self) -> np.ndarray:
        return self.catalog.items_per_shard

    def tokens_per_shard(self) -> np.ndarray:
        return self.catalog.tokens_per_shard

    def item_lengths(self, shard: int) -> np.ndarray:
        return slice_items(self.catalog, Slice(shard), StreamSpec(0, 0, 0, 1, 0, 1))

    def reader(self) -> Catalog:
        return self.catalog

    def index(self) -> fmt.Index | None:
        return self.catalog.index


class _JoinedUrls(Sequence):
    """The sources' shard URLs end to end (made when asked for)."""

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
class MixtureCatalog(Catalog):
    """The sources' shards in one numbering: source s owns shards [bases[s], bases[s+1])."""

    mixture: Mixture | None = None
    sources: list = field(default_factory=list)
    bases: np.ndarray | None = None
    planner: MixPlanner | None = field(default=None, repr=False)
    _mixing: Mixing | None = field(default=None, repr=False)

    @classmethod
    def build(cls, mixture: Mixture, sources: list[MixSource]) -> MixtureCatalog:
        catalogs = [s.reader() for s in sources]
        indexes = [s.index() for s in sources]
        _check_compatible(mixture, indexes)
        bases = np.zeros(len(sources) + 1, np.int64)
        np.cumsum([len(c.urls) for c in catalogs], out=bases[1:])
        index = _combined_index(mixture, catalogs, indexes)
        # the tokenizer.json that index.tokenizer_file names (all sources share it): a packed source's
        first = next((c for c, ix in zip(catalogs, indexes) if c.index is ix and c.root is not None), catalogs[0])
        return cls(
            urls=_JoinedUrls([c.urls for c in catalogs], bases),
            index=index,
            root=first.root,
            retry=first.retry,
            mixture=mixture,
            sources=list(sources),
            bases=bases,
            _mixing=Mixing(tuple(int(b) for b in bases)),
        )

    # -- the hooks the loader asks --------------------------------------------------------------
    @property
    def mixing(self) -> Mixing | None:
        return self._mixing

    def owner(self, shard: int) -> tuple[Catalog, int, int]:
        s = int(np.searchsorted(self.bases, shard, side="right")) - 1
        return self.sources[s].reader(), shard - int(self.bases[s]), int(self.bases[s])

    def default_plan(self, epoch: int) -> MixturePlan:
        return MixturePlan(self._planner(), self._mixing, epoch)

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
        window = DEFAULT_MIX_WINDOW
        self._mixing = Mixing(self._mixing.bases, group, window)
        self.planner = MixPlanner(self.mixture, self.sources, self.bases, cfg.seed, cfg.shuffle)
        self.planner.step_units = _step_units(self, cfg, world)
        self.planner.phases()  # an at_step schedule without a known step size is refused now
        for s in self.sources:
            s.reader().side_cache = self.side_cache

    def _planner(self) -> MixPlanner:
        if self.planner is None:  # not bound to loader settings: seed 0, shuffled
            self.planner = MixPlanner(self.mixture, self.sources, self.bases, 0, True)
        return self.planner

    # -- per-shard facts, from the owning source -------------------------------------------------
    def _column(self, name: str) -> np.ndarray | None:
        if name not in self._columns:
            self._columns[name] = self.index.shards.column(name)  # the sources' (a raw one's from its sidecar)
        return self._columns[name]

    @property
    def shard_entries(self) -> Sequence[fmt.ShardEntry]:
        return self.index.shards

    def lengths_file(self):
        files = [s.reader().lengths_file() for s in self.sources]
        return None if any(f is None for f in files) else files[0]

    def shard_lengths(self, shard: int, start: int = 0, stop: int | None = None, *, check: bool = True):
        cat, local, _ = self.owner(shard)
        return cat.shard_lengths(local, start, stop, check=check)

    def lengths_range(self, shard: int, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        raise NotImplementedError("a mixture has no one lengths.npy; ask its sources")

    def lengths(self) -> np.ndarray | None:
        parts = [s.reader().lengths() for s in self.sources]
        return None if any(p is None for p in parts) else np.concatenate(parts)

    def group_table(self, shard: int) -> np.ndarray | None:
        cat, local, _ = self.owner(shard)
        return cat.group_table(local)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.sources:
            h.update(f"{s.name}:{s.reader().fingerprint()}|".encode())
        h.update(json.dumps(self.mixture.describe(), sort_keys=True).encode())
        return h.hexdigest()[:16]

    # -- what the mixture plans -----------------------------------------------------------------
    def names(self) -> list[str]:
        return self.mixture.names


def _step_units(catalog: MixtureCatalog, cfg: Any, world: int) -> int | None:
    """Units of the run per step (one batch on every rank), where a step is a fixed amount."""
    if not cfg.batch_size:
        return None
    rows = catalog.mode == "packed" or cfg.mode.rows
    if catalog.mixture.unit == "items" and cfg.batching == "fixed":  # a batch is batch_size items
        return int(cfg.batch_size) * world
    if catalog.mixture.unit == "tokens" and rows and cfg.batching in ("fixed", "concat"):
        seq_len = cfg.seq_len if cfg.mode.rows else catalog.index.seq_len
        return int(cfg.batch_size) * int(seq_len) * world
    return None


def _check_compatible(mixture: Mixture, indexes: list[fmt.Index | None]) -> None:
    names = mixture.names
    for name, ix in zip(names, indexes):
        if ix is None:
            raise MixtureError(f"mixture source {name!r} has no index.json: a mixture is planned from the indexes")
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


def _combined_index(mixture: Mixture, catalogs: list[Catalog], indexes: list[fmt.Index]) -> fmt.Index:
    """An index describing the mixture as one dataset: the first packed source's identity (its
    tokenizer.json), the widest dtype, every shard (named ``source/shard``), the longest document."""
    first = next((ix for c, ix in zip(catalogs, indexes) if c.index is ix), indexes[0])
    columns = np.concatenate(
        [
            ix.shards.columns if c.positions is None else ix.shards.columns[c.positions]
            for c, ix in zip(catalogs, indexes)
        ]
    )
    names = [f"{n}/{storage.redact(u).rsplit('/', 1)[-1]}" for n, c in zip(mixture.names, catalogs) for u in c.urls]
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


def open_mixture(source: Any, retry: storage.RetryPolicy | None = None, on_error: str = "raise") -> MixtureCatalog:
    """A Mixture, or the path or URL of a mixture file, as one catalog (``on_error``: the
    loader's, what a raw-text source that sets none parses with)."""
    from .mixraw import is_raw_source, open_raw_source

    mixture = source if isinstance(source, Mixture) else load_mixture_file(source, retry=retry)
    opened: dict[str, MixSource] = {}
    for name, src in mixture.sources.items():
        if is_raw_source(src):
            continue  # opened once the packed sources are: their tokenizer is its default
        try:
            catalog = open_catalog(src, retry=retry)
        except (storage.StorageError, fmt.FormatError) as exc:
            raise _renamed(exc, name)  # noqa: B904 - the same error, its message naming the source
        if isinstance(catalog, MixtureCatalog):
            raise MixtureError(f"mixture source {name!r} is itself a mixture; list its sources instead")
        opened[name] = CatalogSource(name, catalog)
    packed = [s.catalog for s in opened.values()]
    for name, src in mixture.sources.items():
        if is_raw_source(src):
            try:
                opened[name] = open_raw_source(name, src, packed, on_error=on_error)
            except MixtureError:
                raise
            except WdsllmError as exc:  # a missing input, a sidecar of other inputs, a tokenizer
                raise _renamed(exc, name)  # noqa: B904 - the same error, its message naming the source
    return MixtureCatalog.build(mixture, [opened[name] for name in mixture.names])


def _renamed(exc: Exception, name: str) -> Exception:
    """The error, its message prefixed with the source's name (the same class, so handlers match)."""
    exc.args = (f"mixture source {name!r}: {exc.args[0] if exc.args else exc}", *exc.args[1:])
    return exc


# ----------------------------------------------------------------------------------------------
# The realized mix


class MixTally:
    """Tokens and items delivered per source, so far and in the current epoch."""

    def __init__(self, catalog: MixtureCatalog):
        self.catalog = catalog
        k = len(catalog.sources)
        self.total = np.zeros((k, 2), np.int64)  # [source, (tokens, items)]
        self.this_epoch = np.zeros((k, 2), np.int64)
        self.epoch: int | None = None

    def add(self, counts: np.ndarray, epoch: int) -> None:
        """Count a batch's ``mix_counts`` (made where the batch was made: in its worker)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.this_epoch[:] = 0
        self.total += counts
        self.this_epoch += counts

    def report(self, world: int = 1) -> dict[str, dict]:
        planner = self.catalog._planner()
        epoch = self.epoch or 0
        quotas = planner.unit_quotas(epoch)
        weights = _weights_at(planner, epoch)
        unit = 0 if self.catalog.mixture.unit == "tokens" else 1
        delivered = self.this_epoch[:, unit]
        share = delivered / max(1, int(delivered.sum()))
        out = {}
        for s, name in enumerate(self.catalog.names()):
            out[name] = {
                "tokens": int(self.total[s, 0]),
                "items": int(self.total[s, 1]),
                "epoch_tokens": int(self.this_epoch[s, 0]),
                "epoch_items": int(self.this_epoch[s, 1]),
                "share": float(share[s]),
                "target_share": float(weights[s]),
                "epoch_quota": int(quotas[s]),
                "rank_quota": int(quotas[s]) // max(1, world),
            }
        return out


def _weights_at(planner: MixPlanner, epoch: int) -> list[float]:
    """The epoch's planned share of each source (its quotas over their sum)."""
    q = planner.unit_quotas(epoch)
    total = sum(q) or 1
    return [x / total for x in q]


def mix_counts(items: Block, mixing: Mixing, mode: str) -> np.ndarray:
    """[sources, 2]: a batch's tokens and items (documents or pieces; rows of packed data) by source."""
    src, tokens = block_sources(items, mixing, mode)
    k = mixing.sources
    out = np.empty((k, 2), np.int64)
    out[:, 0] = np.bincount(src, weights=tokens, minlength=k)
    out[:, 1] = np.bincount(src, minlength=k)
    return out


def block_sources(items: Block, mixing: Mixing, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(source, tokens) of every document or document piece of a batch: one entry per item, or
    per segment of rows made from documents (it runs for every batch: few numpy calls)."""
    if mode == "packed" or items.seg_ids is None:
        return mixing.sources_of_ids(items.ids), items.lengths
    _, src = items.segments()
    sources = mixing.sources_of_ids(items.seg_ids[src])
    if items.seg_lens is not None:  # rows made by a batcher, which knew each segment's tokens
        return sources, items.seg_lens[src]
    starts = items.seg_starts[src]
    ends = np.empty(len(src), starts.dtype)  # a segment ends where the next of its row starts ...
    ends[:-1] = starts[1:]
    rows, last = items.row_last_segments()
    ends[last] = items.lengths[rows]  # ... or, the last, at its row's end
    return sources, ends - starts


# ----------------------------------------------------------------------------------------------
# What `wdsllm stats` says of a mixture, from the indexes alone


def mixture_summary(catalog: MixtureCatalog, epoch: int = 0) -> list[dict]:
    """Per source: its size (items, tokens), weight, the epoch's quota in the unit and in items,
    and whether the quota repeats the source (``repeats``: quota / size) or takes a subset
    (``subset``: the fraction taken)."""
    planner = catalog._planner()
    units = planner.unit_quotas(epoch)
    items = planner.quotas(epoch)
    total = sum(units) or 1
    out = []
    for s, name in enumerate(catalog.names()):
        st = planner.streams[s]
        size = planner.sizes[s]
        ratio = units[s] / size if size else 0.0
        out.append(
            {
                "source": name,
                "items": st.size,
                "tokens": st.token_size,
                "weight": units[s] / total,
                "quota": units[s],
                "quota_items": items[s],
                "repeats": ratio if ratio >= 1 else None,
                "subset": ratio if ratio < 1 else None,
            }
        )
    return out


def planned_shares(catalog: MixtureCatalog, epochs: int = 1, points: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """(positions in the unit, [points, sources] weights in force there) over ``epochs`` epochs
    (schedule included): what ``wdsllm stats --plot`` draws."""
    planner = catalog._planner()
    end = planner.epoch * max(1, epochs)
    phases = planner.phases()
    xs = np.linspace(0, end, points, endpoint=False)
    starts = np.array([p for p, _ in phases])
    table = np.array([w for _, w in phases])
    return xs, table[np.searchsorted(starts, xs, side="right") - 1]
