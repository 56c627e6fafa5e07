"""The loader's options, each declared once: a few small records grouped by concern.

``wdsllm.loader`` and ``wdsllm.dataset`` take each record whole (``batch=BatchOptions(...)``) or
its fields as plain keywords (``batch_size=32``); :func:`split_options` sorts the keywords into
the records by field name, so the faces never repeat the list. Every field carries its default,
a one-line doc (the table in docs/loader.md is checked against it) and its bounds, which the
record checks when it is built: a bad number or word is a ``ConfigError`` naming the option,
before anything is opened. No torch.
"""

from __future__ import annotations

import difflib
import math
import numbers
import operator
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError, normalize_on_error
from ..inputs.sources import DEFAULT_MAX_DOC_BYTES
from .steer.schedule import Schedule

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from ..storage import RetryPolicy

MAX_LEN_MODES = ("split", "truncate")
SPLITS = ("line", "paragraph", "file")
UNEVEN = ("drop", "repeat")
CP_SPLITS = ("zigzag", "contiguous")
REPLICAS = ("read", "broadcast")


#: who must give an option the same value (``option(agree=...)``, compared over the process group
#: before a loader's first collective: ``describe.py``): every rank of the layout (the default: a
#: new option is compared unless it says why not), the replica peers of one data-parallel
#: coordinate only, or nobody (it changes neither the batches nor the collectives)
AGREE_ALL, AGREE_PEERS, AGREE_NONE = "all", "peers", "none"


def option(
    default: Any,
    doc: str,
    *,
    low: int | None = None,
    above: float | None = None,
    choices: tuple | None = None,
    shown: str | None = None,
    agree: str = AGREE_ALL,
) -> Any:
    """A record field: its default (``shown`` in the docs, if not as written), its one-line doc,
    what values it takes (integers of at least ``low``, real numbers greater than ``above``, or
    one of ``choices``; None wherever the annotation allows it), and which ranks must agree on it
    (``agree``: ``AGREE_ALL``, ``AGREE_PEERS`` or ``AGREE_NONE``)."""
    meta = {"doc": doc, "low": low, "above": above, "choices": choices, "shown": shown, "agree": agree}
    return field(default=default, metadata=meta)


def _check_int(where: str, value: Any, low: int) -> None:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be an integer, not {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"{where} must be an integer, not {value!r}") from None
    if number < low:
        raise ConfigError(f"{where} must be {'positive' if low == 1 else f'at least {low}'}, not {value!r}")


def _check_real(where: str, value: Any, above: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{where} must be a number of seconds, not {value!r}")
    if value <= above:
        raise ConfigError(f"{where} must be {'positive' if above == 0 else f'more than {above}'}, not {value!r}")


class Options:
    """What every option record does: check its fields against their declared bounds."""

    #: the keyword that takes the whole record in ``wdsllm.loader(...)``
    KEYWORD: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue
            low, above, choices = f.metadata.get("low"), f.metadata.get("above"), f.metadata.get("choices")
            if low is not None:
                _check_int(f.name, value, low)
            elif above is not None:
                _check_real(f.name, value, above)
            elif choices is not None and value not in choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(map(repr, choices))}, not {value!r}")

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}  # type: ignore[arg-type]


@dataclass(frozen=True)
class OrderOptions(Options):
    """What is read in which order, and for how long (same on every rank)."""

    KEYWORD: ClassVar[str] = "order"

    seed: int = option(0, "all randomness derives from (seed, epoch, rank, worker)", low=-(1 << 63))
    shuffle: bool = option(True, "shuffle the plan each epoch (False: index order and no sample shuffle)")
    shuffle_buffer: int | None = option(
        None,
        "items per shuffle block; 0 keeps the plan's order",
        low=0,
        shown="10,000 documents, or ~4M tokens of rows",
    )
    epochs: int | None = option(1, "None streams forever, epoch after epoch, each pass reshuffled", low=1)
    resample: bool = option(False, "draw whole shards with replacement, forever")
    steps_per_epoch: int | None = option(None, "batches per `for` loop; the stream continues across loops", low=1)
    equal_batches: bool | None = option(
        None, "every rank yields the same number of batches per epoch", shown="world_size > 1"
    )
    uneven: str = option(
        "drop",
        'equal batches: "drop" the batches beyond the smallest rank\'s count (a warning counts them), or '
        '"repeat" readable items of the shorter ranks up to the largest rank\'s count',
        choices=UNEVEN,
    )


@dataclass(frozen=True)
class BatchOptions(Options):
    """How items become batches, and what a batch carries."""

    KEYWORD: ClassVar[str] = "batch"

    batch_size: int | None = option(
        32, "items per batch: documents, or rows (packed data, pack and concat); None: see below", low=1
    )
    drop_last: bool = option(
        False, "drop the rank's final short batch (only a rank's last worker has one: docs/batching.md)"
    )
    batching: str = option("fixed", '"fixed", "bucket", "pack" or "concat": see batching.md')
    window: int = option(10_000, "bucket/pack: items per window", low=1)
    max_tokens: int | None = option(None, "bucket: padded tokens per batch instead of batch_size", low=1)
    seq_len: int | None = option(None, "pack/concat: row length", low=1)
    max_len: int | None = option(None, "longer documents are split into pieces or cut (max_len_mode)", low=1)
    max_len_mode: str = option("split", '"split" into pieces, nothing lost, or "truncate"', choices=MAX_LEN_MODES)
    pad_id: int | None = option(None, "padding value of input_ids", low=0, shown="tokenizer's pad, else EOS, else 0")
    pad_to_multiple_of: int | None = option(None, "round the padded length up", low=1)
    boundaries: bool = option(False, "packed rows: position_ids, cu_seqlens, max_seqlen, boundary labels")
    shift_labels: bool = option(
        False,
        "next-token labels: `shift_labels` (the token each position predicts, -100 where none) in place of `labels`;"
        " pack and concat read rows of seq_len + 1 tokens (a packed dataset's rows give its seq_len - 1 positions),"
        " so no row's last position loses its label",
    )
    max_segments: int | None = option(
        None, "documents per row that cu_seqlens is padded for", low=1, shown="the index's, else seq_len"
    )
    docs: bool = option(True, "batches carry `docs` (False: left out, packed batches come faster)")
    schedule: Schedule | None = option(  # noqa: RUF009
        None, "batch sizes (or token budgets) by step, samples or tokens, in multiples of batch_size: steering.md"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        from .batching import MODES  # the registry of modes: a new mode is accepted where it is added

        if self.batching not in MODES:
            raise ConfigError(f"batching must be one of {', '.join(map(repr, MODES))}, not {self.batching!r}")
        if isinstance(self.schedule, Mapping):  # plain data (a YAML or JSON file, a command line)
            object.__setattr__(self, "schedule", Schedule.from_json(self.schedule))
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            raise ConfigError(
                f"schedule must be a wdsllm.Schedule (e.g. Schedule(batch_size=[(0, 8), (1000, 16)])), "
                f"not {type(self.schedule).__name__}"
            )


@dataclass(frozen=True)
class WorkerOptions(Options):
    """DataLoader workers (``wdsllm.loader`` only)."""

    KEYWORD: ClassVar[str] = "workers"

    num_workers: int = option(0, "DataLoader worker processes (0: read in this process)", low=0)
    prefetch_factor: int | None = option(2, "bundles of batches each worker prepares ahead", low=1, agree=AGREE_NONE)
    persistent_workers: bool | None = option(
        None, "keep workers between epochs", shown="True where any shard is remote", agree=AGREE_NONE
    )
    pin_memory: bool = option(False, "batches in pinned memory (with CUDA)", agree=AGREE_NONE)
    multiprocessing_context: str | None = option(
        None, "how workers start, as in DataLoader (default: fork on Linux)", agree=AGREE_NONE
    )


@dataclass(frozen=True)
class ReadingOptions(Options):
    """How shards are read: retries, a local cache, bad shards, checks, the fetch process."""

    KEYWORD: ClassVar[str] = "reading"

    retry: RetryPolicy | None = option(  # noqa: RUF009
        None, "a storage.RetryPolicy for remote reads", shown="RetryPolicy()", agree=AGREE_NONE
    )
    cache_dir: str | None = option(None, "keep remote shards and side files here (see remote.md)", agree=AGREE_NONE)
    cache_size: int = option(64 << 30, "bytes the cache may hold", low=0, shown="64 GiB", agree=AGREE_NONE)
    on_error: str = option("raise", '"raise", or "skip" unreadable shards and bad documents (counted)')
    check_groups: bool = option(True, "check every group against its checksum (reliability.md)")
    fetch_process: bool | None = option(
        None,
        "a fetch process (a spawned interpreter, never a fork of this one) downloads remote shards so that"
        ' receiving does not take this process\'s GIL; stopped by `close()` (remote.md, "The fetch process")',
        shown="True with num_workers=0",
        agree=AGREE_NONE,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "on_error", normalize_on_error(self.on_error))


@dataclass(frozen=True)
class LayoutOptions(Options):
    """Where this process sits among the ranks: which data it reads, and which peers must yield the same batches
    (None everywhere: the rank of torch.distributed or RANK/WORLD_SIZE; docs/parallel.md)."""

    KEYWORD: ClassVar[str] = "layout"

    # A coordinate differs from rank to rank, and a mesh or group is compared by what it holds:
    # the layout's facts (``layout.Seat``) go into the description in their place.
    rank: int | None = option(None, "this process's data-parallel rank", low=0, agree=AGREE_NONE)
    world_size: int | None = option(None, "the number of data-parallel ranks", low=1, agree=AGREE_NONE)
    mesh: DeviceMesh | None = option(  # noqa: RUF009
        None, "a DeviceMesh: its `dp` dims split the data, the others replicate", agree=AGREE_NONE
    )
    dp: str | tuple[str, ...] | None = option(None, "the mesh's data-parallel dim names", shown="a 1-D mesh's dim")
    cp: str | None = option(None, "the mesh's context-parallel dim: each peer gets its slice of every row")
    pp: str | None = option(None, "the mesh's pipeline dim: the stage is the coordinate on it")
    dp_group: ProcessGroup | None = option(  # noqa: RUF009
        None, "without a mesh: the data-parallel group (Megatron style)", agree=AGREE_NONE
    )
    replica_group: ProcessGroup | None = option(  # noqa: RUF009
        None, "with dp_group: the peers that yield the same batches", agree=AGREE_NONE
    )
    cp_group: ProcessGroup | None = option(  # noqa: RUF009
        None, "with dp_group: the context-parallel group (rank: the slice)", agree=AGREE_NONE
    )
    pp_group: ProcessGroup | None = option(  # noqa: RUF009
        None, "with dp_group: the pipeline group (rank: the stage)", agree=AGREE_NONE
    )
    cp_rank: int | None = option(
        None, "without a mesh or groups: this process's context-parallel rank", low=0, agree=AGREE_NONE
    )
    cp_size: int | None = option(None, "without a mesh or groups: the context-parallel size", low=1)
    pp_stage: int | None = option(
        None, "without a mesh or groups: this process's pipeline stage", low=0, agree=AGREE_NONE
    )
    pp_stages: int | None = option(None, "without a mesh or groups: the number of pipeline stages", low=1)
    cp_split: str = option(
        "zigzag", '"zigzag" (2 x CP chunks, rank r takes r and 2CP-1-r) or "contiguous"', choices=CP_SPLITS
    )
    replicas: str = option(
        "read",
        '"read": every replica peer reads (pipeline middle stages follow the first); "broadcast": one reads, sends',
        choices=REPLICAS,
    )
    agree_every: int | None = option(
        None, "replica peers compare a digest of the batch every N steps too (always: an epoch's first batch)", low=1
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.rank is None) != (self.world_size is None):
            raise ConfigError("pass rank= and world_size= together")
        if self.rank is not None and self.rank >= self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        given = [
            name
            for name, on in (
                ("rank=", self.rank is not None),
                ("mesh=", self.mesh is not None),
                ("dp_group=", self.dp_group is not None),
            )
            if on
        ]
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)} both say where this process is: pass one")
        if self.mesh is None and any(v is not None for v in (self.dp, self.cp, self.pp)):
            raise ConfigError("dp=, cp= and pp= name dims of a DeviceMesh: pass mesh= as well")
        grouped = [n for n in ("replica_group", "cp_group", "pp_group") if getattr(self, n) is not None]
        if grouped and self.dp_group is None:
            raise ConfigError(f"{', '.join(grouped)} go with dp_group= (the data-parallel group)")

    @property
    def explicit(self) -> bool:
        """Whether the data-parallel coordinates were given (not looked up in torch.distributed)."""
        return self.rank is not None or self.mesh is not None or self.dp_group is not None


@dataclass(frozen=True)
class RawTextSource(Options, Mapping):
    """Raw text as a source, tokenized in the workers.

    ``wdsllm.loader(RawTextSource("data/*.jsonl", tokenizer="tok.json"), ...)``. Its fields are the
    keys of a mixture's raw source, and it is one (a mapping of the fields that are set), so it
    also goes into ``wdsllm.Mixture(sources=...)``."""

    KEYWORD: ClassVar[str] = ""

    raw: str | Sequence[str] | None = option(
        None, "input files, globs or URLs (txt, jsonl, Parquet, Arrow, raw-text tars)"
    )
    tokenizer: str | None = option(None, "a tokenizer.json, a directory, a hub name, or a loaded tokenizer")
    counts: str | None = option(None, "the count sidecar of `wdsllm count`: equal batches, exact resumes")
    text_field: str = option("text", "the field that holds the text (dotted names reach nested fields)")
    split: str = option("line", '"line", "paragraph" or "file" (for .txt)', choices=SPLITS)
    where: str | None = option(None, "keep only the documents this filter selects")
    bos: bool | None = option(None, "prepend BOS (None: pack's rule for the tokenizer)")
    eos: bool = option(True, "append EOS")
    bos_token: str | None = option(None, "the BOS token by name (default: the tokenizer's)")
    eos_token: str | None = option(None, "the EOS token by name (default: the tokenizer's)")
    max_doc_bytes: int = option(
        DEFAULT_MAX_DOC_BYTES, "longest document in bytes; longer is bad input", low=1, shown="16 MiB"
    )
    input_format: str | None = option(None, "the inputs' format when their names do not say it")
    unit_bytes: int | None = option(None, "input bytes per unit of work", low=1, shown="16 MiB")
    on_error: str | None = option(
        None, "bad documents and unreadable units: raise or skip", shown="the loader's on_error"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.raw is None:
            raise ConfigError("RawTextSource needs its inputs (raw=)")
        if self.on_error is not None:
            object.__setattr__(self, "on_error", normalize_on_error(self.on_error))

    def _set(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __getitem__(self, key: str) -> Any:
        return self._set()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())


@dataclass(frozen=True)
class ObserveOptions(Options):
    """What the loader measures of its own data path (``wdsllm.loader`` only; docs/observability.md)."""

    KEYWORD: ClassVar[str] = "observe"

    wait_window: int = option(
        100, "steps over which `metrics()` reports the data wait (p50, p95, max, share)", low=1, agree=AGREE_NONE
    )
    reduce_every: int | None = option(
        None, "every N steps, gather the data wait over the process group (a collective: every rank in step)", low=1
    )
    watchdog_s: float | None = option(
        300,
        "a `next()` waiting this many seconds logs every worker's stack (None: no watchdog)",
        above=0.0,
        agree=AGREE_NONE,
    )
    watchdog_raise: bool = option(False, "then raise `WorkerStalledError` instead of waiting on", agree=AGREE_NONE)


@dataclass(frozen=True)
class SteerOptions(Options):
    """Steering from a file an operator edits while the run trains (``wdsllm.loader`` only; docs/steering.md)."""

    KEYWORD: ClassVar[str] = "steer"

    steer_file: str | None = option(
        None,
        "a YAML file of weights, skip and exclude re-read every reload_every steps",
        shown="the mixture file the loader was built from",
    )
    reload_every: int | None = option(
        None, "every N planned steps, rank 0 re-reads steer_file and every rank takes what it says", low=1
    )
    steer_horizon: int = option(
        0,
        "set_weights and exclude take effect this many planned steps after the call; the re-plan is made "
        "meanwhile, in the background (0: at the next step, waiting for it)",
        low=0,
    )


#: the records a face takes, in the order the docs list them
FACE_RECORDS: tuple[type[Options], ...] = (
    OrderOptions,
    BatchOptions,
    WorkerOptions,
    ReadingOptions,
    LayoutOptions,
    ObserveOptions,
    SteerOptions,
)
#: raw-text fields that the faces still take as keywords (deprecated: pass a RawTextSource)
RAW_KEYWORDS = tuple(f.name for f in fields(RawTextSource) if f.name not in ("raw", "on_error"))


@dataclass(frozen=True)
class FaceOptions:
    """Every record a face was given, complete (defaults where nothing was said)."""

    order: OrderOptions
    batch: BatchOptions
    workers: WorkerOptions
    reading: ReadingOptions
    layout: LayoutOptions
    source: Any
    observe: ObserveOptions = field(default_factory=ObserveOptions)
    steer: SteerOptions = field(default_factory=SteerOptions)

    @property
    def explicit_world(self) -> bool:
        return self.layout.explicit


def _field_owner() -> dict[str, type[Options]]:
    return {f.name: record for record in FACE_RECORDS for f in fields(record)}


FIELD_OWNER = _field_owner()


def _unknown(name: str, allowed: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f"; did you mean {close[0]}=?" if close else " (see docs/loader.md)"
    return ConfigError(f"unknown option {name}={hint}")


def split_options(source: Any, records: dict[str, Any], keywords: dict[str, Any], *, face: str) -> FaceOptions:
    """The records of one call: each given whole (``records``: keyword -> record or None) or
    built from the plain keywords that name its fields; a field given both ways, or a keyword no
    record has, is refused. Raw-text keywords make ``source`` a :class:`RawTextSource` (deprecated)."""
    raw = {k: keywords.pop(k) for k in RAW_KEYWORDS if k in keywords}
    if raw:
        source = _raw_from_keywords(source, raw)
    by_record: dict[type[Options], dict[str, Any]] = {record: {} for record in FACE_RECORDS}
    for name, value in keywords.items():
        owner = FIELD_OWNER.get(name)
        if owner is None:
            raise _unknown(name, [*FIELD_OWNER, *(r.KEYWORD for r in FACE_RECORDS), *RAW_KEYWORDS])
        by_record[owner][name] = value
    built = {}
    for record in FACE_RECORDS:
        given, loose = records.get(record.KEYWORD), by_record[record]
        if given is not None and not isinstance(given, record):
            raise ConfigError(f"{face}({record.KEYWORD}=...) takes a {record.__name__}, not {type(given).__name__}")
        if given is not None and loose:
            raise ConfigError(f"{', '.join(loose)} given both as keywords and in {record.KEYWORD}=: pass one")
        built[record.KEYWORD] = given if given is not None else record(**loose)
    return FaceOptions(source=source, **built)


def _raw_from_keywords(source: Any, raw: dict[str, Any]) -> Any:
    """The raw-text keywords of a face as the source record they describe."""
    if raw.get("tokenizer") is None:
        defaults = {f.name: f.default for f in fields(RawTextSource)}
        given = [k for k, v in raw.items() if v != defaults[k]]
        if given:
            raise ConfigError(f"{', '.join(given)} apply to raw text sources: pass tokenizer= as well")
        return source
    warnings.warn(
        "raw-text keywords (tokenizer=, counts=, text_field=, ...) of wdsllm.loader/dataset are deprecated: pass "
        "wdsllm.RawTextSource(patterns, tokenizer=..., ...) as the source",
        DeprecationWarning,
        stacklevel=4,
    )
    return RawTextSource(raw=source, **raw)


def record_fields(record: type[Options]) -> list[tuple[str, str, str]]:
    """(name, default as the docs show it, doc) of each field of ``record``, in declaration order
    (a literal default in backticks, a described one as words)."""
    out = []
    for f in fields(record):  # type: ignore[arg-type]
        shown = f.metadata.get("shown")
        if shown is None:
            number = isinstance(f.default, int) and not isinstance(f.default, bool)
            shown = "`" + (f"{f.default:,}" if number else repr(f.default).replace("'", '"')) + "`"
        out.append((f.name, shown, f.metadata.get("doc", "")))
    return out


def markdown_table(record: type[Options]) -> str:
    """The docs' table of ``record`` (docs/loader.md holds each one verbatim; a test checks)."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {shown} | {doc} |" for name, shown, doc in record_fields(record)]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m wdsllm.load.options: the tables for docs/loader.md
    for face_record in (*FACE_RECORDS, RawTextSource):
        print(f"`{face_record.__name__}`: {face_record.__doc__.splitlines()[0]}\n")
        print(markdown_table(face_record) + "\n")


__all__ = [
    "BatchOptions",
    "FaceOptions",
    "LayoutOptions",
    "OrderOptions",
    "RawTextSource",
    "ReadingOptions",
    "WorkerOptions",
    "split_options",
]
