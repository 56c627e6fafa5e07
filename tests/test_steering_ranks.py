"""Changes made while a run trains are collectives (issue #42): two real gloo processes take the
same skip at the same planned step, and a change given differently on the ranks is refused on
both, naming the difference, with nothing changed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from synth import write_dataset

SCRIPT = Path(__file__).resolve().parent / "scripts" / "steer_ranks.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_two_ranks_take_the_same_change_and_refuse_a_different_one(tmp_path):
    data = tmp_path / "ds"
    write_dataset(data, [20, 20, 20, 20], seed=3)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "--rank", str(r), "--port", str(port), "--data", str(data), "--out", str(out)]
        )
        for r in range(2)
    ]
    for proc in procs:
        assert proc.wait(timeout=150) == 0
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["skip"] == 2
        assert len(report["errors"]) == 1 and "exclude() was called differently on the ranks" in report["errors"][0]
        assert [c["kind"] for c in report["log"]] == ["skip"]  # the refused exclusion left nothing behind
    assert len(reports[0]["docs"]) == len(reports[1]["docs"]) == 10 - 2  # 40 documents a rank, 4 a batch
    assert reports[0]["planned"] == reports[1]["planned"] == 10
    assert not {d for b in reports[0]["docs"] for d in b} & {d for b in reports[1]["docs"] for d in b}
