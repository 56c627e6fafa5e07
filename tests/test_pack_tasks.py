"""Multi-task packs (--num-tasks/--task-index, or from SLURM/torchrun) and `wdsllm merge`."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pack_helpers import (
    GPT2,
    LLAMA,
    all_tokens,
    cached,
    cli,
    dataset_files,
    documents,
    groups,
    load_index,
    pack_api,
    provenance,
    wiki_lines,
    wiki_records,
    write_parquet,
)

from wdsllm import format as fmt
from wdsllm.format.verify import verify
from wdsllm.inputs.sources import Part, expand_inputs
from wdsllm.inputs.text import read_chunks
from wdsllm.pack import merge as merge_mod
from wdsllm.pack.job import assign_tasks, task_from_env
from wdsllm.pack.merge import MergeError, merge

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
    assert sorted(set(inputs_seen)) == list(range(len(corpus())))
    assert union == everything


def test_assignment_is_contiguous_balanced_and_deterministic():
    """Task t takes the units that start in its 1/K of the input bytes, in input order."""
    inputs = expand_inputs([str(p) for p in corpus()])
    total = sum(i.size for i in inputs)
    for tasks in (2, 3, 10):
        parts = assign_tasks(inputs, tasks)
        assert parts == assign_tasks(inputs, tasks)
        flat = [(p.input.index, p.start, p.stop if not p.whole else p.input.size) for task in parts for p in task]
        assert flat == sorted(flat)  # task order is input order: merged tasks read like one pack
        for i in inputs:  # each file's shares tile it
            shares = sorted((s, e) for f, s, e in flat if f == i.index)
            assert shares[0][0] == 0 and shares[-1][1] == i.size
            assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
        sizes = [sum(p.size for p in task) for task in parts]
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 2  # byte ranges: even to the byte


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
    """More tasks than (unsplittable) inputs: a task with nothing to do writes an empty, valid dataset."""
    files = []
    for path in corpus()[:2]:
        files.append(tmp_path / (path.name + ".gz"))
        files[-1].write_bytes(gzip.compress(path.read_bytes()))
    for t in range(3):
        pack_api(files, tmp_path / "out", num_tasks=3, task_index=t)
    assert sum(load_index(tmp_path / "out" / f"task-{t:05d}").shards == [] for t in range(3)) == 1
    index, _ = merge([str(tmp_path / "out")], str(tmp_path / "merged"))
    assert index.documents == sum(1 for _ in documents(tmp_path / "merged")) > 0
    assert np.array_equal(
        fmt.npy_array((tmp_path / "merged" / "lengths.npy").read_bytes()),
        [len(d) for d in documents(tmp_path / "merged")],
    )
    assert verify(str(tmp_path / "merged")).ok


# ----------------------------------------------------------------------------------------------
# Fewer files than tasks: the work is divided inside files, and merge equals a single-task pack.

SPLIT_TASKS = 8


def few_big_files() -> list[Path]:
    """Three inputs for eight tasks: an uncompressed jsonl with bad lines (divided by byte ranges),
    a Parquet file of 12 row groups (divided by row groups) and a small jsonl.gz (whole)."""

    def build(d: Path) -> list[Path]:
        lines = wiki_lines(1200)
        for n in (57, 300, 301, 888):
            lines[n] = "{broken" if n % 2 else '{"text": null}'
        (d / "big.jsonl").write_text("\n".join(lines) + "\n")
        write_parquet(d / "rows.parquet", wiki_records(1200, file_number=1), 100)
        (d / "small.jsonl.gz").write_bytes(gzip.compress(("\n".join(wiki_lines(150, 2)) + "\n").encode()))
        return [d / "big.jsonl", d / "rows.parquet", d / "small.jsonl.gz"]

    return cached("tasks-few-big", build)


@pytest.mark.parametrize("mode", [{"mode": "docs"}, {"mode": "packed", "seq_len": 300}])
def test_eight_tasks_over_three_files_merge_to_the_single_task_pack(tmp_path, mode):
    files = few_big_files()
    options = {"on_error": "skip", "sample_tokens": 4000, "shard_size": 64 * 1024, **mode}
    single = tmp_path / "single"
    pack_api(files, single, **options)
    parts = tmp_path / "parts"
    per_task = []
    for t in range(SPLIT_TASKS):
        result = pack_api(files, parts, num_tasks=SPLIT_TASKS, task_index=t, **options)
        per_task.append(sum(p.size for p in assign_tasks(expand_inputs(list(map(str, files))), SPLIT_TASKS)[t]))
        assert result.index.documents > 0
    assert min(per_task) > 0.5 * max(per_task)  # every task had a fair share of the input bytes
    index, _ = merge([str(parts)], str(tmp_path / "merged"))
    merged, one = tmp_path / "merged", load_index(single)
    # What is equal: the token stream and each document's tokens, lengths.npy, the provenance of
    # every document, the totals of documents and tokens, every skip count and record, and each
    # input's documents and skips.
    assert np.array_equal(all_tokens(merged), all_tokens(single))
    assert (merged / "lengths.npy").read_bytes() == (single / "lengths.npy").read_bytes()
    assert provenance(merged) == provenance(single)
    if mode["mode"] == "docs":
        assert [d.tolist() for d in documents(merged)] == [d.tolist() for d in documents(single)]
    assert (index.documents, index.tokens) == (one.documents, one.tokens)
    assert index.skipped == one.skipped and index.skipped["counts"]["invalid_json"] == 2
    assert index.inputs == one.inputs
    assert index.doc_lengths == one.doc_lengths
    assert verify(str(merged)).ok
    # What differs: shard and group boundaries (each task closes its own), so keys, shard names
    # and sizes, groups.npy, and in packed mode the rows (each task ends with its own short row).
    if mode["mode"] == "packed":
        assert index.packed["short_rows"] >= one.packed["short_rows"]


def test_a_task_of_a_divided_file_resumes_byte_identically(tmp_path):
    """A task that starts inside a file (counting the lines before it) and is interrupted."""
    files = few_big_files()
    options = {"sample_tokens": 2000, "shard_size": 16 * 1024, "on_error": "skip"}
    reference = tmp_path / "reference"
    pack_api(files, reference, num_tasks=SPLIT_TASKS, task_index=3, **options)
    task = reference / "task-00003"
    index = load_index(task)
    assert index.inputs[0]["part"]["unit"] == "bytes" and index.inputs[0]["part"]["start"] > 0
    assert len(index.shards) >= 3
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    # Interrupt it after the first shard: drop the index and what came later, keep the journal.
    _interrupt_after(out / "task-00003", index, keep=1, options=options, files=files)
    pack_api(files, out, num_tasks=SPLIT_TASKS, task_index=3, resume=True, **options)
    assert dataset_files(out / "task-00003") == dataset_files(task)


def _interrupt_after(task_dir: Path, index, keep: int, options: dict, files) -> None:
    """Make a finished task look killed after ``keep`` shards: re-run it with a sink that stops."""
    from wdsllm.pack import writer

    shutil.rmtree(task_dir)
    real = writer.ShardSink.finish_shard
    count = {"n": 0}

    def stopping(self, final=False):
        entry = real(self, final)
        count["n"] += entry is not None
        if count["n"] >= keep and not final:
            raise KeyboardInterrupt
        return entry

    writer.ShardSink.finish_shard = stopping
    try:
        with pytest.raises(KeyboardInterrupt):
            pack_api(files, task_dir.parent, num_tasks=SPLIT_TASKS, task_index=3, **options)
    finally:
        writer.ShardSink.finish_shard = real
    assert not (task_dir / "index.json").exists() and len(list(task_dir.glob("*.tar"))) == keep


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), min_size=0, max_size=30),
    final_newline=st.booleans(),
    cuts=st.lists(st.integers(0, 2000), max_size=6),
)
def test_byte_parts_tile_a_file_by_lines(tmp_path_factory, lines, final_newline, cuts):
    """Parts cut anywhere hold every line once, numbered as in the whole file, whatever the chunking."""
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    path = tmp_path_factory.mktemp("tile") / "f.jsonl"
    path.write_bytes(data)
    inp = expand_inputs([str(path)])[0]
    bounds = sorted({0, inp.size, *(c % (inp.size + 1) for c in cuts)})
    got = []
    for lo, hi in itertools.pairwise(bounds):
        for chunk in read_chunks(Part(inp, "bytes", lo, hi, hi - lo), "line", chunk_bytes=7):
            numbered = chunk.data.split(b"\n")
            if chunk.data.endswith(b"\n"):
                numbered.pop()
            got += list(enumerate(numbered, chunk.first_line))
    text = data.removeprefix(b"\xef\xbb\xbf")  # a byte order mark at the start is dropped (docs/cli.md)
    whole = text.split(b"\n") if text else []
    if text.endswith(b"\n"):
        whole.pop()
    assert got == list(enumerate(whole, 1))
