"""examples/online_mixing.py (issue #42): a DoReMi-style controller re-weights a real mixture while
the tiny GPT trains, and a run stopped and resumed from its checkpoint trains on exactly the
batches, and sets exactly the weights, of the uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pack_helpers import session_dir

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "online_mixing.py"


def _run(out: Path, *args: str) -> list[dict]:
    data = session_dir("online-mixing-corpora")  # packed by the first run, read by the others
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--data", str(data), "--steps", "16", "--every", "4", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_weights_change_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    full = _run(tmp_path / "a")
    assert len(full) == 16
    assert len({tuple(line["weights"]) for line in full}) > 1, "the controller never moved the weights"
    first = _run(tmp_path / "b", "--stop-at", "8")
    rest = _run(tmp_path / "b", "--resume")
    assert [line["step"] for line in first + rest] == list(range(1, 17))
    assert first + rest == full
