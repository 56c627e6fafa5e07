"""examples/online_mixing.py (issue #42): a DoReMi-style controller re-weights a real mixture while
the tiny GPT trains, and a run stopped and resumed from its checkpoint trains on exactly the
batches, and sets exactly the weights, of the uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pack_helpers import DATA, cached, pack_api

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "online_mixing.py"
#: a short run of short rows: the weights move three times, the stop falls between two moves
SMALL = ("--steps", "8", "--every", "2", "--seq-len", "64", "--batch-size", "2")


def _corpora(d: Path) -> Path:
    """The example's two corpora, 60 KB of each, packed as it packs them (what its --data takes)."""
    for name, text in (("shakespeare", "tinyshakespeare.txt"), ("wikitext", "wikitext-2-valid.txt")):
        part = d / f"{name}.txt"
        part.write_text((DATA / "corpora" / text).read_text()[:60_000])
        pack_api([part], d / "data" / name, split="paragraph")
    return d / "data"


def _run(out: Path, *args: str) -> list[dict]:
    data = cached("online-mixing-corpora", _corpora)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--data", str(data), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_weights_change_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    full = _run(tmp_path / "a")
    assert len(full) == 8
    assert len({tuple(line["weights"]) for line in full}) > 1, "the controller never moved the weights"
    first = _run(tmp_path / "b", "--stop-at", "5")
    rest = _run(tmp_path / "b", "--resume")
    assert [line["step"] for line in first + rest] == list(range(1, 9))
    assert first + rest == full
