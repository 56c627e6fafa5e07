"""``wdsllm explain``: the documents of step N on rank r, made again from the plan without a
model, equal what the loader with real DataLoader workers yielded at step N, for every batching
mode and a mixture, on 2 ranks x 2 workers, from an epoch's start and from a saved state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from pack_helpers import cached
from synth import write_dataset

import wdsllm
from wdsllm.cli.app import cli
from wdsllm.observe.explain import explain_step, placed

STEP = 3


def _data() -> dict[str, Path]:
    def build(d: Path) -> dict[str, Path]:
        write_dataset(d / "docs", [30, 20, 25], seed=3, max_len=40)
        write_dataset(d / "other", [24, 16], seed=4, max_len=40)
        write_dataset(d / "packed", [30, 30, 24], seed=5, mode="packed", seq_len=16)
        return {"docs": d / "docs", "other": d / "other", "packed": d / "packed"}

    return cached("observe-explain", build)


def _cases() -> dict[str, tuple]:
    data = _data()
    mix = {"docs": str(data["docs"]), "other": str(data["other"])}
    return {
        "fixed": (data["docs"], dict(batch_size=4, max_len=16)),
        "bucket": (data["docs"], dict(batching="bucket", batch_size=4)),
        "pack": (data["docs"], dict(batching="pack", seq_len=32, batch_size=2)),
        "concat": (data["docs"], dict(batching="concat", seq_len=32, batch_size=2)),
        "packed": (data["packed"], dict(batch_size=3, boundaries=True)),
        "mixture": (wdsllm.Mixture(mix, weights={"docs": 2, "other": 1}, unit="items"), dict(batch_size=4)),
    }


def _yielded(source, rank: int, epoch: int, **options) -> tuple[list, list]:
    """What the loader with 2 real worker processes yields: each step's documents, and the state
    saved after step 0."""
    with wdsllm.loader(source, rank=rank, world_size=2, num_workers=2, seed=7, **options) as loader:
        loader.set_epoch(epoch)
        steps, state = [], None
        for batch in loader:
            steps.append(placed(loader, batch))
            if state is None:
                state = loader.state_dict()
    return steps, state


@pytest.mark.parametrize("case", list(_cases()))
def test_explain_equals_what_the_loader_yielded(case):
    source, options = _cases()[case]
    for rank in (0, 1):
        steps, state = _yielded(source, rank, epoch=1, **options)
        assert len(steps) > STEP
        layout = dict(rank=rank, world_size=2, num_workers=2, seed=7, **options)
        assert explain_step(source, STEP, epoch=1, **layout) == steps[STEP]
        assert explain_step(source, STEP - 1, state=state, **layout) == steps[STEP], "from the state after step 0"


def test_the_command_prints_the_documents(tmp_path):
    data = _data()["docs"]
    steps, state = _yielded(data, 1, epoch=0, batch_size=4, max_len=16)
    (tmp_path / "state.json").write_text(json.dumps(state))
    args = ["explain", str(data), "--step", str(STEP - 1), "--rank", "1", "--world-size", "2", "--num-workers", "2"]
    args += ["--seed", "7", "--state", str(tmp_path / "state.json"), "--option", "batch_size=4", "--option"]
    out = CliRunner().invoke(cli, [*args, "max_len=16", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [(r["shard"], r["ordinal"], r["piece"]) for r in rows] == [
        (p.shard, p.ordinal, p.piece) for p in steps[STEP]
    ]
