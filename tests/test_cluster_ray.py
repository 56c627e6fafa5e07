"""Ray Data: PackSink packs a real local Ray cluster's write tasks into parts and merges them."""

from __future__ import annotations

import os
import shutil
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
from cluster_helpers import GPT2, SMALL, documents_by_origin, local_pack, source_records, visible_files
from pack_helpers import dataset_files, load_index

# read when ray is imported: a local cluster then listens on 127.0.0.1 only, not on every interface
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

from wdsllm.errors import MergeError, PackError  # noqa: E402
from wdsllm.integrations.ray import PackSink  # noqa: E402
from wdsllm.pack.merge import merge  # noqa: E402
from wdsllm.pack.part import pack_part  # noqa: E402

pa = pytest.importorskip("pyarrow")

N = 2000
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ray_cluster():
    """One small local cluster for the module: 2 CPUs, a small object store, on 127.0.0.1 only."""
    ray.init(
        num_cpus=2,
        object_store_memory=100 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
    )
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    yield
    ray.shutdown()


def dataset(records: list[dict]):
    return ray.data.from_items(records, override_num_blocks=4)


def sink(out: Path, sources: list[str], cls=PackSink, **kw) -> PackSink:
    return cls(str(out), tokenizer=str(GPT2), sources=sources, **{**SMALL, **kw})


@pytest.fixture(scope="module")
def first_run(ray_cluster, tmp_path_factory) -> tuple[Path, PackSink]:
    """The wiki records packed by 4 write tasks (shared: a later run must equal it byte for byte)."""
    name, records = source_records(N)
    out = tmp_path_factory.mktemp("ray") / "a"
    packer = sink(out, [name])
    dataset(records).write_datasink(packer)
    return out, packer


def test_ray_pack_equals_a_local_pack(first_run):
    out, packer = first_run
    assert [m.part_id for m in packer.manifests] == [0, 1, 2, 3]
    assert packer.index.documents == N
    assert documents_by_origin(out) == documents_by_origin(local_pack(N))
    name, records = source_records(N)
    with pytest.raises(PackError, match="already holds a packed dataset"):
        dataset(records).write_datasink(sink(out, [name]))


def test_a_rerun_with_another_number_of_blocks_is_refused_by_name_and_packs_nothing_twice(ray_cluster, tmp_path):
    """#43: a re-run after a driver crash with another number of blocks (Ray's default follows the
    cluster's size) returned the first run's parts without reading its rows: documents were
    packed twice, or the merge's advice (--overwrite) dropped finished parts. Parts hold their
    rows' digest: a task reuses the part only if it holds exactly its rows."""
    name, records = source_records(N)
    records = records[:800]
    out = tmp_path / "out"
    ray.data.from_items(records, override_num_blocks=4).write_datasink(sink(out, [name], merge=False))
    first = {p.name: dataset_files(p) for p in sorted(out.glob("part-*"))}
    assert sorted(first) == ["part-00000", "part-00001", "part-00002", "part-00003"]
    assert len({load_index(p).options["run"] for p in out.glob("part-*")}) == 1  # the sink named the run
    with pytest.raises(Exception, match=r"part-0000[01] holds other input than this task's \(200 records") as refused:
        ray.data.from_items(records, override_num_blocks=2).write_datasink(sink(out, [name]))
    assert "this task: 400 records" in str(refused.value) and "override_num_blocks" in str(refused.value)
    assert {p.name: dataset_files(p) for p in sorted(out.glob("part-*"))} == first
    assert not (out / "index.json").exists()
    again = sink(out, [name])
    ray.data.from_items(records, override_num_blocks=4).write_datasink(again)  # the first run's split: reused
    assert [m.resumed_shards for m in again.manifests] == [0, 0, 0, 0] and again.index.documents == 800
    local = documents_by_origin(local_pack(N))
    assert documents_by_origin(out) == {k: v for k, v in local.items() if k[1] <= 800}
    other = tmp_path / "other"
    ray.data.from_items(records, override_num_blocks=2).write_datasink(sink(other, [name], merge=False))
    kept = {p.name: dataset_files(p) for p in sorted(other.glob("part-0000[01]"))}
    with pytest.raises(Exception, match=r"part-0000[01] holds other input than this task's \(400 records"):
        ray.data.from_items(records, override_num_blocks=4).write_datasink(sink(other, [name]))
    assert {p.name: dataset_files(p) for p in sorted(other.glob("part-0000[01]"))} == kept
    # tasks 2 and 3 of the refused run found no part at their index and may have written one before
    # the refusal: a hand-run merge refuses exactly those (they hold the other split's rows)
    written = sorted(p.name for p in other.glob("part-0000[23]"))
    if written:
        with pytest.raises(MergeError, match="were written by run") as refused:
            merge([str(other)], str(other))
        assert all(name in str(refused.value) for name in written) and "part-00000," not in str(refused.value)
        for name in written:
            shutil.rmtree(other / name)
    assert merge([str(other)], str(other))[0].documents == 800
    assert documents_by_origin(other) == documents_by_origin(out)


class CrashOnce(PackSink):
    """Kills its worker (as a preemption or an OOM kill would) in the middle of part 1, once."""

    def __init__(self, *args, marker: str, **kw) -> None:
        super().__init__(*args, **kw)
        self.marker = marker

    def write(self, blocks, ctx):
        if ctx.task_idx == 1 and not os.path.exists(self.marker):
            return pack_part(die_after(self.records(blocks), 300, self.marker), 1, self.out, self.options)
        return super().write(blocks, ctx)


def die_after(rows, n: int, marker: str):
    for i, row in enumerate(rows):
        if i == n:
            Path(marker).touch()
            os._exit(1)
        yield row


def test_a_killed_write_task_is_retried_without_duplicates_or_orphans(first_run, tmp_path):
    name, records = source_records(N)
    marker = str(tmp_path / "crashed")
    packer = sink(tmp_path / "out", [name], cls=CrashOnce, marker=marker)
    dataset(records).write_datasink(packer, ray_remote_args={"max_retries": 2})
    assert os.path.exists(marker)  # the first attempt of part 1 did die
    part1 = next(m for m in packer.manifests if m.part_id == 1)
    assert part1.resumed_shards > 0  # its retry kept what the dead attempt had committed
    # a second run of the same pipeline, one of its tasks killed and retried: byte-identical
    assert dataset_files(tmp_path / "out") == dataset_files(first_run[0])
    sides = ("index.json", "lengths.npy", "groups.npy", "tokenizer.json")
    assert all(n.startswith("shard-") or n in sides for n in visible_files(tmp_path / "out"))


def traced_peak(packer: PackSink, block, task: int) -> int:
    """The most Python memory (tracemalloc) a write task allocates packing ``block``."""
    tracemalloc.start()
    try:
        packer.write([block], SimpleNamespace(task_idx=task))  # what Ray passes: blocks, a TaskContext
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_write_task_holds_a_chunk_not_its_block(tmp_path):
    """A block ten times larger costs a write task no more than a fraction of the larger block's
    text: rows are converted a chunk's bytes at a time, and shards stream to disk (Arrow's buffers
    are the block Ray already holds; tracemalloc counts what the task adds)."""
    name, records = source_records(N)
    packer = sink(tmp_path, [name])
    packer.write([pa.Table.from_pylist(records[:5])], SimpleNamespace(task_idx=9))  # tokenizer loaded
    small = traced_peak(packer, pa.Table.from_pylist(records[: N // 10]), 0)
    large = traced_peak(packer, pa.Table.from_pylist(records), 1)
    text = sum(len(r["text"].encode()) for r in records)
    assert large - small < text / 4, (small, large, text)
