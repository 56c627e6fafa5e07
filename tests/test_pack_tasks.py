"""Multi-task packs (--num-tasks/--task-index, or from SLURM/torchrun) and `wdsllm merge`."""

from __future__ import annotations

import hashlib
import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
from pack_helpers import (
    GPT2,
    LLAMA,
    cached,
    cli,
    dataset_files,
    documents,
    groups,
    load_index,
    pack_api,
    provenance,
    wiki_lines,
)

from wdsllm import format as fmt
from wdsllm.format.verify import verify
from wdsllm.pack import merge as merge_mod
from wdsllm.pack.job import assign_tasks, task_from_env
from wdsllm.pack.merge import MergeError, merge
from wdsllm.pack.sources import expand_inputs

TASKS = 3
OPTIONS = {"sample_tokens": 3000, "shard_size": 40 * 1024}


def corpus() -> list[Path]:
    """Seven input files of uneven sizes cut from the wiki corpus (cached)."""

    def build(d: Path) -> list[Path]:
        lines = wiki_lines(1400)
        cuts = [0, 100, 450, 500, 800, 1150, 1200, 1400]
        paths = []
        for i, (a, b) in enumerate(itertools.pairwise(cuts)):
            path = d / f"part-{i}.jsonl"
            path.write_text("\n".join(lines[a:b]) + "\n")
            paths.append(path)
        return paths

    return cached("tasks-corpus", build)


def by_origin(path: Path) -> dict[tuple[int, int, int], list[int]]:
    return {origin: doc.tolist() for origin, doc in zip(provenance(path), documents(path))}


def task_packs() -> Path:
    """The corpus packed as TASKS tasks into one parent directory (cached; copy before changing)."""

    def build(d: Path) -> Path:
        for task in range(TASKS):
            pack_api(corpus(), d / "out", num_tasks=TASKS, task_index=task, **OPTIONS)
        return d / "out"

    return cached("tasks-packs", build)


def single_pack() -> Path:
    return cached("tasks-single", lambda d: (pack_api(corpus(), d / "out", **OPTIONS), d / "out")[1])


def fresh_parts(tmp_path: Path) -> Path:
    shutil.copytree(task_packs(), tmp_path / "out")
    return tmp_path / "out"


def test_tasks_are_disjoint_and_together_hold_every_document():
    parent = task_packs()
    assert sorted(p.name for p in parent.iterdir()) == [f"task-{t:05d}" for t in range(TASKS)]
    everything = by_origin(single_pack())
    union: dict = {}
    inputs_seen = []
    for t in range(TASKS):
        part = parent / f"task-{t:05d}"
        index = load_index(part)
        assert index.options["task_index"] == t and index.options["num_tasks"] == TASKS
        assert all(g.key.startswith(f"{t:04d}-") for g in groups(part))
        docs = by_origin(part)
        assert not set(docs) & set(union), "a document is in two tasks"
        union.update(docs)
        inputs_seen += [i["index"] for i in index.inputs]
        assert {f for f, _, _ in docs} <= {i["index"] for i in index.inputs}
    assert sorted(inputs_seen) == list(range(len(corpus())))
    assert union == everything


def test_assignment_is_balanced_deterministic_and_in_input_order():
    inputs = expand_inputs([str(p) for p in corpus()])
    parts = assign_tasks(inputs, TASKS)
    assert parts == assign_tasks(list(reversed(inputs)), TASKS)  # depends on the inputs, not their listing
    assert sorted(i.index for p in parts for i in p) == list(range(len(inputs)))
    for p in parts:
        assert [i.index for i in p] == sorted(i.index for i in p)
    sizes = [sum(i.size for i in p) for p in parts]
    assert max(sizes) - min(sizes) <= max(i.size for i in inputs)
    assert assign_tasks(inputs, 10)[9] == []  # more tasks than files: some get nothing


def test_task_defaults_come_from_slurm_arrays_and_torchrun():
    assert task_from_env({}) == (1, 0, None)
    slurm = {
        "SLURM_ARRAY_TASK_ID": "7",
        "SLURM_ARRAY_TASK_COUNT": "4",
        "SLURM_ARRAY_TASK_MIN": "5",
        "SLURM_ARRAY_TASK_STEP": "1",
    }
    assert task_from_env(slurm)[:2] == (4, 2)
    assert task_from_env({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"})[:2] == (4, 3)
    assert task_from_env({"RANK": "1", "WORLD_SIZE": "2"})[:2] == (2, 1)
    # A plain SLURM job step is not a task split: one pack in a batch script packs everything.
    assert task_from_env({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}) == (1, 0, None)


def test_command_line_takes_the_task_from_the_environment(tmp_path):
    files = corpus()[:2]
    env = {"RANK": "1", "WORLD_SIZE": "2"}
    result = cli("pack", *files, "-o", tmp_path / "out", "-t", GPT2, "-j", "1", env=env)
    assert "task 1 of 2 (from RANK/WORLD_SIZE (torchrun))" in result.stderr
    index = load_index(tmp_path / "out" / "task-00001")
    assert index.options["task_index"] == 1 and index.options["num_tasks"] == 2
    slurm = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"}
    cli("pack", *files, "-o", tmp_path / "out", "-t", GPT2, "-j", "1", "-q", env=slurm)
    assert (tmp_path / "out" / "task-00000" / "index.json").exists()
    # Explicit options win over the environment.
    cli(
        "pack",
        *files,
        "-o",
        tmp_path / "one",
        "-t",
        GPT2,
        "-j",
        "1",
        "-q",
        "--num-tasks",
        "1",
        "--task-index",
        "0",
        env=env,
    )
    assert (tmp_path / "one" / "index.json").exists()


def test_merge_moves_tasks_into_one_dataset(tmp_path):
    parent = fresh_parts(tmp_path)
    parts_before = {t: load_index(parent / f"task-{t:05d}") for t in range(TASKS)}
    index, _used = merge([str(parent)], str(tmp_path / "merged"))
    out = tmp_path / "merged"
    shard_count = sum(len(p.shards) for p in parts_before.values())
    assert [e.name for e in index.shards] == [fmt.shard_name("shard", i) for i in range(shard_count)]
    assert index.documents == sum(p.documents for p in parts_before.values())
    assert index.tokens == sum(p.tokens for p in parts_before.values())
    assert [i["index"] for i in index.inputs] == list(range(len(corpus())))
    assert "task_index" not in index.options and index.options["num_tasks"] == TASKS
    assert index.doc_lengths == fmt.length_histogram(fmt.npy_array((out / "lengths.npy").read_bytes()))
    assert by_origin(out) == by_origin(single_pack())
    assert verify(str(out)).ok
    # the merged dataset carries the parts' tokenizer
    assert index.tokenizer_file is not None
    assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == index.tokenizer.sha256
    # Moved: the parts are gone; the shards' bytes are unchanged.
    assert not parent.exists() or not any(parent.rglob("*"))
    single = {e.sha256 for p in parts_before.values() for e in p.shards}
    assert {e.sha256 for e in index.shards} == single
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_merge_in_place_and_by_copy(tmp_path):
    parent = fresh_parts(tmp_path)
    merge([str(parent / f"task-{t:05d}") for t in range(TASKS)], str(tmp_path / "copy"), copy=True)
    assert dataset_files(parent / "task-00000") == dataset_files(task_packs() / "task-00000")  # parts kept
    result = cli("merge", parent, "-o", parent)
    assert "merged 3 tasks (moved)" in result.stdout
    assert dataset_files(parent) == dataset_files(tmp_path / "copy")
    assert sorted(p.name for p in parent.iterdir() if p.is_dir()) == []


def test_merge_refuses_what_is_not_one_pack(tmp_path):
    parent = fresh_parts(tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(MergeError, match="not empty"):
        merge([str(parent)], str(tmp_path / "busy"))
    with pytest.raises(MergeError, match=r"tasks \[1\] of 3 are missing"):
        merge([str(parent / "task-00000"), str(parent / "task-00002")], str(tmp_path / "m1"), copy=True)
    shutil.copytree(parent / "task-00000", tmp_path / "again")
    with pytest.raises(MergeError, match="both task 0"):
        merge([str(parent), str(tmp_path / "again")], str(tmp_path / "m2"), copy=True)
    with pytest.raises(MergeError, match="option num_tasks differs"):
        merge([str(parent / "task-00000"), str(single_pack())], str(tmp_path / "m2"), copy=True)
    other = tmp_path / "other"
    pack_api(corpus(), other, num_tasks=TASKS, task_index=1, sample_tokens=5000, shard_size=OPTIONS["shard_size"])
    with pytest.raises(MergeError, match="option sample_tokens differs"):
        merge(
            [str(parent / "task-00000"), str(other / "task-00001"), str(parent / "task-00002")],
            str(tmp_path / "m3"),
            copy=True,
        )
    pack_api(corpus(), tmp_path / "llama", tokenizer=LLAMA, num_tasks=TASKS, task_index=1, **OPTIONS)
    with pytest.raises(MergeError, match="tokenizer"):
        merge(
            [str(parent / "task-00000"), str(tmp_path / "llama" / "task-00001")],
            str(tmp_path / "m4"),
            copy=True,
            allow_partial=True,
        )
    (parent / "task-00001" / "index.json").unlink()
    with pytest.raises(MergeError, match="task-00001 has no index.json"):
        merge([str(parent)], str(tmp_path / "m5"), copy=True)
    failed = cli("merge", parent, "-o", tmp_path / "m6", check=False)
    assert failed.returncode == 1 and "has not finished" in failed.stderr


def test_an_interrupted_merge_finishes_when_run_again(tmp_path, monkeypatch):
    parent = fresh_parts(tmp_path)
    reference = tmp_path / "reference"
    merge([str(parent)], str(reference), copy=True)
    real = merge_mod._transfer
    calls = {"n": 0}

    def flaky(move, out, copy):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError("disk went away")
        return real(move, out, copy)

    monkeypatch.setattr(merge_mod, "_transfer", flaky)
    with pytest.raises(OSError):
        merge([str(parent)], str(tmp_path / "merged"))
    assert not (tmp_path / "merged" / "index.json").exists()
    monkeypatch.setattr(merge_mod, "_transfer", real)
    merge([str(parent)], str(tmp_path / "merged"))
    assert dataset_files(tmp_path / "merged") == dataset_files(reference)


def test_merge_on_s3_in_place(tmp_path, s3_server, s3_bucket):
    parent = fresh_parts(tmp_path)
    s3_server.upload_dir(parent, f"{s3_bucket}/ds/")
    reference = tmp_path / "reference"
    merge([str(parent)], str(reference), copy=True)
    result = cli("merge", f"{s3_bucket}/ds/", "-o", f"{s3_bucket}/ds/")
    assert "merged 3 tasks (moved)" in result.stdout
    keys = sorted(o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket[5:]).get("Contents", []))
    assert keys == sorted(f"ds/{name}" for name in dataset_files(reference))  # the task parts are gone
    for name, data in dataset_files(reference).items():
        assert s3_server.get(f"{s3_bucket}/ds/{name}") == data
    assert verify(f"{s3_bucket}/ds").ok


def test_single_task_packs_with_empty_task(tmp_path):
    """More tasks than inputs: a task with nothing to do writes an empty, valid dataset."""
    files = corpus()[:2]
    for t in range(3):
        pack_api(files, tmp_path / "out", num_tasks=3, task_index=t)
    assert load_index(tmp_path / "out" / "task-00002").shards == []
    index, _ = merge([str(tmp_path / "out")], str(tmp_path / "merged"))
    assert index.documents == sum(1 for _ in documents(tmp_path / "merged")) > 0
    assert np.array_equal(
        fmt.npy_array((tmp_path / "merged" / "lengths.npy").read_bytes()),
        [len(d) for d in documents(tmp_path / "merged")],
    )
    assert verify(str(tmp_path / "merged")).ok
