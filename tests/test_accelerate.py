"""Accelerate with wdsllm (issue #17): 2 processes under torchrun on the CPU (gloo).

The loader is built before the Accelerator with the launcher's RANK/WORLD_SIZE hidden (as under
mpirun, where "each document twice" was reproduced): it still reads only its rank's share."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from accelerate import Accelerator
from test_distributed import torchrun
from test_hf import _docs_data

import wdsllm
from wdsllm.errors import UsageError
from wdsllm.integrations.accelerate import prepare


@pytest.mark.timeout(240)
def test_accelerate_two_processes_each_document_once_and_resume_exact(tmp_path):
    data, info = _docs_data()
    torchrun("accelerate_loop.py", 2, "--data", str(data), "--out", str(tmp_path), timeout=200)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["full"]["built_as"] == [0, 1], "the loader was built before the process group existed"
        assert rep["full"]["len"] == 7
    for epoch in (0, 1):
        seen = Counter(
            d for rep in reports for rec in rep["full"]["records"] if rec["epoch"] == epoch for d in rec["docs"]
        )
        assert set(seen) == set(info["expect"]) and max(seen.values()) == 1, f"epoch {epoch}: not every document once"
        for rep in reports:
            recs = [rec for rec in rep["full"]["records"] if rec["epoch"] == epoch]
            assert [rec["shape"][0] for rec in recs[:-1]] == [6] * (len(recs) - 1) and recs[-1]["shape"][0] <= 6
            assert recs[-1]["sync"], "accumulate() syncs on the epoch's last batch"
    for rep in reports:
        full = rep["full"]["records"]
        for stop in (4, 10):
            joined = rep[f"first{stop}"]["records"] + rep[f"resume{stop}"]["records"]
            assert [(r["micro"], r["epoch"], r["docs"], r["sync"]) for r in joined] == [
                (r["micro"], r["epoch"], r["docs"], r["sync"]) for r in full
            ], f"resume after {stop} micro-batches trained on other batches"
            assert [r["loss"] for r in joined] == pytest.approx([r["loss"] for r in full], rel=1e-5)


def test_prepare_takes_only_a_loader_of_the_accelerators_rank():
    accelerator = Accelerator(cpu=True)
    data = _docs_data()[0]
    with pytest.raises(UsageError, match="must not be prepared"):
        prepare(accelerator, wdsllm.dataset(data, batch_size=4))
    with pytest.raises(UsageError, match="rank 1 of 2"):
        prepare(accelerator, wdsllm.loader(data, batch_size=4, rank=1, world_size=2))
    loader = prepare(accelerator, wdsllm.loader(data, batch_size=4))
    assert len(loader) == len(list(loader)) == 20
