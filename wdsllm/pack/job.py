"""The pack job: inputs -> tokenizer worker processes -> shaping -> shards + index.json.

The packing process reads and decompresses inputs in chunks that end on document boundaries and
keeps a bounded number of them in flight in a pool of worker processes, which parse and encode
them. Results come back in submission order, so the output depends only on the inputs and the
options, never on the worker count or timing. Memory is bounded by the chunks in flight and one
open group, whatever the corpus size.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import multiprocessing as mp
import os
import re
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from .. import __version__, storage
from .. import format as fmt
from ..errors import PackError, normalize_on_error
from ..inputs.registry import reader_for
from ..inputs.sources import (
    DEFAULT_MAX_DOC_BYTES,
    SPLITS,
    STDIN,
    InputFile,
    ParseOptions,
    Part,
    expand_inputs,
)
from ..inputs.tasks import assign_tasks
from ..inputs.tokenizer import resolve_specials
from ..inputs.where import parse_where
from .lock import OutputLock
from .shaping import DocGrouper, EncodedChunk, Position, RowPacker
from .sidefiles import SideFiles
from .tokenizer import LoadedTokenizer, encode_chunk, init_worker, load_tokenizer
from .writer import JOURNAL_PREFIX, JOURNAL_START, Counters, ShardSink, iter_journal, read_journal, records_truncated

log = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 128 * 1024 * 1024
DEFAULT_SAMPLE_TOKENS = 256 * 1024
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclass
class PackConfig:
    """Everything a pack job needs; the fields mirror the options of `wdsllm pack`."""

    inputs: list[str]
    output: str
    tokenizer: str
    mode: str = "docs"
    seq_len: int | None = None
    max_doc_tokens: int | None = None
    split: str = "line"
    text_field: str = "text"
    input_format: str | None = None
    bos: bool | None = None  # None: follow the tokenizer's post-processor
    eos: bool = True
    bos_token: str | None = None
    eos_token: str | None = None
    shard_size: int = DEFAULT_SHARD_SIZE
    shard_samples: int | None = None
    sample_tokens: int = DEFAULT_SAMPLE_TOKENS
    prefix: str = "shard"
    on_error: str = "raise"  # bad input: "raise" a SourceError, or "skip" it (counted and listed)
    where: str | None = None  # keep only the documents this --where expression holds for
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES  # a longer document is bad input (too_long)
    dtype: str | None = None  # token dtype: "uint16" or "uint32"; None: the smallest that holds the vocabulary
    num_tasks: int = 1
    task_index: int = 0
    # how the job runs; none of these change the output
    workers: int = 0
    overwrite: bool = False
    resume: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    RUNTIME_ONLY = ("workers", "overwrite", "resume", "chunk_bytes", "output")

    def __post_init__(self) -> None:
        self.on_error = normalize_on_error(self.on_error)

    def parse_options(self) -> ParseOptions:
        """What readers and the tokenizer workers need to know of the options."""
        return ParseOptions(
            split=self.split,
            text_field=self.text_field,
            on_error=self.on_error,
            where=parse_where(self.where),
            max_doc_bytes=self.max_doc_bytes,
        )

    def output_options(self) -> dict:
        """The options that determine the output bytes (stored in the index; URLs without their
        secrets, so a rotated token or SAS does not stop a --resume either)."""
        d = asdict(self)
        for k in self.RUNTIME_ONLY:
            d.pop(k, None)
        if d.get("dtype") is None:  # the default: absent, as in the indexes written before the option
            d.pop("dtype", None)
        d["inputs"] = [storage.redact(i) for i in d.get("inputs", [])]
        if isinstance(d.get("output"), str):
            d["output"] = storage.redact(d["output"])
        return d


@dataclass
class PackProgress:
    documents: int = 0
    tokens: int = 0
    shards: int = 0
    skipped: int = 0
    input_bytes: int = 0  # compressed bytes of input consumed
    input_total: int = 0
    text_bytes: int = 0
    elapsed: float = 0.0
    done: bool = False
    resumed_documents: int = 0  # of documents and tokens, those a resumed pack found already written
    resumed_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Tokens packed per second by this run (a resume's kept shards are not this run's work)."""
        return (self.tokens - self.resumed_tokens) / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def documents_per_s(self) -> float:
        return (self.documents - self.resumed_documents) / self.elapsed if self.elapsed > 0 else 0.0


@dataclass
class PackResult:
    index: fmt.Index
    output: str
    progress: PackProgress
    skipped: dict = field(default_factory=dict)
    resumed_shards: int = 0


# ----------------------------------------------------------------------------------------------
# Task partitioning (--num-tasks / --task-index).


def task_from_env(env: Mapping[str, str] = os.environ) -> tuple[int, int, str | None]:
    """(num_tasks, task_index, where from): a SLURM job array, or torchrun; (1, 0, None) otherwise.

    A plain SLURM job step (SLURM_NTASKS/SLURM_PROCID) is deliberately not used: those are also set
    in a batch script that runs one pack, which would then silently pack a fraction of the input.
    """
    try:
        if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
            first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
            step = int(env.get("SLURM_ARRAY_TASK_STEP", "1") or 1)
            task = (int(env["SLURM_ARRAY_TASK_ID"]) - first) // step
            return int(env["SLURM_ARRAY_TASK_COUNT"]), task, "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT"
        if "WORLD_SIZE" in env and "RANK" in env:
            return int(env["WORLD_SIZE"]), int(env["RANK"]), "RANK/WORLD_SIZE (torchrun)"
    except ValueError as exc:
        raise PackError(f"cannot read the task from the environment: {exc}") from None
    return 1, 0, None


def task_output(output: str, num_tasks: int, task_index: int) -> str:
    return storage.join_url(output, f"task-{task_index:05d}") if num_tasks > 1 else output


# ----------------------------------------------------------------------------------------------
# The job.


def _fingerprint(cfg: PackConfig, parts: list[Part], tok_sha: str) -> str:
    ident = {
        "options": cfg.output_options(),
        "tokenizer": tok_sha,
        "inputs": [
            (p.input.path, p.input.size, _version(p.input)) + ((p.unit, p.start, p.stop) if not p.whole else ())
            for p in parts
        ],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _version(inp: InputFile) -> float | str:
    """What says that an input changed since an interrupted pack: a remote object's version
    (ETag, generation, commit), a local file's mtime."""
    if inp.path == "-":
        return 0
    return inp.version if inp.version or "://" in inp.path else os.path.getmtime(inp.path)


#: the token dtypes a pack writes (--dtype): a wider one than the vocabulary needs leaves room for its growth
TOKEN_DTYPES = ("uint16", "uint32")


def token_dtype_for(cfg: PackConfig, tok: LoadedTokenizer) -> np.dtype:
    """The dtype of the tokens written: ``cfg.dtype``, or the smallest that holds the vocabulary;
    one too narrow for the vocabulary is refused."""
    if cfg.dtype is None:
        return tok.dtype
    dtype = np.dtype(cfg.dtype)
    if dtype.itemsize < tok.dtype.itemsize:
        raise PackError(f"--dtype {cfg.dtype} cannot hold the ids of {tok.source} (vocabulary {tok.vocab_size:,})")
    return dtype


_PREFIX_RE = re.compile(r"^[A-Za-z0-9_]+(?:[A-Za-z0-9_-]*[A-Za-z0-9_])?$")


def _validate(cfg: PackConfig) -> None:
    if cfg.mode not in fmt.MODES:
        raise PackError(f"--mode must be one of {fmt.MODES}")
    if cfg.mode == "packed" and not cfg.seq_len:
        raise PackError("--mode packed needs --seq-len N")
    if cfg.mode == "docs" and cfg.seq_len:
        raise PackError("--seq-len applies to --mode packed only (the loader sets lengths for docs mode)")
    if cfg.seq_len is not None and cfg.seq_len < 1:
        raise PackError("--seq-len must be positive")
    if cfg.max_doc_tokens is not None and cfg.max_doc_tokens < 1:
        raise PackError("--max-doc-tokens must be positive")
    if cfg.mode == "packed" and cfg.max_doc_tokens:
        raise PackError("--max-doc-tokens applies to --mode docs only (packed rows already cut documents)")
    if cfg.num_tasks < 1:
        raise PackError("--num-tasks must be at least 1")
    if not (0 <= cfg.task_index < cfg.num_tasks):
        raise PackError(f"--task-index {cfg.task_index} is outside 0..{cfg.num_tasks - 1}")
    if cfg.split not in SPLITS:
        raise PackError(f"--split must be one of {SPLITS}")
    if cfg.dtype is not None and cfg.dtype not in TOKEN_DTYPES:
        raise PackError(f"--dtype must be one of {TOKEN_DTYPES}, not {cfg.dtype!r}")
    if cfg.shard_size < 4096:
        raise PackError("--shard-size must be at least 4096 bytes")
    if cfg.shard_samples is not None and cfg.shard_samples < 1:
        raise PackError("--shard-samples must be positive")
    if cfg.sample_tokens < 1:
        raise PackError("--sample-tokens must be positive")
    if cfg.workers < 0:
        raise PackError("--workers must be 0 (all cores) or more")
    if not _PREFIX_RE.match(cfg.prefix):
        raise PackError(f"--prefix {cfg.prefix!r}: use letters, digits, '_' and inner '-' only")
    if cfg.resume and cfg.overwrite:
        raise PackError("--resume and --overwrite contradict each other: pick one")
    if cfg.max_doc_bytes < 1:
        raise PackError("--max-doc-bytes must be positive")
    cfg.parse_options()  # a --where that does not parse is refused here, before any work


def _resolve_specials(cfg: PackConfig, tok: LoadedTokenizer) -> tuple[bool, int | None, int | None]:
    """(use_bos, bos_id, eos_id) to add, from the options and what the tokenizer defines."""
    return resolve_specials(tok, cfg.bos, cfg.eos, cfg.tokenizer, PackError)


def _task_inputs(cfg: PackConfig) -> tuple[list[InputFile], list[Part]]:
    """(every input of the job, this task's parts of them)."""
    all_inputs = _outside_output(expand_inputs(cfg.inputs, cfg.input_format), cfg.output)
    if cfg.num_tasks > 1 and any(i.path == STDIN for i in all_inputs):
        raise PackError("stdin cannot be split between tasks; pack it with --num-tasks 1")
    if cfg.where and any(i.kind == "txt" for i in all_inputs):
        txt = next(i for i in all_inputs if i.kind == "txt")
        raise PackError(f"--where reads fields, and {txt.display} is plain text: use JSON lines, Parquet, Arrow, tars")
    if cfg.num_tasks > 1:
        parts = assign_tasks(all_inputs, cfg.num_tasks, cfg.parse_options())[cfg.task_index]
    else:
        parts = [Part(i, size=i.size) for i in all_inputs]
    if cfg.resume and any(p.input.path == STDIN for p in parts):
        raise PackError("--resume cannot re-read stdin; pack from files to be able to resume")
    return all_inputs, parts


def _outside_output(inputs: list[InputFile], output: str) -> list[InputFile]:
    """Drop files inside the output directory (``pack corpus/ -o corpus/packed`` run twice would
    otherwise read its own index.json as input), keeping the indexes of the others stable."""
    if storage.is_remote(output) or output.startswith("file://"):
        return inputs
    root = os.path.realpath(output) + os.sep
    kept = [i for i in inputs if i.path == STDIN or "://" in i.path or not os.path.realpath(i.path).startswith(root)]
    if len(kept) != len(inputs):
        log.warning("ignoring %d input files inside the output directory %s", len(inputs) - len(kept), output)
        kept = [replace(i, index=n) for n, i in enumerate(kept)]
    return kept


def _prepare_output(out: storage.Output, cfg: PackConfig, fingerprint: str) -> list[dict]:
    """Check or clear the output; return the journal records of an interrupted pack (--resume)."""
    records: list[dict] = []
    if cfg.resume:
        started = out.get_bytes(JOURNAL_START)
        if started is None:
            if out.get_bytes(fmt.INDEX_NAME) is not None:
                raise PackError(f"{out.url} is already complete (index.json exists); nothing to resume")
            if not out.is_empty():
                raise PackError(f"{out.url} holds no interrupted pack to resume (no {JOURNAL_START})")
        else:
            if json.loads(started)["fingerprint"] != fingerprint:
                raise PackError(
                    f"{out.url}: the inputs, tokenizer or options differ from the interrupted pack; "
                    "resume with the same command, or start again with --overwrite"
                )
            records = _present_records(out, read_journal(out, lengths=False))
            if any(len(row) != fmt.GROUP_COLUMNS for rec in records for row in rec.get("groups", [[]])):
                raise PackError(
                    f"{out.url}: the interrupted pack was started by an older wdsllm (format 2 journal); "
                    "finish it with that version, or start again with --overwrite"
                )
            _remove_unrecorded(out, cfg.prefix, len(records))
    elif not out.is_empty():
        if not cfg.overwrite:
            raise PackError(f"output {out.url} is not empty; pass --overwrite to replace it or --resume to finish it")
        out.clear()
    if not records:
        out.put_bytes(
            JOURNAL_START, json.dumps({"fingerprint": fingerprint, "created_by": f"wdsllm {__version__}"}).encode()
        )
    return records


def _present_records(out: storage.Output, records: list[dict]) -> list[dict]:
    """Journal records up to the first whose shard is missing (a shard deleted by hand is rewritten)."""
    names = set(out.list_names())
    for i, rec in enumerate(records):
        if rec["entry"]["name"] not in names:
            log.warning("%s is missing; resuming from the shard before it", rec["entry"]["name"])
            return records[:i]
    return records


def _remove_unrecorded(out, prefix: str, recorded: int) -> None:
    """Delete temporary files and any shard past the journal: they are rewritten identically."""
    for name in out.list_names():
        if name.endswith(".tmp"):
            out.delete(name)
            continue
        if name.startswith(JOURNAL_PREFIX + "shard-"):
            number = int(name[len(JOURNAL_PREFIX) + 6 : len(JOURNAL_PREFIX) + 12])
            if number >= recorded:
                out.delete(name)
            continue
        m = fmt.SHARD_RE.match(name)
        if m and m.group("prefix") == prefix and int(m.group("number")) >= recorded:
            out.delete(name)


def _make_shaper(cfg: PackConfig, dtype: np.dtype, position: Position | None):
    if cfg.mode == "packed":
        rows = max(1, cfg.sample_tokens // cfg.seq_len)
        if cfg.shard_samples:
            rows = min(rows, cfg.shard_samples)
        return RowPacker(cfg.seq_len, rows, dtype, resume=position)
    return DocGrouper(cfg.sample_tokens, cfg.max_doc_tokens, dtype, resume=position, max_items=cfg.shard_samples)


def _chunk_jobs(parts: list[Part], cfg: PackConfig, position: Position | None) -> Iterator[tuple]:
    """(chunk, display) for every chunk still to pack, in input order."""
    opts = cfg.parse_options()
    for part in parts:
        inp = part.input
        if position is not None and inp.index < position.file:
            continue
        start_line = position.line if position is not None and inp.index == position.file else 1
        for chunk in reader_for(inp.kind).chunks(part, opts, cfg.chunk_bytes, start_line):
            yield chunk, inp.display


def _encoded_in_order(pool: ProcessPoolExecutor, jobs: Iterator[tuple], limit: int) -> Iterator[EncodedChunk]:
    """Results in submission order with at most ``limit`` chunks in flight.

    Reading the next chunk happens while the workers encode the ones before it, and the order of
    results (so the output) never depends on which worker was faster. The pipeline is kept full
    across input files: small files must not drain it one by one.
    """
    pending: deque = deque()
    try:
        for job in jobs:
            pending.append(pool.submit(encode_chunk, *job))
            if len(pending) >= limit:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def _start_pool(
    workers: int, cpus: int, tok: LoadedTokenizer, dtype: np.dtype, bos_id, eos_id, cfg: PackConfig, tmpdir: str
) -> ProcessPoolExecutor:
    """A spawn pool of tokenizer workers; the tokenizer travels as a file, not inside the spawn
    handshake, so that starting a worker does not block this process while it imports."""
    tok_path = os.path.join(tmpdir, "tokenizer.json")
    with open(tok_path, "w", encoding="utf-8") as f:
        f.write(tok.json_text)
    parse_opts = cfg.parse_options()
    threads = max(1, cpus // workers)
    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=mp.get_context("spawn"),
        initializer=init_worker,
        initargs=(tok_path, dtype.name, bos_id, eos_id, parse_opts, threads, os.getpid()),
    )


def pack(cfg: PackConfig, on_progress: Callable[[PackProgress], None] | None = None) -> PackResult:
    """Run a pack job (or one task of it) and return the written index.

    Workers are spawned processes: a script that calls this must guard its entry point with
    ``if __name__ == "__main__":`` (and cannot be read from stdin), as for any spawn pool.
    ``on_progress`` is called about twice a second, and once more at the end.
    """
    _validate(cfg)
    start_time = time.monotonic()
    tok = load_tokenizer(cfg.tokenizer, bos_token=cfg.bos_token, eos_token=cfg.eos_token)
    use_bos, bos_id, eos_id = _resolve_specials(cfg, tok)
    all_inputs, parts = _task_inputs(cfg)
    out = storage.Output(task_output(cfg.output, cfg.num_tasks, cfg.task_index))
    with OutputLock(out, "pack") as lock:
        try:
            return _pack_into(out, lock, cfg, tok, use_bos, bos_id, eos_id, all_inputs, parts, start_time, on_progress)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise PackError(
                f"no space left on the device writing {exc.filename or out.url}: free some space, then run the "
                "same `wdsllm pack` command with --resume to continue where it stopped"
            ) from exc


def _pack_into(
    out: storage.Output,
    lock: OutputLock,
    cfg: PackConfig,
    tok: LoadedTokenizer,
    use_bos: bool,
    bos_id: int | None,
    eos_id: int | None,
    all_inputs: list[InputFile],
    parts: list[Part],
    start_time: float,
    on_progress: Callable[[PackProgress], None] | None,
) -> PackResult:
    records = _prepare_output(out, cfg, _fingerprint(cfg, parts, tok.sha256))
    position = Position.from_json(records[-1]["position"]) if records and records[-1]["position"] else None
    if records:
        log.info("resuming after %d finished shards at input %s", len(records), position)
    dtype = token_dtype_for(cfg, tok)
    sink = _resumed_sink(out, cfg, records, all_inputs)
    run = _ChunkConsumer(
        sink=sink,
        shaper=_make_shaper(cfg, dtype, position),
        lock=lock,
        position=position,
        progress=_resumed_progress(sink.entries, records, parts),
        bytes_before=_bytes_before(parts),
        start_time=start_time,
        on_progress=on_progress,
    )
    cpus = os.cpu_count() or 1
    workers = cfg.workers or cpus
    try:
        with tempfile.TemporaryDirectory(prefix="wdsllm-pack-") as tmpdir:
            pool = _start_pool(workers, cpus, tok, dtype, bos_id, eos_id, cfg, tmpdir)
            _encode_all(pool, _chunk_jobs(parts, cfg, position), 2 * workers + 1, run)
        run.write_groups(run.shaper.finish())
        sink.finish_shard(final=True)
    except BaseException:
        sink.abort()
        raise

    options = {**cfg.output_options(), "bos": use_bos, "eos": eos_id is not None}
    index = write_index(out, cfg, tok, options, lambda totals: [_input_entry(p, totals) for p in parts], sink)
    progress = run.finish()
    return PackResult(
        index=index, output=out.url, progress=progress, skipped=index.skipped, resumed_shards=len(records)
    )


def _resumed_sink(out: storage.Output, cfg: PackConfig, records: list[dict], all_inputs: list[InputFile]) -> ShardSink:
    """A sink that continues after the finished shards in ``records`` (none for a fresh pack)."""
    sink = ShardSink(
        out,
        prefix=cfg.prefix,
        task=cfg.task_index,
        mode=cfg.mode,
        shard_size=cfg.shard_size,
        shard_samples=cfg.shard_samples,
        first_shard=len(records),
        first_group=records[-1]["next_group"] if records else 0,
        inputs_display={i.index: i.display for i in all_inputs},
        seq_len=cfg.seq_len,
    )
    sink.entries = [fmt.ShardEntry(**rec["entry"]) for rec in records]
    if records:  # running tallies, as of the last finished shard
        sink.max_row_segments = records[-1].get("max_row_segments", 0)
        sink.short_rows = records[-1].get("short_rows", 0)
    return sink


def _resumed_progress(entries: list[fmt.ShardEntry], records: list[dict], parts: list[Part]) -> PackProgress:
    """Progress that starts from the finished shards' totals."""
    progress = PackProgress(
        documents=sum(e.documents for e in entries),
        tokens=sum(e.tokens for e in entries),
        shards=len(entries),
        skipped=sum(sum(rec["counters"]["skipped"].values()) for rec in records),
        input_total=sum(p.size for p in parts),
    )
    progress.resumed_documents, progress.resumed_tokens = progress.documents, progress.tokens
    return progress


def _bytes_before(parts: list[Part]) -> dict[int, int]:
    """Input index -> the bytes of this task's parts before it, for the input fraction read."""
    before = {}
    running = 0
    for part in parts:
        before[part.input.index] = running
        running += part.size
    return before


def _encode_all(pool: ProcessPoolExecutor, jobs, in_flight: int, run: _ChunkConsumer) -> None:
    """Encode every chunk job in ``pool`` and hand each result, in order, to ``run``."""
    try:
        for chunk in _encoded_in_order(pool, jobs, in_flight):
            run.consume(chunk)
    except BrokenProcessPool as exc:
        raise PackError(
            f"a tokenizer worker died ({exc}); see its error above. Out of memory? Use fewer --workers, then --resume"
        ) from exc
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class _ChunkConsumer:
    """Takes encoded chunks in input order into the shaper and the sink, keeping ``progress``."""

    sink: ShardSink
    shaper: DocGrouper | RowPacker
    lock: OutputLock
    position: Position | None
    progress: PackProgress
    bytes_before: dict[int, int]
    start_time: float
    on_progress: Callable[[PackProgress], None] | None
    last_report: float = 0.0

    def write_groups(self, groups) -> None:
        for group in groups:
            self.sink.write(group)

    def consume(self, chunk: EncodedChunk) -> None:
        position, progress, sink = self.position, self.progress, self.sink
        skips, tallies = chunk.skips, chunk.tallies
        if position is not None and chunk.file_index == position.file:  # counted before the interruption
            skips = [s for s in skips if s.line > position.line]
            tallies = {reason: lines[lines > position.line] for reason, lines in tallies.items()}
        sink.add_skips(skips, [(chunk.file_index, reason, lines) for reason, lines in tallies.items()])
        progress.skipped += sum(s.count for s in skips) + sum(len(lines) for lines in tallies.values())
        # counted as read, so that the documents keep pace with the input fraction (the shaper holds
        # a group's worth before it writes); the written totals replace these at the end
        taken = _taken_documents(chunk, position)
        progress.documents += int(taken.sum())
        progress.tokens += int(chunk.lengths[taken].sum())
        self.write_groups(self.shaper.feed(chunk))
        if len(sink.entries) != progress.shards:
            self.lock.refresh()
        progress.shards = len(sink.entries)
        progress.input_bytes = self.bytes_before[chunk.file_index] + chunk.raw_offset
        progress.text_bytes += chunk.text_bytes
        now = time.monotonic()
        if self.on_progress and now - self.last_report > 0.5:
            self.last_report = now
            progress.elapsed = now - self.start_time
            self.on_progress(progress)

    def finish(self) -> PackProgress:
        """The final progress, from the written shards, reported once more."""
        progress, entries = self.progress, self.sink.entries
        progress.shards = len(entries)
        progress.documents = sum(e.documents for e in entries)
        progress.tokens = sum(e.tokens for e in entries)
        progress.elapsed = time.monotonic() - self.start_time
        progress.input_bytes = progress.input_total
        progress.done = True
        if self.on_progress:
            self.on_progress(progress)
        return progress


def _taken_documents(chunk: EncodedChunk, position: Position | None) -> np.ndarray:
    """Which documents of a chunk this run packs: a resumed pack's chunk at its position holds
    documents that are already in kept shards."""
    if position is None or chunk.file_index > position.file:
        return np.ones(len(chunk.lengths), bool)
    if chunk.file_index < position.file:
        return np.zeros(len(chunk.lengths), bool)
    return chunk.lines > position.line


def _input_entry(part: Part, totals: Counters) -> dict:
    i = part.input
    entry = {
        "index": i.index,
        "path": i.display,
        "bytes": i.size,
        "documents": totals.documents_by_input.get(i.index, 0),
        "skipped": totals.skipped_by_input.get(i.index, 0),
    }
    if not part.whole:  # this task's share of the file (a multi-task pack)
        entry["part"] = part.to_json()
    return entry


def write_index(
    out: storage.Output,
    cfg: PackConfig,
    tok: LoadedTokenizer,
    options: dict,
    inputs_of: Callable[[Counters], list],
    sink: ShardSink,
) -> fmt.Index:
    """lengths.npy, groups.npy, tokenizer.json, then index.json (last: its presence means complete),
    then drop the journal; for a pack and for a part alike. ``options``: the index's options;
    ``inputs_of(totals)``: its inputs table from the journal's tallies."""
    entries = sink.entries
    totals = Counters()  # the journal holds every finished shard's tallies, this run's included
    documents, groups = sum(e.documents for e in entries), sum(e.samples for e in entries)
    with SideFiles(out, documents, groups) as sides:
        read = 0
        for rec in iter_journal(out):
            totals.add_json(rec["counters"])
            sides.add_lengths(rec["lengths"])
            sides.add_groups(rec.get("groups"))
            read += 1
        if read != len(entries):
            raise PackError(f"{out.url}: the journal lists {read} finished shards, this pack wrote {len(entries)}")
        lengths_file, groups_file = sides.put()
    totals.add_json(sink.leftover_counters().to_json())
    # the dataset carries its tokenizer: the exact text whose sha256 the index holds
    tokenizer_bytes = tok.json_text.encode("utf-8")
    out.put_bytes(fmt.TOKENIZER_NAME, tokenizer_bytes)
    index = fmt.Index(
        mode=cfg.mode,
        dtype=token_dtype_for(cfg, tok).name,
        seq_len=cfg.seq_len,
        tokenizer=tok.info(),
        shards=list(entries),
        doc_lengths=sides.summary.to_json(),
        options=options,
        inputs=inputs_of(totals),
        skipped={
            "counts": dict(sorted(totals.skipped.items())),
            "total": sum(totals.skipped.values()),
            "records": totals.skip_records,
            "records_truncated": records_truncated(totals.skipped, totals.skip_records),
        },
        lengths_file=lengths_file,
        packed={"max_row_segments": sink.max_row_segments, "short_rows": sink.short_rows}
        if cfg.mode == "packed"
        else None,
        groups_file=groups_file,
        tokenizer_file=fmt.SideFile.of(fmt.TOKENIZER_NAME, tokenizer_bytes),
        created_by=f"wdsllm {__version__}",
    )
    for name, data in index.move_shard_table():  # a large dataset's shard table: shards.npy
        out.put_bytes(name, data)
    out.put_bytes(fmt.INDEX_NAME, index.to_json().encode())
    # JOURNAL_START sorts after the shard records: it goes last, so a crash here still resumes.
    for name in out.list_names():
        if name.startswith(JOURNAL_PREFIX):
            out.delete(name)
    return index
