"""Shutdown is quiet (#31): a raw-text loader or a reader left half-read at interpreter exit closes
its inputs before the modules are torn down, and prints nothing."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

from pack_helpers import GPT2, REPO
from synth import write_dataset

import wdsllm

LEFT_HALF_READ = """
import atexit, gc, sys
checks = []
atexit.register(lambda: [check() for check in checks])  # registered first: runs after wdsllm's own
import wdsllm
from wdsllm.inputs.sources import Part, ParseOptions, expand_inputs
from wdsllm.inputs.registry import reader_for
from wdsllm.load.options import RawTextSource
path = sys.argv[1]
loader = wdsllm.loader(RawTextSource(path, tokenizer=sys.argv[2]), batch_size=4, num_workers=0, epochs=None)
it = iter(loader)
next(it)
(inp,) = expand_inputs([path])
chunks = reader_for(inp.kind).chunks(Part(inp, size=inp.size), ParseOptions(), 4096, 1)
next(chunks)
def closed_before_teardown():
    if chunks.gi_frame is not None:
        print("a reader was still open when the modules were torn down", file=sys.stderr)
checks.append(closed_before_teardown)
held = {"iterator": it, "chunks": chunks}
held["self"] = held  # a cycle: only the last collection, after module teardown, would free it
sys.modules["json"].held = held
"""


def test_a_half_read_raw_loader_and_reader_exit_quietly(tmp_path):
    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"document {i} " * 40}) + "\n")
    script = textwrap.dedent(LEFT_HALF_READ)
    proc = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", script, str(path), str(GPT2)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


LIVE_ITERATORS_AT_EXIT = """
import sys
import wdsllm
held = []
for workers, epochs in ((0, 1), (2, 1), (2, None)):
    loader = wdsllm.loader(sys.argv[1], batch_size=2, num_workers=workers, epochs=epochs)
    it = iter(loader)
    next(it)
    held.append((loader, it))
"""


def test_an_interpreter_that_exits_holding_live_iterators_prints_nothing(tmp_path):
    """A script that stops after one batch, its loaders and iterators still referenced (without
    workers, with workers, endless): the exit closes them while the modules exist."""
    data = tmp_path / "ds"
    write_dataset(data, [30, 30], seed=2)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LIVE_ITERATORS_AT_EXIT), str(data)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_close_with_an_iterator_still_referenced_stops_the_workers(tmp_path):
    """Local data (workers started afresh for each pass): ``close()`` stops the pass's workers
    although the trainer still holds its iterator, which then ends."""
    data = tmp_path / "ds"
    write_dataset(data, [40, 40], seed=4)
    before = {p.pid for p in multiprocessing.active_children()}
    loader = wdsllm.loader(data, batch_size=2, num_workers=2, watchdog_s=None)
    it = iter(loader)
    next(it)
    workers = {p.pid for p in multiprocessing.active_children()} - before
    assert len(workers) == 2
    loader.close()
    assert {p.pid for p in multiprocessing.active_children()} & workers == set(), "close() left workers running"
    assert all(not Path(f"/proc/{pid}").exists() for pid in workers)
    assert next(it, None) is None, "a closed loader's iterator ends"
