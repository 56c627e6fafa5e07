"""The Source protocol: what the plan, the counts, the stream and the faces ask of a source.

A source is a packed dataset (``packed.PackedSource``), raw text tokenized on the way in
(``load.raw.RawSource``) or a mixture of those (``mixture.MixtureSource``). Its units (shards,
or units of raw input) are numbered 0..n-1 in plan order; everything after the plan sees items of
those units, whatever the source. What a source may not know is said by its answers (no index:
no counts; no lengths.npy or count sidecar: no lengths), never by which class it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from ... import format as fmt
    from ..block import Block
    from ..counts import EpochPlan
    from ..mixplan import Mixing
    from ..plan import Slice
    from ..read import GroupStart, ReadOptions


class DocumentLengths(Protocol):
    """Every document's token count, unit by unit, known without reading a unit: lengths.npy of
    an index, the lengths of a count sidecar, or a mixture's sources' lengths end to end."""

    def of_unit(self, unit: int, start: int = 0, stop: int | None = None, *, check: bool = True) -> np.ndarray:
        """Token counts of documents [start, stop) of ``unit`` (int64, a copy). ``check=False``:
        read now, checked later (``check``)."""
        ...

    def sums(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, list]:
        """(the sum of the lengths of documents [starts, stops) of each unit of ``units``, what
        was read for them unchecked: pass it to ``check`` before acting on the sums). One read
        per range, no Python object per document."""
        ...

    def pieces(self, units: np.ndarray, starts: np.ndarray, stops: np.ndarray, max_len: int) -> np.ndarray:
        """Items the documents [starts, stops) of each unit of ``units`` make when split at
        ``max_len`` (``block.pieces_per_doc`` summed; ranges that do not overlap), read checked in
        one pass over the spans the ranges cover."""
        ...

    def check(self, read: list) -> None:
        """Check what ``sums`` read unchecked (each chunk once per process)."""
        ...

    def whole(self) -> np.ndarray:
        """Every document's length, units in order (uint32; mapped where it can be, not copied)."""
        ...


@dataclass(frozen=True)
class Opening:
    """How the stream opens a unit ahead of reading it: ``storage.open_stream(url, **kwargs)``,
    entered at ``start`` (a group of a remote shard) or from the beginning (None)."""

    url: str
    kwargs: dict
    start: GroupStart | None = None


class UnitReader(Protocol):
    """What reads one source's units into blocks: a packed dataset's shards, or raw text's units."""

    urls: Sequence[str]

    def opening(self, sl: Slice, skip: int, options: ReadOptions, whole: bool = False) -> Opening | None:
        """How the stream opens the slice's unit ahead of reading it (a shard's bytes, read ahead
        while the shard before is consumed), or None: the reader opens it itself (raw text's
        units are files its reader parses). ``whole``: the unit from its start, not the range the
        slice needs (several slices of the pass share one read of it)."""
        ...

    def read(
        self,
        sl: Slice,
        *,
        skip: int,
        options: ReadOptions,
        opened: Opening | None = None,
        stream: Any = None,
        stats: Any = None,
        held: dict | None = None,
    ) -> Iterator[Block]:
        """The slice's items after ``skip`` of them (documents counted), as blocks; ``opened``
        and ``stream``: what ``opening`` said and the stream opened by it; ``held``: what the
        reader keeps for the pass's next slices (the stream's, dropped when the pass ends)."""
        ...


@runtime_checkable
class Source(Protocol):
    """What the loader asks of a source: its units, counts, lengths, fingerprint, plan and read.

    - units: ``urls`` names each unit (in messages, ``skipped_shards``); ``mode`` is "docs" or
      "packed"; ``index`` describes the source as one dataset where it can (tokenizer, seq_len).
    - counts: items (documents, or rows) and tokens per unit, or None without an index.
    - lengths: every document's length (``lengths()``), or None: then counts that need lengths
      are unknown, and a resume re-reads instead of seeking.
    - plan: a mixture plans its own epochs (``default_plan``) and orders a shuffle block by
      source (``mixing``); ``bind`` settles what depends on the loader's settings.
    - read: ``reader(unit)`` is the reader of a unit and the unit's number there.
    """

    urls: Sequence[str]
    index: fmt.Index | None
    #: whether the stream opens some of the units itself, ahead of reading them (``UnitReader.opening``)
    opens_units: bool
    #: a ``storage.ShardCache`` for remote side files (set by the pipeline that reads the source)
    side_cache: Any

    @property
    def mode(self) -> str: ...

    @property
    def items_per_shard(self) -> np.ndarray | None:
        """Items (documents, or rows of packed data) per unit, int64; None when not known."""
        ...

    @property
    def tokens_per_shard(self) -> np.ndarray | None:
        """Tokens per unit, int64; None when not known."""
        ...

    def lengths(self) -> DocumentLengths | None:
        """Every document's length without reading a unit, or None when the source cannot say."""
        ...

    def fingerprint(self) -> str:
        """Identifies the units' content (and what decides their tokens): a resume state or a
        counts table made for other data is refused."""
        ...

    def tokenizer_json(self) -> str:
        """The tokenizer.json text the source's tokens come from (``TokenizerError`` when it
        carries none)."""
        ...

    def reads_remote(self) -> bool:
        """Whether any unit is read over the network (known without walking every unit where it can be)."""
        ...

    def describe_for_mixture(self, name: str) -> fmt.Index:
        """The source as an index describes it (tokenizer, mode, dtype, per-unit counts), for a
        mixture that plans it as its source ``name``; ``MixtureError`` when it cannot be one."""
        ...

    @property
    def mixing(self) -> Mixing | None:
        """How a shuffle block orders its items by source (a mixture's); None: a plain shuffle."""
        ...

    def default_plan(self, epoch: int) -> EpochPlan | None:
        """The plan of every epoch when the source makes its own (a mixture's quotas); None: the
        plan of one dataset (``plan.plan_epoch``)."""
        ...

    def has_step_schedule(self) -> bool:
        """Whether the plan has points counted in steps (a mixture's ``at_step``), which move
        with the world size: an elastic resume cannot keep them."""
        ...

    def bind(self, cfg: Any, world: int) -> None:
        """Settle what depends on the loader's settings, and refuse what the source cannot do
        with them (``ConfigError``)."""
        ...

    def components(self) -> Sequence[Source]:
        """The sources whose units this one reads, in order: a mixture's, or the source itself."""
        ...

    def reader(self, unit: int) -> tuple[UnitReader, int]:
        """The reader of ``unit`` and the unit's number there (a mixture's source; one dataset
        reads its own)."""
        ...


class OneDataset:
    """What a source that is one dataset (not a mixture) answers of the plan: a shuffle block is a
    plain permutation, every epoch is ``plan.plan_epoch``'s, no schedule counts steps."""

    @property
    def mixing(self) -> None:
        return None

    def default_plan(self, epoch: int) -> None:
        return None

    def has_step_schedule(self) -> bool:
        return False
