"""The pack job: inputs -> tokenizer worker processes -> shaping -> shards + index.json.

The packing process reads and decompresses inputs in chunks that end on document boundaries and
keeps a bounded number of them in flight in a pool of worker processes, which parse and encode
them. Results come back in submission order, so the output depends only on the inputs and the
options, never on the worker count or timing. Memory is bounded by the chunks in flight and one
open group, whatever the corpus size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from . import __version__
from . import format as fmt
from . import storage
from .shaping import DocGrouper, EncodedChunk, Position, RowPacker
from .sources import InputFile, RawChunk, expand_inputs, parse_chunk, read_chunks
from .tokenize import Encoder, load_tokenizer
from .writer import JOURNAL_PREFIX, JOURNAL_START, Counters, ShardSink, journal_lengths_name, read_journal

log = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 128 * 1024 * 1024
DEFAULT_SAMPLE_TOKENS = 256 * 1024
DEFAULT_CHUNK_BYTES = 1 << 20


class PackError(RuntimeError):
    """The pack cannot start or continue; the message says why and what to do."""


@dataclass
class PackConfig:
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
    on_error: str = "stop"
    num_tasks: int = 1
    task_index: int = 0
    # how the job runs; none of these change the output
    workers: int = 0
    overwrite: bool = False
    resume: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    RUNTIME_ONLY = ("workers", "overwrite", "resume", "chunk_bytes", "output")

    def output_options(self) -> dict:
        """The options that determine the output bytes (stored in the index)."""
        d = asdict(self)
        for k in self.RUNTIME_ONLY:
            d.pop(k, None)
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


@dataclass
class PackResult:
    index: fmt.Index
    output: str
    progress: PackProgress
    skipped: dict = field(default_factory=dict)
    resumed_shards: int = 0


# ----------------------------------------------------------------------------------------------
# Worker side.

_worker: dict = {}


def _init_worker(json_text: str, dtype: str, bos_id, eos_id, parse_opts: dict, threads: int) -> None:
    if threads <= 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    _worker["encoder"] = Encoder(json_text, dtype, bos_id, eos_id)
    _worker["parse"] = parse_opts


def _encode_chunk(chunk: RawChunk, kind: str, display: str) -> EncodedChunk:
    opts = _worker["parse"]
    parsed = parse_chunk(chunk, kind=kind, split=opts["split"], text_field=opts["text_field"], on_error=opts["on_error"], display=display)
    tokens, lengths = _worker["encoder"].encode(parsed.texts)
    return EncodedChunk(
        file_index=chunk.file_index,
        first_line=chunk.first_line,
        tokens=tokens,
        lengths=lengths,
        lines=np.asarray(parsed.lines, dtype=np.int64),
        skips=parsed.skips,
        raw_offset=chunk.raw_offset,
        text_bytes=len(chunk.data),
    )


# ----------------------------------------------------------------------------------------------
# Task partitioning (--num-tasks / --task-index).


def task_from_env(env=os.environ) -> tuple[int, int]:
    """(num_tasks, task_index) from a SLURM array, SLURM tasks, or torchrun; (1, 0) otherwise."""
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        return int(env["SLURM_ARRAY_TASK_COUNT"]), int(env["SLURM_ARRAY_TASK_ID"]) - first
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        return int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
    if "WORLD_SIZE" in env and "RANK" in env:
        return int(env["WORLD_SIZE"]), int(env["RANK"])
    return 1, 0


def assign_tasks(inputs: list[InputFile], num_tasks: int) -> list[list[InputFile]]:
    """Split inputs into disjoint parts balanced by size (largest first), each kept in input order."""
    loads = [0] * num_tasks
    parts: list[list[InputFile]] = [[] for _ in range(num_tasks)]
    for inp in sorted(inputs, key=lambda i: (-i.size, i.index)):
        task = min(range(num_tasks), key=lambda t: (loads[t], t))
        loads[task] += max(1, inp.size)
        parts[task].append(inp)
    return [sorted(p, key=lambda i: i.index) for p in parts]


def task_output(output: str, num_tasks: int, task_index: int) -> str:
    return storage.join_url(output, f"task-{task_index:05d}") if num_tasks > 1 else output


# ----------------------------------------------------------------------------------------------
# The job.


def _fingerprint(cfg: PackConfig, inputs: list[InputFile], tok_sha: str) -> str:
    ident = {
        "options": cfg.output_options(),
        "tokenizer": tok_sha,
        "inputs": [(i.path, i.size, os.path.getmtime(i.path) if i.path != "-" else 0) for i in inputs],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _validate(cfg: PackConfig) -> None:
    if cfg.mode not in fmt.MODES:
        raise PackError(f"--mode must be one of {fmt.MODES}")
    if cfg.mode == "packed" and not cfg.seq_len:
        raise PackError("--mode packed needs --seq-len N")
    if cfg.mode == "docs" and cfg.seq_len:
        raise PackError("--seq-len applies to --mode packed only (the loader sets lengths for docs mode)")
    if cfg.max_doc_tokens is not None and cfg.max_doc_tokens < 1:
        raise PackError("--max-doc-tokens must be positive")
    if not (0 <= cfg.task_index < cfg.num_tasks):
        raise PackError(f"--task-index {cfg.task_index} is outside 0..{cfg.num_tasks - 1}")
    if cfg.on_error not in ("stop", "skip"):
        raise PackError("--on-error must be stop or skip")
    if cfg.shard_size < 4096:
        raise PackError("--shard-size must be at least 4096 bytes")


def pack(cfg: PackConfig, on_progress: Callable[[PackProgress], None] | None = None) -> PackResult:
    """Run a pack job (or one task of it) and return the written index."""
    _validate(cfg)
    start_time = time.monotonic()
    tok = load_tokenizer(cfg.tokenizer, bos_token=cfg.bos_token, eos_token=cfg.eos_token)
    use_bos = tok.adds_bos if cfg.bos is None else cfg.bos
    if use_bos and tok.bos_id is None:
        raise PackError(f"tokenizer {cfg.tokenizer} has no BOS token; pass --bos-token TEXT or --no-bos")
    if cfg.eos and tok.eos_id is None:
        raise PackError(f"tokenizer {cfg.tokenizer} has no EOS token; pass --eos-token TEXT or --no-eos")
    bos_id = tok.bos_id if use_bos else None
    eos_id = tok.eos_id if cfg.eos else None

    all_inputs = expand_inputs(cfg.inputs, cfg.input_format)
    inputs = assign_tasks(all_inputs, cfg.num_tasks)[cfg.task_index] if cfg.num_tasks > 1 else all_inputs
    if any(i.path == "-" for i in inputs) and cfg.resume:
        raise PackError("--resume cannot re-read stdin; pack from files to be able to resume")
    out = storage.Output(task_output(cfg.output, cfg.num_tasks, cfg.task_index))
    fingerprint = _fingerprint(cfg, inputs, tok.sha256)

    # -- the output directory and resume state ---------------------------------------------------
    records: list[dict] = []
    if cfg.resume:
        started = out.get_bytes(JOURNAL_START)
        if started is None:
            if out.get_bytes(fmt.INDEX_NAME) is not None:
                raise PackError(f"{out.url} is already complete (index.json exists); nothing to resume")
            if not out.is_empty():
                raise PackError(f"{out.url} holds no interrupted pack to resume")
        else:
            if json.loads(started)["fingerprint"] != fingerprint:
                raise PackError(
                    f"{out.url}: the inputs, tokenizer or options differ from the interrupted pack; "
                    "resume with the same command, or start again with --overwrite"
                )
            records = read_journal(out)
            _remove_unrecorded(out, cfg.prefix, len(records))
    elif not out.is_empty():
        if not cfg.overwrite:
            raise PackError(f"output {out.url} is not empty; pass --overwrite to replace it or --resume to finish it")
        out.clear()
    if not records:
        out.put_bytes(JOURNAL_START, json.dumps({"fingerprint": fingerprint, "created_by": f"wdsllm {__version__}"}).encode())

    counters = Counters()
    entries: list[fmt.ShardEntry] = []
    for rec in records:
        entries.append(fmt.ShardEntry(**rec["entry"]))
        counters.add_json(rec["counters"])
    position = Position.from_json(records[-1]["position"]) if records and records[-1]["position"] else None
    next_group = records[-1]["next_group"] if records else 0
    if records:
        log.info("resuming after %d finished shards at input %s", len(records), position)

    dtype = tok.dtype
    if cfg.mode == "packed":
        shaper = RowPacker(cfg.seq_len, max(1, cfg.sample_tokens // cfg.seq_len), dtype, resume=position)
    else:
        shaper = DocGrouper(cfg.sample_tokens, cfg.max_doc_tokens, dtype, resume=position)
    sink = ShardSink(
        out,
        prefix=cfg.prefix,
        task=cfg.task_index,
        mode=cfg.mode,
        shard_size=cfg.shard_size,
        shard_samples=cfg.shard_samples,
        first_shard=len(records),
        first_group=next_group,
        inputs_display={i.index: i.display for i in all_inputs},
        seq_len=cfg.seq_len,
    )
    sink.entries = list(entries)
    if records:  # running tallies, as of the last finished shard
        sink.max_row_segments = records[-1].get("max_row_segments", 0)
        sink.short_rows = records[-1].get("short_rows", 0)

    progress = PackProgress(
        documents=sum(e.documents for e in entries),
        tokens=sum(e.tokens for e in entries),
        shards=len(entries),
        input_total=sum(i.size for i in inputs),
    )
    workers = cfg.workers or os.cpu_count() or 1
    cpus = os.cpu_count() or 1
    threads = max(1, cpus // workers)
    parse_opts = {"split": cfg.split, "text_field": cfg.text_field, "on_error": cfg.on_error}
    ctx = mp.get_context("spawn")
    inflight_limit = 2 * workers + 1
    last_report = 0.0
    done_input_bytes = 0

    def consume(chunk: EncodedChunk) -> None:
        nonlocal last_report
        skips = chunk.skips
        if position is not None and chunk.file_index == position.file:
            skips = [s for s in skips if s.line > position.line]  # counted before the interruption
        sink.add_skips(skips)
        progress.skipped += len(skips)
        for group in shaper.feed(chunk):
            sink.write(group)
            progress.documents += group.documents
            progress.tokens += len(group.tokens)
        progress.shards = len(sink.entries)
        progress.input_bytes = done_input_bytes + chunk.raw_offset
        progress.text_bytes += chunk.text_bytes
        now = time.monotonic()
        if on_progress and now - last_report > 0.5:
            last_report = now
            progress.elapsed = now - start_time
            on_progress(progress)

    try:
        with ProcessPoolExecutor(
            max_workers=workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(tok.json_text, dtype.name, bos_id, eos_id, parse_opts, threads),
        ) as pool:
            pending: deque = deque()
            for inp in inputs:
                if position is not None and inp.index < position.file:
                    done_input_bytes += inp.size
                    continue
                start_line = position.line if position is not None and inp.index == position.file else 1
                for chunk in read_chunks(inp, cfg.split, cfg.chunk_bytes, start_line=start_line):
                    pending.append(pool.submit(_encode_chunk, chunk, inp.kind, inp.display))
                    if len(pending) >= inflight_limit:
                        consume(pending.popleft().result())
                while pending:
                    consume(pending.popleft().result())
                done_input_bytes += inp.size
        for group in shaper.finish():
            sink.write(group)
            progress.documents += group.documents
            progress.tokens += len(group.tokens)
        sink.finish_shard(final=True)
    except BaseException:
        sink.abort()
        raise

    index = _write_index(out, cfg, tok, use_bos, eos_id is not None, sink.entries, all_inputs, inputs, counters, sink)
    progress.shards = len(sink.entries)
    progress.elapsed = time.monotonic() - start_time
    progress.input_bytes = progress.input_total
    progress.done = True
    if on_progress:
        on_progress(progress)
    return PackResult(index=index, output=out.url, progress=progress, skipped=index.skipped, resumed_shards=len(records))


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


def _write_index(out, cfg, tok, use_bos, use_eos, entries, all_inputs, inputs, counters: Counters, sink: ShardSink) -> fmt.Index:
    # The journal holds every finished shard's tallies, including this run's.
    totals = Counters()
    lengths_parts = []
    for number in range(len(entries)):
        rec = json.loads(out.get_bytes(f"{JOURNAL_PREFIX}shard-{number:06d}.json"))
        totals.add_json(rec["counters"])
        lengths_parts.append(fmt.npy_array(out.get_bytes(journal_lengths_name(number))))
    totals.add_json(sink.leftover_counters().to_json())
    lengths = np.concatenate(lengths_parts) if lengths_parts else np.zeros(0, np.uint32)
    lengths_bytes = fmt.npy_bytes(lengths.astype(np.uint32))
    out.put_bytes(fmt.LENGTHS_NAME, lengths_bytes)
    options = cfg.output_options()
    options["bos"] = use_bos
    options["eos"] = use_eos
    index = fmt.Index(
        mode=cfg.mode,
        dtype=tok.dtype.name,
        seq_len=cfg.seq_len,
        tokenizer=tok.info(),
        shards=list(entries),
        doc_lengths=fmt.length_histogram(lengths),
        options=options,
        inputs=[
            {
                "index": i.index,
                "path": i.display,
                "bytes": i.size,
                "documents": totals.documents_by_input.get(i.index, 0),
                "skipped": totals.skipped_by_input.get(i.index, 0),
            }
            for i in inputs
        ],
        skipped={
            "counts": dict(sorted(totals.skipped.items())),
            "total": sum(totals.skipped.values()),
            "records": totals.skip_records,
            "records_truncated": sum(v for k, v in totals.skipped.items() if k != "empty") > len(totals.skip_records),
        },
        lengths_file={"name": fmt.LENGTHS_NAME, "bytes": len(lengths_bytes), "sha256": hashlib.sha256(lengths_bytes).hexdigest()},
        packed={"max_row_segments": sink.max_row_segments, "short_rows": sink.short_rows} if cfg.mode == "packed" else None,
        created_by=f"wdsllm {__version__}",
    )
    out.put_bytes(fmt.INDEX_NAME, index.to_json().encode())
    for name in out.list_names():
        if name.startswith(JOURNAL_PREFIX):
            out.delete(name)
    return index
