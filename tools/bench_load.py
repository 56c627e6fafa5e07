"""Streaming speed of the wdsllm loader against plain webdataset, raw tarfile and a flat memmap.

    python tools/bench_load.py [--work bench-out] [--quick] [--json results.json]
    python tools/bench_load.py --workers 0,1,2,4,8 --ranks 8   # scaling (tools/load_scaling.py)

Packs the wiki corpus (../shared/data/corpora/wiki, GPT-2 tokenizer) into WORK once in docs mode
and once in packed mode (--seq-len 2048), unless it is there already, then measures in one run:

- (a) ``wdsllm.loader``: docs mode (batch 64, max_len 2048, shuffle) and packed mode (batch 64 rows
  of 2048), with num_workers 0 and 2. Each configuration runs in its own process (so its peak RSS
  is its own) with persistent workers: a warm-up pass (epoch 0, its first batch includes building
  the loader and starting the workers: "cold"), then measured passes (epochs 1.., "warm" first
  batch). Peak RSS of that process and peak PSS of it and its workers are reported.
- (b) plain webdataset over the same shards: ``wds.WebDataset(urls, shardshuffle=False).decode()``,
  groups split into documents (rows), a shuffle buffer of the same size, padded [B, L] int64
  input_ids / labels (/ attention_mask for documents); single process. (b') the same over a per-document layout
  (one tar member per document, written once with ``webdataset.TarWriter``): the naive layout.
- (c) ``tarfile`` over the same shards, tokens by ``np.frombuffer``; single process.
- (d) a flat ``np.memmap`` of the same tokens: rows of 2048 in batches of 64 converted to int64
  tensors (the ceiling of a packed batch), one document at a time (the issue's docs ceiling), and
  the padded docs batches built with vectorised numpy (the ceiling of a padded docs batch).

Loader configurations report the best of ``--repeat`` measured passes; single-process baselines
read page-cached files (every file is read once before timing) and report the best of
``--baseline-repeat`` passes (one pass for the slow per-document pipeline). Every measuring
process runs torch ops with ``torch.set_num_threads(--torch-threads)`` (default 1; see
docs/benchmarks.md, "load", for why).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
WIKI = sorted(str(p) for p in (DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))
TOKENIZER = str(DATA / "tokenizers" / "gpt2.json")

BATCH = 64
SEQ_LEN = 2048  # packed row length, and docs-mode max_len
SHUFFLE_BUFFER = 10_000  # the loader's default, used by every shuffling configuration
IGNORE_INDEX = -100
MiB = 1 << 20


@dataclass
class Result:
    config: str
    group: str  # a, b, b', c, d
    mode: str  # docs or packed: which baselines the ratios use
    tokens: int
    items: int  # documents (pieces) or rows
    seconds: float
    first_batch_s: float | None = None  # warm (measured pass)
    first_batch_cold_s: float | None = None  # first pass, with worker start-up
    rss_main_mib: float | None = None  # peak RSS of the loader's process
    rss_base_mib: float | None = None  # its RSS after imports, before the loader exists
    pss_total_mib: float | None = None  # peak PSS of the loader's process and its workers
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds


# ------------------------------------------------------------------------------------------------
# Data preparation


@dataclass
class Paths:
    docs: str
    packed: str
    perdoc: str
    flat: str  # .bin of every token, dataset order
    doc_lengths: str  # .npy of every document's length, dataset order


def _packed_ok(out: str, inputs: list[str], mode: str) -> bool:
    index = Path(out, "index.json")
    if not index.exists():
        return False
    body = json.loads(index.read_text())
    opts = body.get("options", {})
    from wdsllm.format import FORMAT_VERSION

    return (
        body.get("version") == FORMAT_VERSION
        and opts.get("inputs") == inputs
        and opts.get("mode") == mode
        and opts.get("seq_len") == (SEQ_LEN if mode == "packed" else None)
    )


def pack_corpus(work: str, quick: bool, mode: str, log=print) -> str:
    """The wiki corpus (one file where ``quick``) packed in ``mode`` into WORK, unless it is there."""
    from wdsllm.pack.job import PackConfig, pack

    inputs = WIKI[:1] if quick else WIKI
    out = os.path.join(work, f"{'quick' if quick else 'wiki'}-{mode}")
    if not inputs and os.path.exists(os.path.join(out, "index.json")):
        return out  # packed elsewhere and brought here (a machine without the corpus: tools/gpu_check.sh)
    if not inputs:
        raise SystemExit(f"no wiki corpus under {DATA}")
    if not _packed_ok(out, inputs, mode):
        os.makedirs(work, exist_ok=True)
        log(f"packing {len(inputs)} wiki file(s) into {out} ({mode} mode)")
        t = time.perf_counter()
        seq_len = SEQ_LEN if mode == "packed" else None
        pack(PackConfig(inputs=inputs, output=out, tokenizer=TOKENIZER, mode=mode, seq_len=seq_len, overwrite=True))
        log(f"  {time.perf_counter() - t:.1f} s")
    return out


def prepare(work: str, quick: bool, log=print) -> Paths:
    """Pack (docs and packed), write the per-document layout and the flat token file, unless present."""
    tag = "quick" if quick else "wiki"
    paths = Paths(
        docs=os.path.join(work, f"{tag}-docs"),
        packed=os.path.join(work, f"{tag}-packed"),
        perdoc=os.path.join(work, f"{tag}-perdoc"),
        flat=os.path.join(work, f"{tag}-tokens.bin"),
        doc_lengths=os.path.join(work, f"{tag}-doc-lengths.npy"),
    )
    for mode in ("docs", "packed"):
        pack_corpus(work, quick, mode, log)
    stamp = json.loads(Path(paths.docs, "index.json").read_text())["shards"]
    stamp_path = os.path.join(work, f"{tag}-derived.json")
    if not (os.path.exists(stamp_path) and json.loads(Path(stamp_path).read_text()) == stamp):
        log(f"writing the flat token file and the per-document layout from {paths.docs}")
        _write_derived(paths)
        Path(stamp_path).write_text(json.dumps(stamp))
    return paths


def _docs_groups(docs_dir: str):
    """(tokens, lengths) of every group of a docs-mode dataset, in dataset order (plain tarfile)."""
    for url in shard_urls(docs_dir):
        with tarfile.open(url) as tf:
            current = {}
            for m in tf:
                _key, _, suffix = m.name.partition(".")
                if suffix in ("tokens.npy", "lengths.npy"):
                    current[suffix] = np.load(io.BytesIO(tf.extractfile(m).read()))
                if len(current) == 2:
                    yield current["tokens.npy"], current["lengths.npy"].astype(np.int64)
                    current = {}


def _write_derived(paths: Paths) -> None:
    import webdataset as wds

    os.makedirs(paths.perdoc, exist_ok=True)
    for old in glob.glob(os.path.join(paths.perdoc, "*.tar")):
        os.remove(old)
    all_lengths = []
    n = 0
    with (
        open(paths.flat + ".tmp", "wb") as flat,
        wds.ShardWriter(
            os.path.join(paths.perdoc, "perdoc-%06d.tar"), maxsize=128 * MiB, maxcount=10**9, verbose=0
        ) as sink,
    ):
        for tokens, lengths in _docs_groups(paths.docs):
            flat.write(tokens.tobytes())
            all_lengths.append(lengths)
            ends = np.cumsum(lengths)
            for a, b in zip((ends - lengths).tolist(), ends.tolist()):
                sink.write({"__key__": f"{n:09d}", "tokens.npy": tokens[a:b]})
                n += 1
    os.replace(paths.flat + ".tmp", paths.flat)
    np.save(paths.doc_lengths, np.concatenate(all_lengths))


def shard_urls(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.tar")))


def warm_page_cache(paths: Paths) -> None:
    for f in [*shard_urls(paths.docs), *shard_urls(paths.packed), *shard_urls(paths.perdoc), paths.flat]:
        with open(f, "rb") as fh:
            while fh.read(8 * MiB):
                pass


# ------------------------------------------------------------------------------------------------
# Memory


def _status_kib(pid: int | str, field_name: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pss_kib(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError):
            out.extend(int(x) for x in Path(task).read_text().split())
    return out


class MemorySampler:
    """Peak PSS of this process plus its children (DataLoader workers), sampled every ``interval`` s.

    PSS, not RSS, for the sum: forked workers share the parent's pages (torch's libraries alone
    are a few hundred MiB), which RSS would count once per process.
    """

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            total = _pss_kib(me) + sum(_pss_kib(c) for c in _children(me))
            self.peak_kib = max(self.peak_kib, total)
            self._stop.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------------------------------------
# (a) our loader, one configuration per process


def run_loader(spec: dict) -> dict:
    """Runs in a child process: a warm-up pass, then ``repeat`` measured passes (best reported)."""
    import torch

    import wdsllm

    if spec["torch_threads"] > 0:
        torch.set_num_threads(spec["torch_threads"])
    base_kib = _status_kib("self", "VmRSS")
    with MemorySampler() as mem:
        t0 = time.perf_counter()
        options = dict(spec["options"])
        one_by_one = options.get("batch_size", 1) is None  # wdsllm.dataset, documents one at a time
        if one_by_one:
            loader = wdsllm.dataset(spec["data"], **options)
        else:
            loader = wdsllm.loader(
                spec["data"], num_workers=spec["workers"], persistent_workers=spec["workers"] > 0, **options
            )
        passes = []
        for epoch in range(1 + spec["repeat"]):
            loader.set_epoch(epoch)
            start = t0 if epoch == 0 else time.perf_counter()
            first = None
            tokens = items = batches = 0
            kept_lengths = []  # summed after the pass: a torch op per batch would be timed as ours
            for batch in loader:
                if first is None:
                    first = time.perf_counter() - start
                if one_by_one:
                    tokens += len(batch["input_ids"])
                    items += 1
                else:
                    kept_lengths.append(batch["lengths"])
                batches += 1
            seconds = time.perf_counter() - start
            if kept_lengths:
                all_lengths = torch.cat(kept_lengths)
                tokens, items = int(all_lengths.sum()), len(all_lengths)
            passes.append(
                {
                    "seconds": seconds,
                    "first": first,
                    "tokens": tokens,
                    "items": items,
                    "batches": batches,
                    "rss_mib": _status_kib("self", "VmRSS") / 1024,
                }
            )
        del loader
    best = min(passes[1:], key=lambda p: p["seconds"])
    return {
        "tokens": best["tokens"],
        "items": best["items"],
        "seconds": best["seconds"],
        "first_batch_s": best["first"],
        "first_batch_cold_s": passes[0]["first"],
        "rss_main_mib": _status_kib("self", "VmHWM") / 1024,
        "rss_base_mib": base_kib / 1024,
        "pss_total_mib": mem.peak_kib / 1024,
        "batches": best["batches"],
        "rss_by_pass": [round(p["rss_mib"]) for p in passes],
    }


def loader_result(name: str, mode: str, data: str, workers: int, options: dict, args, note: str = "") -> Result:
    spec = {
        "data": data,
        "mode": mode,
        "workers": workers,
        "options": options,
        "repeat": args.repeat,
        "torch_threads": args.torch_threads,
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: the loader process failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    extra = {"batches": out.pop("batches"), "rss_by_pass": out.pop("rss_by_pass"), "workers": workers}
    return Result(name, "a", mode, note=note, extra=extra, **out)


# ------------------------------------------------------------------------------------------------
# (b) plain webdataset


def pad_docs(docs: list[np.ndarray], pad_id: int) -> dict:
    """What a plain-webdataset user writes: one row copy per document into [B, L] int64 arrays."""
    import torch

    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    width = int(lengths.max())
    ids = np.full((len(docs), width), pad_id, np.int64)
    mask = np.zeros((len(docs), width), np.int64)
    for i, d in enumerate(docs):
        ids[i, : len(d)] = d
        mask[i, : len(d)] = 1
    labels = np.where(mask == 1, ids, IGNORE_INDEX)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(labels),
        "lengths": torch.from_numpy(lengths),
    }


def stack_rows(rows: list[np.ndarray], pad_id: int) -> dict:
    """The same batch contents as ours for rows: input_ids, labels (-100 on padding), lengths."""
    import torch

    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    if all(len(r) == SEQ_LEN for r in rows):
        ids = torch.from_numpy(np.stack(rows).astype(np.int64))
        labels = ids.clone()
    else:
        ids = torch.full((len(rows), SEQ_LEN), pad_id, dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.from_numpy(r.astype(np.int64))
        labels = ids.clone()
        for i, r in enumerate(rows):
            labels[i, len(r) :] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "lengths": torch.from_numpy(lengths)}


def split_groups_to_docs(src):
    """Stage: wdsllm docs-mode groups -> documents (pieces of at most SEQ_LEN tokens)."""
    for sample in src:
        tokens, lengths = sample["tokens.npy"], sample["lengths.npy"].astype(np.int64)
        ends = np.cumsum(lengths)
        for a, b in zip((ends - lengths).tolist(), ends.tolist()):
            for s in range(a, b, SEQ_LEN):
                yield tokens[s : min(b, s + SEQ_LEN)]


def split_docs(src):
    """Stage: per-document samples -> documents (pieces of at most SEQ_LEN tokens)."""
    for sample in src:
        tokens = sample["tokens.npy"]
        for s in range(0, len(tokens), SEQ_LEN):
            yield tokens[s : s + SEQ_LEN]


def split_groups_to_rows(src):
    """Stage: wdsllm packed groups -> rows of SEQ_LEN."""
    for sample in src:
        tokens = sample["tokens.npy"]
        for s in range(0, len(tokens), SEQ_LEN):
            yield tokens[s : s + SEQ_LEN]


def wds_pipeline(urls: list[str], split, collate, pad_id: int):
    import webdataset as wds

    return (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .decode()
        .compose(split)
        .shuffle(SHUFFLE_BUFFER, initial=SHUFFLE_BUFFER)
        .batched(BATCH, collation_fn=lambda items: collate(items, pad_id), partial=True)
    )


def time_batches(make_iter, repeat: int) -> tuple[float, float, int, int]:
    """Best of ``repeat`` passes: (seconds, first-batch seconds, tokens, items). Tokens and items
    are counted from the batches' ``lengths`` after each pass, as for the loader."""
    best = None
    import torch

    for _ in range(repeat):
        t0 = time.perf_counter()
        first = None
        kept_lengths = []
        for batch in make_iter():
            if first is None:
                first = time.perf_counter() - t0
            kept_lengths.append(batch["lengths"])
        dt = time.perf_counter() - t0
        lengths = torch.cat(kept_lengths)
        if best is None or dt < best[0]:
            best = (dt, first, int(lengths.sum()), len(lengths))
    return best


def plain_wds_results(paths: Paths, pad_id: int, args) -> list[Result]:
    out = []
    for name, group, mode, urls, split, collate, note in (
        ("plain wds, our docs shards", "b", "docs", shard_urls(paths.docs), split_groups_to_docs, pad_docs, ""),
        ("plain wds, our packed shards", "b", "packed", shard_urls(paths.packed), split_groups_to_rows, stack_rows, ""),
        (
            "plain wds, per-document shards",
            "b'",
            "docs",
            shard_urls(paths.perdoc),
            split_docs,
            pad_docs,
            "naive layout",
        ),
    ):
        dt, first, tokens, items = time_batches(
            lambda urls=urls, split=split, collate=collate: iter(wds_pipeline(urls, split, collate, pad_id)),
            args.baseline_repeat if group == "b" else 1,
        )
        out.append(Result(name, group, mode, tokens, items, dt, first_batch_s=first, note=note))
    return out


# ------------------------------------------------------------------------------------------------
# (c) raw tarfile


def npy_payload(data: bytes) -> np.ndarray:
    """The array of a version 1.0 .npy without np.load: the header length is at bytes 8-9."""
    header_len = int.from_bytes(data[8:10], "little")
    header = data[10 : 10 + header_len].decode("latin1")
    dtype = np.dtype(ast.literal_eval(header)["descr"])
    return np.frombuffer(data, dtype=dtype, offset=10 + header_len)


def tarfile_tokens(urls: list[str]) -> tuple[int, int]:
    tokens = members = 0
    for url in urls:
        with tarfile.open(url) as tf:
            for m in tf:
                if m.name.endswith(".tokens.npy"):
                    tokens += len(npy_payload(tf.extractfile(m).read()))
                    members += 1
    return tokens, members


def tarfile_results(paths: Paths, args) -> list[Result]:
    out = []
    for name, group, mode, urls, note in (
        ("tarfile, our docs shards", "c", "docs", shard_urls(paths.docs), "groups of ~262k tokens"),
        ("tarfile, our packed shards", "c", "packed", shard_urls(paths.packed), "groups of ~262k tokens"),
        ("tarfile, per-document shards", "c", "docs", shard_urls(paths.perdoc), "one member per document"),
    ):
        best = None
        for _ in range(args.baseline_repeat):
            t0 = time.perf_counter()
            tokens, members = tarfile_tokens(urls)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        out.append(Result(name, group, mode, tokens, members, best, note=f"{note}; items are tar samples"))
    return out


# ------------------------------------------------------------------------------------------------
# (d) flat memmap


def memmap_results(paths: Paths, pad_id: int, args) -> list[Result]:
    import torch

    flat = np.memmap(paths.flat, dtype=np.uint16, mode="r")
    doc_lengths = np.load(paths.doc_lengths).astype(np.int64)
    n_rows = len(flat) // SEQ_LEN
    rows2d = flat[: n_rows * SEQ_LEN].reshape(n_rows, SEQ_LEN)
    order = np.random.default_rng(0).permutation(n_rows)
    out = []

    def rows_pass(shuffled: bool, all_tensors: bool = False) -> tuple[int, int]:
        tokens = 0
        for i in range(0, n_rows, BATCH):
            if shuffled:
                chunk = rows2d[np.sort(order[i : i + BATCH])]
            else:
                chunk = rows2d[i : i + BATCH]
            ids = torch.from_numpy(chunk.astype(np.int64))
            if all_tensors:  # what a packed batch of ours holds: labels too
                (ids, ids.clone())
            tokens += ids.numel()
        return tokens, n_rows

    def docs_pass() -> tuple[int, int]:
        ends = np.cumsum(doc_lengths)
        tokens = 0
        for a, b in zip((ends - doc_lengths).tolist(), ends.tolist()):
            tokens += torch.from_numpy(flat[a:b].astype(np.int64)).numel()
        return tokens, len(doc_lengths)

    # documents split at SEQ_LEN, in a shuffled order, padded exactly as the loader pads them
    ends = np.cumsum(doc_lengths)
    counts = (doc_lengths + SEQ_LEN - 1) // SEQ_LEN
    piece = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    p_start = np.repeat(ends - doc_lengths, counts) + piece * SEQ_LEN
    p_len = np.minimum(SEQ_LEN, np.repeat(doc_lengths, counts) - piece * SEQ_LEN)
    p_order = np.random.default_rng(0).permutation(len(p_len))
    p_start, p_len = p_start[p_order], p_len[p_order]
    flat_arr = np.asarray(flat)

    def padded_pass() -> tuple[int, int]:
        tokens = 0
        for i in range(0, len(p_len), BATCH):
            starts, lengths = p_start[i : i + BATCH], p_len[i : i + BATCH]
            n, width, total = len(lengths), int(lengths.max()), int(lengths.sum())
            offsets = np.cumsum(lengths) - lengths
            src = np.repeat(starts - offsets, lengths) + np.arange(total)
            dst = np.repeat(np.arange(n) * width - offsets, lengths) + np.arange(total)
            values = flat_arr[src].astype(np.int64)
            ids = np.full(n * width, pad_id, np.int64)
            ids[dst] = values
            labels = np.full(n * width, IGNORE_INDEX, np.int64)
            labels[dst] = values
            mask = np.zeros(n * width, np.int64)
            mask[dst] = 1
            [torch.from_numpy(x.reshape(n, width)) for x in (ids, labels, mask)]
            tokens += total
        return tokens, len(p_len)

    for name, mode, fn, note in (
        ("memmap rows, sequential", "packed", lambda: rows_pass(False), "[64, 2048] int64 per batch"),
        ("memmap rows, shuffled", "packed", lambda: rows_pass(True), "[64, 2048] int64 per batch; the packed ceiling"),
        (
            "memmap rows, shuffled, 2 tensors",
            "packed",
            lambda: rows_pass(True, True),
            "input_ids, labels [64, 2048] int64",
        ),
        ("memmap, one document at a time", "docs", docs_pass, "int64 tensor per document; the docs ceiling"),
        ("memmap docs, padded batches", "docs", padded_pass, "input_ids, labels, attention_mask [64, L]"),
    ):
        best = None
        for _ in range(args.baseline_repeat):
            t0 = time.perf_counter()
            tokens, items = fn()
            dt = time.perf_counter() - t0
            best = (dt, tokens, items) if best is None or dt < best[0] else best
        out.append(Result(name, "d", mode, best[1], best[2], best[0], note=note))
    return out


# ------------------------------------------------------------------------------------------------
# Report


CEILING = {"packed": "memmap rows, shuffled", "docs": "memmap, one document at a time"}
PLAIN = {"packed": "plain wds, our packed shards", "docs": "plain wds, our docs shards"}


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:,.1f}M" if x >= 1e6 else f"{x / 1e3:,.1f}k"


def table(results: list[Result]) -> str:
    by_name = {r.config: r for r in results}
    head = (
        "| config | tokens/s | docs/s or rows/s | vs (d) | vs (b) | first batch cold / warm | peak RSS main "
        "(base) / PSS all, MiB |"
    )
    lines = [head, "|" + "---|" * 7]
    for r in results:
        d = by_name.get(CEILING[r.mode])
        b = by_name.get(PLAIN[r.mode])
        unit = (
            "rows" if r.mode == "packed" and r.group in ("a", "b", "d") else ("samples" if r.group == "c" else "docs")
        )
        first = (
            ""
            if r.first_batch_s is None
            else (
                f"{r.first_batch_cold_s * 1e3:.0f} / {r.first_batch_s * 1e3:.0f} ms"
                if r.first_batch_cold_s is not None
                else f"{r.first_batch_s * 1e3:.0f} ms"
            )
        )
        mem = "" if r.rss_main_mib is None else f"{r.rss_main_mib:.0f} ({r.rss_base_mib:.0f}) / {r.pss_total_mib:.0f}"
        lines.append(
            f"| ({r.group}) {r.config} | {_fmt_rate(r.tokens_per_s)} | {_fmt_rate(r.items_per_s)} {unit} | "
            f"{r.tokens_per_s / d.tokens_per_s:.2f}x | {r.tokens_per_s / b.tokens_per_s:.2f}x | {first} | {mem} |"
            if d and b
            else f"| ({r.group}) {r.config} | {_fmt_rate(r.tokens_per_s)} | {_fmt_rate(r.items_per_s)} {unit} | | | "
            f"{first} | {mem} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--work", default=str(REPO / "bench-out"), help="where packed data and derived files live [default: bench-out/]"
    )
    ap.add_argument("--quick", action="store_true", help="one wiki file instead of eight (a smoke run)")
    ap.add_argument(
        "--repeat", type=int, default=5, help="measured loader passes after the warm-up pass (best is reported)"
    )
    ap.add_argument(
        "--baseline-repeat", type=int, default=5, help="passes of each fast single-process baseline (best is reported)"
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads in the measuring processes (0: torch's default)",
    )
    ap.add_argument("--skip", default="", help="comma-separated groups to leave out: a,b,c,d")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--workers", default="", help="worker scaling instead: these worker counts (0,1,2,4,8)")
    ap.add_argument("--ranks", type=int, default=0, help="worker scaling: also this many ranks at once, 1 worker each")
    ap.add_argument("--scaling", default="docs,pack", help="configurations scaled (load_scaling.CONFIGS) [docs,pack]")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank-child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> list[Result]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_loader(json.loads(args.child))))
        return []
    if args.rank_child or args.workers or args.ranks:
        import load_scaling  # the worker and rank scaling, beside this tool

        return load_scaling.main(args)
    import torch

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.perf_counter()
    paths = prepare(args.work, args.quick)
    warm_page_cache(paths)
    index = json.loads(Path(paths.docs, "index.json").read_text())
    tok = index["tokenizer"]
    pad_id = tok["pad_id"] if tok["pad_id"] is not None else (tok["eos_id"] if tok["eos_id"] is not None else 0)
    skip = set(filter(None, args.skip.split(",")))
    print(
        f"dataset: {index['totals']['documents']:,} documents, {index['totals']['tokens']:,} tokens, "
        f"{index['totals']['shards']} shard(s) per mode; batch {BATCH}, seq_len/max_len {SEQ_LEN}",
        flush=True,
    )

    results: list[Result] = []
    t_bench = time.perf_counter()
    if "a" not in skip:
        docs_opts = {
            "batch_size": BATCH,
            "max_len": SEQ_LEN,
            "shuffle": True,
            "shuffle_buffer": SHUFFLE_BUFFER,
            "seed": 0,
        }
        packed_opts = {"batch_size": BATCH, "shuffle": True, "shuffle_buffer": SHUFFLE_BUFFER, "seed": 0}
        for name, mode, data, workers, opts, note in (
            (
                "dataset docs, one document at a time",
                "docs",
                paths.docs,
                0,
                {**docs_opts, "batch_size": None},
                "wdsllm.dataset(batch_size=None): litdata's per-document layout of work",
            ),
            ("loader docs, 0 workers", "docs", paths.docs, 0, docs_opts, ""),
            ("loader docs, 2 workers", "docs", paths.docs, 2, docs_opts, ""),
            ("loader packed, 0 workers", "packed", paths.packed, 0, packed_opts, ""),
            ("loader packed, 2 workers", "packed", paths.packed, 2, packed_opts, ""),
            (
                "loader packed, 0 workers, docs=False",
                "packed",
                paths.packed,
                0,
                {**packed_opts, "docs": False},
                "no per-row document lists",
            ),
            (
                "loader packed, 2 workers, docs=False",
                "packed",
                paths.packed,
                2,
                {**packed_opts, "docs": False},
                "no per-row document lists",
            ),
            (
                "loader packed, 0 workers, buffer 1000",
                "packed",
                paths.packed,
                0,
                {**packed_opts, "shuffle_buffer": 1000},
                "RSS follows the buffer",
            ),
        ):
            results.append(loader_result(name, mode, data, workers, opts, args, note))
            print(f"  {name}: {_fmt_rate(results[-1].tokens_per_s)} tokens/s", flush=True)
    if "b" not in skip:
        results += plain_wds_results(paths, pad_id, args)
        print("  plain webdataset: done", flush=True)
    if "c" not in skip:
        results += tarfile_results(paths, args)
        print("  tarfile: done", flush=True)
    if "d" not in skip:
        results += memmap_results(paths, pad_id, args)
        print("  memmap: done", flush=True)
    print()
    print(table(results))
    for r in results:
        if "rss_by_pass" in r.extra:
            print(f"RSS of '{r.config}' after each pass, MiB: {r.extra['rss_by_pass']}")
    print(
        f"\nmeasured in {time.perf_counter() - t_bench:.0f} s ({time.perf_counter() - t_start:.0f} s with "
        "preparation); "
        f"torch threads {args.torch_threads}; load average {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps([{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results], indent=1)
        )
    return results


if __name__ == "__main__":
    main()
