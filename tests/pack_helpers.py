"""Helpers shared by the pack tests: running packs (API and CLI), reading results back.

Packs are cached for the whole test run (``cached``) because each one starts worker processes;
tests that only read a pack share it, and so do the run's pytest-xdist workers.
"""

from __future__ import annotations

import atexit
import fcntl
import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from wdsllm import format as fmt
from wdsllm.format import tar as tario
from wdsllm.pack.job import PackConfig, PackResult, pack

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
GPT2 = DATA / "tokenizers" / "gpt2.json"
LLAMA = DATA / "tokenizers" / "openllama.json"
WIKI = sorted((DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))
SHAKESPEARE = DATA / "corpora" / "tinyshakespeare.txt"

#: the test run's directory, made and removed by conftest.py and seen by every xdist worker of the
#: run (a process that imports this module outside pytest makes one of its own)
RUN_DIR_VARIABLE = "WDSLLM_TEST_RUN_DIR"
_own_run_dir: list[Path] = []
_cache: dict[str, object] = {}


def _run_dir() -> Path:
    if os.environ.get(RUN_DIR_VARIABLE):
        return Path(os.environ[RUN_DIR_VARIABLE])
    if not _own_run_dir:
        _own_run_dir.append(Path(tempfile.mkdtemp(prefix="wdsllm-packs-")))
        atexit.register(shutil.rmtree, _own_run_dir[0], ignore_errors=True)
    return _own_run_dir[0]


def session_dir(name: str) -> Path:
    """A directory of this process (an xdist worker's own) that lives for the test session."""
    path = _run_dir() / f"process-{os.getpid()}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached(name: str, build: Callable[[Path], object]):
    """Build once per test run; later calls, in this process or another worker of the run, return
    the first result. The first process to ask builds into a directory of the run while it holds
    the name's lock (the others wait), and leaves the result pickled beside it; a result that does
    not pickle is built once per process instead. What it holds is read by many tests: read-only."""
    if name not in _cache:
        _cache[name] = _built_once(name, build)
    return _cache[name]


def _built_once(name: str, build: Callable[[Path], object]):
    shared = _run_dir() / "cached"
    shared.mkdir(parents=True, exist_ok=True)
    result, own = shared / f"{name}.pickle", shared / f"{name}.per-process"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return pickle.loads(result.read_bytes())
        if own.exists():
            return build(session_dir(name))
        shutil.rmtree(shared / name, ignore_errors=True)  # what a build that failed left
        (shared / name).mkdir()
        value = build(shared / name)
        try:
            data = pickle.dumps(value)
        except (pickle.PicklingError, TypeError, AttributeError):
            own.touch()
            return value
        result.with_suffix(".partial").write_bytes(data)
        result.with_suffix(".partial").rename(result)
        return value


def wiki_lines(n: int, file_number: int = 0) -> list[str]:
    """The first n JSON lines of a wiki file."""
    out = []
    with gzip.open(WIKI[file_number], "rt", encoding="utf-8") as f:
        for line in f:
            out.append(line.rstrip("\n"))
            if len(out) == n:
                break
    return out


def wiki_subset(n: int, file_number: int = 0) -> Path:
    """The first n lines of a wiki file as a .jsonl.gz of their own (cached)."""

    def build(d: Path) -> Path:
        path = d / f"wiki-{file_number:02d}-head{n}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write("\n".join(wiki_lines(n, file_number)) + "\n")
        return path

    return cached(f"wiki{file_number}-{n}", build)


def shakespeare_counts(unit_bytes: int = 200_000) -> str:
    """The count sidecar of tinyshakespeare with gpt2 in units of ``unit_bytes`` (made once per
    session through the Python API; tests only read it)."""

    def build(d: Path) -> str:
        from wdsllm.load.raw import open_raw
        from wdsllm.load.rawcount import count_raw, save_counts

        source = open_raw(str(SHAKESPEARE), tokenizer=str(GPT2), unit_bytes=unit_bytes)
        path = str(d / "lines.counts.npz")
        save_counts(count_raw(source), source, path)
        return path

    return cached(f"shakespeare-counts-{unit_bytes}", build)


def shakespeare_packed() -> Path:
    """tinyshakespeare packed into rows of 128 gpt2 tokens (made once per test run; read-only):
    what the training examples' tests train on."""
    return cached(
        "shakespeare-packed-128", lambda d: Path(pack_api([SHAKESPEARE], d / "out", mode="packed", seq_len=128).output)
    )


def pack_api(inputs, output, tokenizer=GPT2, **options) -> PackResult:
    """One pack through the Python API; a single worker unless asked otherwise."""
    options.setdefault("workers", 1)
    cfg = PackConfig(inputs=[str(i) for i in inputs], output=str(output), tokenizer=str(tokenizer), **options)
    return pack(cfg)


def cli(
    *args, stdin: bytes | None = None, env: dict | None = None, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run `wdsllm ARGS` in a subprocess; text output."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "wdsllm.cli", *map(str, args)],
        input=stdin,
        capture_output=True,
        env=full_env,
        cwd=REPO,
        timeout=timeout,
    )
    proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
    if check and proc.returncode != 0:
        raise AssertionError(f"wdsllm {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def dataset_files(path: Path) -> dict[str, bytes]:
    """Every visible file of a dataset directory and its bytes (what must be reproducible)."""
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if not p.name.startswith(".")}


def load_index(path: Path) -> fmt.Index:
    return fmt.Index.from_json((Path(path) / fmt.INDEX_NAME).read_text())


def groups(path: Path) -> list[fmt.Group]:
    """Every group of a dataset, in index order, decoded with the strict reader."""
    index = load_index(path)
    out = []
    for entry in index.shards:
        with open(Path(path) / entry.name, "rb") as f:
            out.extend(g for _, g in tario.iter_groups(f, entry.name, verify_checksums=True))
    return out


def documents(path: Path) -> list[np.ndarray]:
    """docs mode: every stored document (pieces count) as its token array, in order."""
    docs = []
    for g in groups(path):
        ends = np.cumsum(g.lengths.astype(np.int64))
        docs.extend(np.split(g.tokens, ends[:-1]))
    return docs


def provenance(path: Path) -> list[tuple[int, int, int]]:
    """(input index, line, piece) of every stored document (docs mode) or document start (packed)."""
    out = []
    for g in groups(path):
        files, lines, pieces = fmt.expand_provenance(g.meta["provenance"], g.documents)
        out.extend(zip(files.tolist(), lines.tolist(), pieces.tolist()))
    return out


def all_tokens(path: Path) -> np.ndarray:
    gs = groups(path)
    return np.concatenate([g.tokens for g in gs]) if gs else np.zeros(0, np.uint16)


def jsonl(path: Path, records: list) -> Path:
    """Write records (dicts, or raw str/bytes lines) as a .jsonl file."""
    with open(path, "wb") as f:
        for r in records:
            if isinstance(r, bytes):
                f.write(r + b"\n")
            elif isinstance(r, str):
                f.write(r.encode() + b"\n")
            else:
                f.write(json.dumps(r).encode() + b"\n")
    return path


# ----------------------------------------------------------------------------------------------
# Columnar inputs written from the wiki corpus (Parquet, Arrow), with nulls, a struct and numbers.

LANGS = ("en", "de", "fr")


def wiki_records(n: int, file_number: int = 0) -> list[dict]:
    """n wiki documents as records: every 97th text null, every 89th empty; a struct ``meta`` with
    the text again (``body``), a ``score`` and a ``lang``; and non-text columns ``id`` and ``n``."""
    out = []
    for i, line in enumerate(wiki_lines(n, file_number)):
        text = json.loads(line)["text"]
        text = None if i % 97 == 5 else ("" if i % 89 == 7 else text)
        meta = {"body": text, "score": (i * 37 % 100) / 100, "lang": LANGS[i % 3]}
        out.append({"id": i, "title": f"doc {i}", "text": text, "meta": meta, "n": i * 2})
    return out


def write_parquet(path: Path, records: list[dict], row_group_size: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def write_arrow(path: Path, records: list[dict], batch_rows: int, stream: bool = False) -> Path:
    """An Arrow IPC file (Feather v2), or an IPC stream, of record batches of batch_rows rows."""
    import pyarrow as pa

    table = pa.Table.from_pylist(records)
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, opener(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return path


def encode_texts(texts: list[str], tokenizer: Path = GPT2, eos: int | None = 50256) -> list[list[int]]:
    """Direct tokenization, as pack does it (no specials from the tokenizer, EOS appended)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    tail = [eos] if eos is not None else []
    return [[*e.ids, *tail] for e in tok.encode_batch(texts, add_special_tokens=False)]
