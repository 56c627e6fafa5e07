"""The training-stack adapters with real parts: model_inputs() gives a real transformers model
only the keywords its forward names, and a world-size mismatch under ``accelerate launch`` names
its real cause."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from pack_helpers import SHAKESPEARE, cached, pack_api, wiki_subset
from test_distributed import free_port
from transformers import GPT2Config, GPT2LMHeadModel

import wdsllm
from wdsllm.integrations import model_inputs


def two_sources() -> dict[str, str]:
    def build(d):
        text = d / "shakespeare.txt"
        text.write_text(SHAKESPEARE.read_text()[:60_000])
        pack_api([text], d / "plays", split="paragraph", sample_tokens=4096)
        pack_api([wiki_subset(60)], d / "wiki", sample_tokens=4096)
        return {"plays": str(d / "plays"), "wiki": str(d / "wiki")}

    return cached("integration-two-sources", build)


def _named_parameters(forward) -> set[str]:
    """The keywords a forward names (what it takes without a **kwargs catch-all)."""
    return {n for n, p in inspect.signature(forward).parameters.items() if p.kind is not p.VAR_KEYWORD}


@pytest.mark.parametrize("options", [{"max_len": 64}, {"batching": "pack", "seq_len": 64}])
def test_model_inputs_of_a_mixture_batch_are_keywords_the_model_names(options):
    mix = wdsllm.Mixture(two_sources(), weights={"plays": 0.5, "wiki": 0.5})
    batch = next(iter(wdsllm.loader(mix, batch_size=4, **options)))
    assert "sources" in batch  # a mixture's batch says where each item came from
    inputs = model_inputs(batch, flash_keys=False)
    assert "sources" not in inputs
    assert set(inputs) <= _named_parameters(GPT2LMHeadModel.forward)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_layer=1, n_head=2, n_embd=16, n_positions=64))
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).loss)


PROBE = """
import os
import sys
from pathlib import Path

import wdsllm
from accelerate import Accelerator
from wdsllm.errors import UsageError
from wdsllm.integrations.accelerate import prepare

accelerator = Accelerator(cpu=sys.argv[2] == "cpu")
answer = Path(sys.argv[3]) / f"{os.getpid()}.txt"
try:
    loader = prepare(accelerator, wdsllm.loader(sys.argv[1], batch_size=2))
    answer.write_text(f"prepared {accelerator.process_index} of {accelerator.num_processes}")
except UsageError as exc:
    answer.write_text(f"refused: {exc}")
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_multi_gpu_launch_on_cpus_names_accelerator_cpu_true(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    for mode in ("plain", "cpu"):
        answers = tmp_path / mode
        answers.mkdir()
        cmd = [*launch, "--main_process_port", str(free_port()), str(script), two_sources()["plays"], mode, answers]
        proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = sorted(p.read_text() for p in answers.iterdir())
        if mode == "plain":
            assert len(lines) == 2 and all(line.startswith("refused") for line in lines), lines
            assert all("Accelerator(cpu=True)" in line and "--multi_gpu" in line for line in lines)
            assert not any("without rank=/world_size=" in line for line in lines)
        else:
            assert lines == ["prepared 0 of 2", "prepared 1 of 2"], lines
