"""Shutdown is quiet (#31): a raw-text loader or a reader left half-read at interpreter exit closes
its inputs before the modules are torn down, and prints nothing."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap

from pack_helpers import GPT2, REPO

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
