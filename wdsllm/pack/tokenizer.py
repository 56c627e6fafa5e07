"""The tokenizer worker processes of a pack: set up once each, then parse and encode chunks.

Loading a tokenizer, its identity and batch encoding with BOS/EOS live in
:mod:`wdsllm.inputs.tokenizer` (shared with the raw-text loader); they are re-exported here.
This module imports only numpy and tokenizers (not webdataset, which imports torch), so a spawned
worker starts in a fraction of a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import numpy as np

from ..inputs.sources import Chunk, ParseOptions
from ..inputs.tokenizer import (  # noqa: F401 - re-exported: the packer's names for them
    BOS_NAMES,
    EOS_NAMES,
    PAD_NAMES,
    Encoder,
    LoadedTokenizer,
    add_specials,
    load_tokenizer,
    tokenizer_from_json,
)
from .shaping import EncodedChunk

_worker: dict = {}


def init_worker(
    tokenizer_path: str, dtype: str, bos_id, eos_id, parse_opts: ParseOptions, threads: int, parent_pid: int
) -> None:
    """Set up one tokenizer worker: its rayon threads, the encoder, and a watch on the parent.

    Runs only in a worker the pack spawned (a pool's initializer): the variables that size the
    tokenizer's thread pool are set there, in a process of ours, never in the user's."""
    if multiprocessing.parent_process() is None:
        raise RuntimeError("init_worker sets up a spawned tokenizer worker, not the process that packs")
    os.environ.update(worker_environment(threads))
    # Ctrl-C reaches the whole process group; the packing process alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(tokenizer_path, encoding="utf-8") as f:
        _worker["encoder"] = Encoder(f.read(), dtype, bos_id, eos_id)
    _worker["parse"] = parse_opts
    _watch_parent(parent_pid)


def worker_environment(threads: int) -> dict[str, str]:
    """The variables a tokenizer worker with ``threads`` rayon threads runs under (read by the
    tokenizers library when its pool starts)."""
    if threads <= 1:
        return {"TOKENIZERS_PARALLELISM": "false"}
    return {"TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": str(threads)}


def _watch_parent(parent_pid: int, interval: float = 1.0) -> None:
    """Exit when the packing process is gone (SIGKILL, OOM) instead of lingering as an orphan."""

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="wdsllm-parent-watch", daemon=True).start()


def encode_chunk(chunk: Chunk, display: str) -> EncodedChunk:
    """Parse and encode one chunk (in a worker): the unit of parallel work of a pack."""
    parsed = chunk.parse(_worker["parse"], display)
    tokens, lengths = _worker["encoder"].encode(parsed.texts)
    lines = np.asarray(parsed.lines, dtype=np.int64)
    keys = parsed.keys
    tallies = parsed.tallies
    if len(lengths) and not lengths.all():
        # Only possible without BOS and EOS: text the tokenizer maps to nothing is an empty document.
        empty = lengths == 0
        tallies.setdefault("empty", []).extend(lines[empty].tolist())
        lines, lengths = lines[~empty], lengths[~empty]
        if keys is not None:
            keys = [k for k, e in zip(keys, empty.tolist()) if not e]
    return EncodedChunk(
        file_index=chunk.file_index,
        first_line=int(lines[0]) if len(lines) else 0,
        tokens=tokens,
        lengths=lengths,
        lines=lines,
        skips=parsed.skips,
        raw_offset=chunk.raw_offset,
        text_bytes=chunk.text_bytes,
        tallies={reason: np.asarray(found, np.int64) for reason, found in tallies.items() if found},
        keys=keys,
    )
