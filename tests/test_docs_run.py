"""Every code block of README.md and docs/*.md runs, so that a doc that stops working fails here.

Python and bash blocks run; plain blocks (diagrams, output) and YAML/JSON (data) are not code.
Each file's blocks run in order, in one subprocess with a fresh working directory, sharing one
namespace (a page builds on its earlier blocks), on tiny local data built once per session:

- the paths a page names are replaced by local ones (``SUBSTITUTIONS``): datasets by tiny packs,
  corpora by small files, tokenizers by the shared ones in ../shared/data; ``num_workers=N`` runs
  with no worker processes and a trainer's epochs (``max_epochs``, ``num_train_epochs``) are cut to
  one, to keep the suite fast;
- names a fragment takes as given (``model``, ``optimizer``, ``epochs``, ...) come from
  ``PRELUDE``: a tiny randomly initialised GPT-2 and the like;
- a block that needs what a test cannot have (a cloud, a cluster, a GPU, the whole suite) is
  listed in ``SKIP`` with the reason, and a bash line that names a remote URL is not run
  (``REMOTE``): the reason is printed with the page's results.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from pack_helpers import GPT2, LLAMA, REPO, SHAKESPEARE, cached, pack_api, wiki_subset

PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]

#: (page, a line of the block) -> why the block is not run
SKIP = {
    ("README.md", "bash tools/demo.sh"): "builds a virtualenv and runs the whole test suite",
    ("README.md", "torchrun --nproc_per_node 2"): "a 2-process torchrun training: tests/test_train_ddp.py runs it",
    ("docs/cli.md", "#SBATCH --array"): "needs a SLURM cluster and S3",
    ("docs/loader.md", 'dist.init_process_group("gloo")'): "needs a torchrun launch, S3 and the reader's own model",
    ("docs/loader.md", "cu_seq_lens_q=batch"): "a fragment: the keywords of a FlashAttention model's forward",
    ("docs/loader.md", "wdsllm.RawTextSource("): "reads raw text from S3",
    ("docs/loader.md", 'torch.save(state, "ckpt.pt")'): (
        "continues the reader's own loop: run after the page's earlier blocks, its loader is the endless one "
        "(epochs=None) and the loop would not end"
    ),
    ("docs/integrations.md", "def llama3_wdsllm"): (
        "a config function for torchtitan's trainer, whose model modules import triton (GPU kernels): "
        "tests/test_torchtitan.py builds the adapter with the trainer's keywords on CPU"
    ),
    ("docs/integrations.md", "-m torchtitan.train"): "an 8-process torchtitan training on GPUs",
    ("docs/remote.md", "hf://datasets/org/name@main"): "needs the Hugging Face Hub and a torchrun launch",
    ("docs/mixtures.md", '"share": 0.601'): "an output of mix_stats(), not code",
    ("docs/cluster.md", "ray.init("): "starts a Ray cluster that reads its Parquet from S3",
    ("docs/cluster.md", "from datatrove.executor import"): (
        "runs an 8-task datatrove pipeline over data/ (tests/test_cluster_datatrove.py runs one of 3 tasks)"
    ),
    ("docs/cluster.md", "df.rdd.mapPartitionsWithIndex"): "needs a Spark and a Dask cluster (df, ddf) and S3",
}
#: benchmark commands run for minutes on the measuring machine
SKIP_PAGES = {"docs/benchmarks.md": "benchmark commands: minutes each, on the machine they measure"}
#: a bash line naming one of these is not run (no network in tests)
REMOTE = re.compile(r"\b(s3|gs|gcs|az|abfs|hf)://|\bhttps?://")
CODE = {"python", "bash", "sh"}

#: names a fragment uses without defining them
PRELUDE = """
import torch
import wdsllm
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_layer=1, n_head=2, n_embd=16, n_positions=2048))
optimizer = optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
model_state, optim_state = model.state_dict(), optimizer.state_dict()
resume, epochs, epoch, step, checkpoint = False, 1, 0, 0, None
"""


def local_data() -> dict[str, str]:
    """The tiny local stand-ins for the paths the pages name (built once per session)."""

    def build(d: Path) -> dict[str, str]:
        corpus = d / "corpus"
        corpus.mkdir()
        shutil.copy(wiki_subset(40), corpus / "wiki-00.jsonl.gz")
        book = d / "book.txt"
        book.write_text(SHAKESPEARE.read_text()[:40_000])
        plays = d / "plays.txt"  # short documents, so that the pages' training loops take seconds
        plays.write_text(SHAKESPEARE.read_text()[40_000:50_000])
        pack_api([plays], d / "wiki", split="paragraph", sample_tokens=8192)
        pack_api([book], d / "books", split="paragraph", sample_tokens=8192)
        pack_api([book], d / "wiki-2048", mode="packed", seq_len=128, sample_tokens=8192)
        _parquet(d / "fineweb-edu.parquet")
        _text_tar(d / "text-000.tar")
        return {
            # datasets (read by the pages' Python)
            "s3://bucket/wiki-2048/": str(d / "wiki-2048"),
            "data/wiki-2048": str(d / "wiki-2048"),
            "s3://bucket/wiki/": str(d / "wiki"),
            "data/wiki": str(d / "wiki"),
            "s3://b/web/": str(d / "wiki"),
            "s3://bucket/web/": str(d / "wiki"),
            "s3://b/code/": str(d / "books"),
            "s3://bucket/code/": str(d / "books"),
            "data/books": str(d / "books"),
            "out/wiki/*.tar": f"{d / 'wiki'}/*.tar",
            # inputs (read by the pages' commands; what they write goes to the page's own directory)
            "../shared/data/corpora/wiki/": f"{corpus}/",
            "../shared/data/corpora/tinyshakespeare.txt": str(book),
            "../shared/data/tokenizers/": f"{GPT2.parent}/",
            "data/*.jsonl.gz": f"{corpus}/*.jsonl.gz",
            "corpus/": f"{corpus}/",
            "book.txt": str(book),
            "fineweb-edu/*.parquet": str(d / "fineweb-edu.parquet"),
            "shards/text-{000..099}.tar": str(d / "text-000.tar"),
            "tokenizer.json": str(GPT2),
            "tok.json": str(GPT2),
            "llama.json": str(LLAMA),
            "/local/nvme/wdsllm-cache": str(d / "cache"),
            "mix.yaml": str(_mixture_file(d)),
        }

    return cached("docs-run", build)


def _parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = SHAKESPEARE.read_text()[:20_000].split("\n\n")
    table = pa.table(
        {
            "text": lines,
            "score": [float(i % 5) for i in range(len(lines))],
            "language": ["en" if i % 3 else "de" for i in range(len(lines))],
        }
    )
    pq.write_table(table, path)


def _text_tar(path: Path) -> None:
    """A raw-text WebDataset tar whose samples keep their text in a .json member's "body"."""
    import io

    with tarfile.open(path, "w") as tar:
        for i, text in enumerate(SHAKESPEARE.read_text()[:10_000].split("\n\n")):
            data = json.dumps({"body": text}).encode()
            info = tarfile.TarInfo(f"{i:06d}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _mixture_file(d: Path) -> Path:
    path = d / "mix.yaml"
    path.write_text(f"sources:\n  web: {d / 'wiki'}\n  code: {d / 'books'}\nweights: {{web: 0.7, code: 0.3}}\n")
    return path


def substituted(code: str, paths: dict[str, str]) -> str:
    """The block with the pages' paths replaced by local ones (one pass: a replacement is never
    replaced again), DataLoader workers off and a trainer's epochs cut to one."""
    keys = sorted(paths, key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(k) for k in keys))
    code = pattern.sub(lambda m: paths[m.group(0)], code)
    code = re.sub(r"\b(max_epochs|num_train_epochs)=\d+", r"\1=1", code)
    return re.sub(r"num_workers=\d+", "num_workers=0", code)


def blocks(page: str) -> list[dict]:
    """The page's code blocks in order: line, language, code and why it is skipped (or None)."""
    text = (REPO / page).read_text()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if m.group(1) not in CODE:
            continue
        code = m.group(2)
        skip = next((why for (p, line), why in SKIP.items() if p == page and line in code), None)
        out.append({"line": text[: m.start()].count("\n") + 1, "lang": m.group(1), "code": code, "skip": skip})
    return out


DRIVER = r"""
import json, os, re, subprocess, sys, traceback

page, blocks, prelude = json.loads(sys.stdin.read())
namespace = {"__name__": "__docs__"}
results = []
for block in blocks:
    where = f"{page}:{block['line']}"
    try:
        if block["lang"] == "python":
            if not namespace.get("__prelude__") and re.search(
                r"\b(model|optimizer|optim|resume|epochs|step|checkpoint|model_state|optim_state)\b", block["code"]
            ):
                exec(compile(prelude, "prelude", "exec"), namespace)
                namespace["__prelude__"] = True
            exec(compile(block["code"], where, "exec"), namespace)
        else:
            proc = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", block["code"]], capture_output=True, text=True, timeout=300
            )
            if proc.returncode:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
        results.append({"where": where, "error": None})
    except BaseException:
        results.append({"where": where, "error": traceback.format_exc(limit=4)[-3000:]})
print("RESULTS " + json.dumps(results))
"""


def _bash_lines(code: str, skipped: list[str]) -> str:
    """The block's commands without those that need the network (or a tool this machine lacks)."""
    kept = []
    for command in re.split(r"(?<!\\)\n", code):
        if REMOTE.search(command):
            skipped.append(f"not run (needs the network): {command.strip()}")
        elif "| jq" in command and shutil.which("jq") is None:
            skipped.append(f"not run (no jq here): {command.strip()}")
        else:
            kept.append(command)
    return "\n".join(kept)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_of_the_page_runs(page, tmp_path):
    if page in SKIP_PAGES:
        pytest.skip(SKIP_PAGES[page])
    found = blocks(page)
    skipped = [f"{page}:{b['line']} skipped: {b['skip']}" for b in found if b["skip"]]
    runnable = [b for b in found if not b["skip"]]
    if not runnable:
        pytest.skip("; ".join(skipped) or "no code blocks")
    paths = local_data()
    for b in runnable:
        b["code"] = substituted(b["code"], paths)
        if b["lang"] != "python":
            b["code"] = _bash_lines(b["code"], skipped)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps([page, runnable, PRELUDE]),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=580,
    )
    print("\n".join(skipped))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, f"the page's driver died ({proc.returncode}):\n{proc.stderr[-3000:]}"
    failed = [f"{r['where']}\n{r['error']}" for r in json.loads(line[len("RESULTS ") :]) if r["error"]]
    assert not failed, "blocks that do not run:\n" + "\n".join(failed)
