"""datatrove: a LocalPipelineExecutor of reader -> filter -> PackWriter in 3 tasks, then MergeParts."""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path

import pytest
from cluster_helpers import GPT2, SMALL, documents_by_origin, visible_files
from pack_helpers import cached, load_index, pack_api, wiki_lines

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # should anything import ray: 127.0.0.1 only
pytest.importorskip("datatrove")
pytest.importorskip("orjson")

from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.filters import LambdaFilter
from datatrove.pipeline.readers import JsonlReader

from wdsllm.errors import PackError
from wdsllm.integrations.datatrove import MergeParts, PackWriter, line_adapter

FILES = 3
LINES = 600
#: arms the filter to fail once, in rank 1, as a task killed mid-way would
CRASH = {"rank1": False}


def inputs() -> tuple[Path, Path]:
    """(a directory of 3 wiki .jsonl.gz files, its single-machine pack), built once per session."""

    def build(d: Path) -> tuple[Path, Path]:
        src = d / "in"
        src.mkdir()
        lines = wiki_lines(FILES * LINES)
        for i in range(FILES):
            with gzip.open(src / f"wiki-{i}.jsonl.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines[i * LINES : (i + 1) * LINES]) + "\n")
        return src, Path(pack_api([src], d / "local", **SMALL).output)

    return cached("datatrove-inputs", build)


def long_enough(document) -> bool:
    if (
        CRASH["rank1"]
        and document.metadata["file_path"].endswith("wiki-1.jsonl.gz")
        and document.metadata["line"] > 400
    ):
        CRASH["rank1"] = False
        raise RuntimeError("task killed")
    return len(document.text) > 300


def texts(src: Path) -> dict[tuple[str, int], str]:
    out = {}
    for path in sorted(src.iterdir()):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                out[(str(path), n)] = json.loads(line)["text"]
    return out


def executor(src: Path, out: Path, logs: Path, sources: list[str]) -> LocalPipelineExecutor:
    return LocalPipelineExecutor(
        pipeline=[
            JsonlReader(str(src), adapter=line_adapter),
            LambdaFilter(long_enough),
            PackWriter(str(out), tokenizer=str(GPT2), sources=sources, **SMALL),
        ],
        tasks=FILES,
        workers=1,
        logging_dir=str(logs),
    )


def test_datatrove_pipeline_packs_exactly_the_filtered_documents(tmp_path, caplog):
    src, local = inputs()
    sources = [i["path"] for i in load_index(local).inputs]
    assert sources == [str(p) for p in sorted(src.iterdir())]
    out = tmp_path / "out"
    CRASH["rank1"] = True
    with pytest.raises(RuntimeError, match="task killed"):
        executor(src, out, tmp_path / "logs", sources).run()
    assert (tmp_path / "logs" / "completions" / "00000").exists()
    assert not (tmp_path / "logs" / "completions" / "00001").exists()
    assert not (out / "part-00001" / "index.json").exists()
    assert list((out / "part-00001").glob("shard-*.tar"))  # committed before the crash: kept, not redone
    # the relaunch skips rank 0, continues rank 1's part from its cursor, runs rank 2
    with caplog.at_level(logging.INFO, logger="wdsllm.pack.part"):
        executor(src, out, tmp_path / "logs", sources).run()
    assert [r for r in caplog.records if "part-00001: resuming after" in r.getMessage()]
    assert sorted(os.listdir(tmp_path / "logs" / "completions")) == ["00000", "00001", "00002"]
    LocalPipelineExecutor(pipeline=[MergeParts(str(out))], tasks=1, logging_dir=str(tmp_path / "merge-logs")).run()

    by_text = texts(src)
    expected = {k: v for k, v in documents_by_origin(local).items() if len(by_text[k[:2]]) > 300}
    assert 0 < len(expected) < len(by_text)
    assert documents_by_origin(out) == expected
    assert not [f for f in visible_files(out) if f.startswith("part-")]


def test_where_reads_the_documents_metadata(tmp_path):
    lines = wiki_lines(90)
    documents = [
        Document(text=json.loads(line)["text"], id=str(n), metadata={"score": n % 3}) for n, line in enumerate(lines)
    ]
    PackWriter(str(tmp_path), tokenizer=str(GPT2), where="score >= 1", **SMALL).run(
        iter(documents), rank=2, world_size=3
    )
    index = load_index(tmp_path / "part-00002")
    assert index.documents == 60 and index.skipped["counts"] == {"filtered": 30}
    with pytest.raises(PackError, match="document.text"):
        PackWriter(str(tmp_path), tokenizer=str(GPT2), text_field="content")
