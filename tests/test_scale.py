"""Start-up and memory that do not grow with the corpus (issue #16).

The dataset is built the way ``tools/bench_scale.py`` builds its billion documents
(``tools/scale_data.py``): hundreds of hardlinks of one shard, side files written a chunk at a
time, and (past ``table_limit`` shards) the shard table in shards.npy. On it: every document once,
equal batches in every batching mode (the counts that run in the background included), exact
resumption, and workers that map lengths.npy rather than copy it. The counting formulas are also
checked against the batchers' own plans, and the lower bounds against the exact counts.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synth import write_dataset

import wdsllm
from wdsllm import format as fmt
from wdsllm.format.verify import verify
from wdsllm.load import counts as countsmod
from wdsllm.load.batching import ArrayLengths, BucketBatcher, best_fit_decreasing, bfd_count, budget_count
from wdsllm.load.config import Config
from wdsllm.load.handoff import batcher_for, slices_for
from wdsllm.load.sources.open import open_source
from wdsllm.load.stats import all_modes
from wdsllm.load.stream import ShareLengths, shuffle_lengths, slice_item_lengths

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import scale_data  # noqa: E402 - the builder of tools/bench_scale.py

SHARDS = 150  # past table_limit (100): the shard table moves to shards.npy
MODES = {
    "fixed": dict(batch_size=5),
    "split": dict(batch_size=5, max_len=17),
    "bucket": dict(batching="bucket", batch_size=5, window=40),
    "budget": dict(batching="bucket", max_tokens=160, batch_size=None, window=60),
    "budget_unaligned": dict(batching="bucket", max_tokens=200, batch_size=None, window=45, pad_to_multiple_of=4),
    "pack": dict(batching="pack", seq_len=32, window=50, batch_size=3),
    "concat": dict(batching="concat", seq_len=32, batch_size=3),
}
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def scale_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("base")
    write_dataset(base, [37], seed=5, max_len=60, group_docs=6)
    root = tmp_path_factory.mktemp("scale") / "ds"
    scale_data.build(str(base), str(root), SHARDS, table_limit=100)
    return root


def _load(root: Path, rank: int, world: int, workers: int, **options) -> wdsllm.load.loader.Loader:
    return wdsllm.loader(
        str(root), rank=rank, world_size=world, num_workers=workers, _in_process=True, seed=7, **options
    )


# ----------------------------------------------------------------------------------------------
# The dataset: a binary shard table, read back; info and verify stream through it


def test_the_shard_table_moves_to_shards_npy_and_reads_back(scale_root):
    index, body = fmt.read_index(str(scale_root))
    assert index.shards_file is not None and "shards" not in body and body["shard_prefix"] == "shard"
    assert len(index.shards) == SHARDS and index.shards[17].name == "shard-000017.tar"
    assert index.totals()["documents"] == 37 * SHARDS == index.documents
    assert index.lengths_file.chunks and index.groups_file.chunks
    with pytest.raises(fmt.FormatError, match="read it with read_index"):
        fmt.Index.from_json((scale_root / fmt.INDEX_NAME).read_bytes())
    out = subprocess.run(
        [sys.executable, "-m", "wdsllm.cli", "info", str(scale_root)], capture_output=True, text=True, check=True
    ).stdout
    assert f"shards     {SHARDS}, " in out and "table in shards.npy" in out


def test_a_changed_shard_table_is_refused(scale_root, tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    for p in scale_root.iterdir():
        (root / p.name).symlink_to(p) if p.suffix == ".tar" else (root / p.name).write_bytes(p.read_bytes())
    table = np.load(root / fmt.SHARDS_NAME).copy()
    table[3] += 1  # shard 0's tokens
    np.save(root / fmt.SHARDS_NAME, table)
    with pytest.raises(fmt.FormatError, match="shards.npy"):
        open_source(str(root))


def test_verify_checks_the_copies_in_parallel_processes(scale_root):
    report = verify(str(scale_root), jobs=2)
    assert len(report.shards) == SHARDS and all(not s.errors for s in report.shards)
    # the copies repeat the base shard's keys (and the synthetic index names no inputs); nothing else
    keys = [e for e in report.errors if e.startswith("key ") and " is in both " in e]
    assert len(keys) == SHARDS - 1
    assert [e for e in report.errors if e not in keys] == [
        f"index.json: inputs account for 0 documents, the shards {37 * SHARDS}"
    ]


# ----------------------------------------------------------------------------------------------
# Every document once; equal batches in every mode; resumption


def _items(batch: dict) -> list:
    if "rows" in batch:
        return [d for d in batch["docs"].reshape(-1).tolist() if d >= 0]
    return [tuple(x) for x in batch["docs"].tolist()]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_document_once_and_equal_batches(scale_root, mode):
    world, workers = 3, 2
    options = dict(MODES[mode], shuffle_buffer=50)
    seen: Counter = Counter()
    tokens = 0
    for rank in range(world):
        for batch in _load(scale_root, rank, world, workers, equal_batches=False, **options):
            seen.update(_items(batch))
            tokens += int(batch["lengths"].sum())
    index, _ = fmt.read_index(str(scale_root))
    assert tokens == index.tokens  # every token once (pieces, rows and truncation-free modes)
    if "rows" in mode or mode in ("pack", "concat"):
        assert {(d >> 32, d & 0xFFFFFFFF) for d in seen} == {(s, i) for s in range(SHARDS) for i in range(37)}
    else:
        assert max(seen.values()) == 1 and {d for d, _ in seen} == {
            (s << 32) | i for s in range(SHARDS) for i in range(37)
        }
    per_rank = []
    for rank in range(world):
        loader = _load(scale_root, rank, world, workers, **options)
        expected = len(loader)  # asked before the pass: after it, len() is the next epoch's
        n = sum(1 for _ in loader)
        assert loader.limits.ready() and n == loader.limits.per_rank == expected
        per_rank.append(n)
    assert len(set(per_rank)) == 1, per_rank


@pytest.mark.parametrize("mode", ["budget", "pack", "split"])
def test_resume_mid_epoch_on_the_scale_dataset(scale_root, mode):
    world, workers = 2, 2
    full = [b["input_ids"] for b in _load(scale_root, 1, world, workers, **MODES[mode])]
    for k in (1, len(full) // 2, len(full) - 1):
        first = _load(scale_root, 1, world, workers, **MODES[mode])
        it = iter(first)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(first.state_dict()))
        again = _load(scale_root, 1, world, workers, **MODES[mode])
        again.load_state_dict(state)
        rest = [b["input_ids"] for b in again]
        assert len(rest) == len(full) - k and all(torch.equal(a, b) for a, b in zip(rest, full[k:]))


# ----------------------------------------------------------------------------------------------
# Workers share the mapped lengths


def test_a_worker_maps_the_lengths_and_holds_no_copy(scale_root):
    pipe = wdsllm.dataset(str(scale_root), batching="bucket", max_tokens=160, batch_size=None, seed=3)
    catalog = pipe.catalog

    def probe(batches):
        for _ in batches:  # in the worker, after it made a batch
            sides = catalog._sides
            lengths = catalog.lengths().whole()
            yield {
                "pid": os.getpid(),
                "mapped": isinstance(lengths, np.memmap) and lengths.mode == "r" and not lengths.flags.owndata,
                "copies": [name for name, side in sides.items() if side._data is not None],
                "count": len(lengths),
            }
            return

    loader = torch.utils.data.DataLoader(
        pipe.compose(probe), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    reports = list(loader)
    assert len(reports) == 2 and all(r["pid"] != os.getpid() for r in reports)
    assert all(r["mapped"] and not r["copies"] and r["count"] == 37 * SHARDS for r in reports)
    assert all(side._data is None for side in catalog._sides.values())  # the main process holds no copy either


# ----------------------------------------------------------------------------------------------
# The counting formulas, and the bounds


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 300), max_size=700),
    window=st.integers(1, 120),
    budget=st.sampled_from([40, 64, 300, 1000]),
    multiple=st.sampled_from([None, 8]),
    drop_last=st.booleans(),
)
def test_budget_count_equals_the_bucket_plan(lengths, window, budget, multiple, drop_last):
    lengths = np.asarray(lengths, np.int64)
    batcher = BucketBatcher(window, max_tokens=budget, pad_to_multiple_of=multiple, drop_last=drop_last)
    want = sum(b for b, _ in batcher.simulate(lengths)) if len(lengths) else 0
    assert budget_count(ArrayLengths(lengths).windows(window), budget, multiple, drop_last) == want


@SETTINGS
@given(lengths=st.lists(st.integers(0, 70), max_size=400), capacity=st.sampled_from([1, 2, 7, 32, 64]))
def test_histogram_best_fit_count_equals_best_fit_decreasing(lengths, capacity):
    lengths = np.asarray(lengths, np.int64)
    assert bfd_count(lengths, capacity) == len(best_fit_decreasing(lengths, capacity))


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=9),
    world=st.integers(1, 4),
    workers=st.integers(1, 3),
    buffer=st.sampled_from([0, 7, 20]),
    mode=st.sampled_from(sorted(MODES)),
    epoch=st.integers(0, 3),
)
def test_counts_equal_the_shuffled_streams_and_bounds_hold(sizes, world, workers, buffer, mode, epoch):
    """Every consumer's count (closed forms, token sums, or windows read in plan order) equals
    the mode's count over its fully shuffled lengths; the bounds never exceed it, and a worker's
    streaming bound never exceeds its share of the equal count."""
    with tempfile.TemporaryDirectory() as tmp:
        write_dataset(tmp, sizes, seed=epoch, max_len=50)
        catalog = open_source(tmp)
        cfg = Config(seed=3, shuffle_buffer=buffer, **MODES[mode])
        table = countsmod.EpochCounts.create(catalog, cfg, epoch, world, workers)
        exact = table.exact()
        for r in range(world):
            for w in range(workers):
                spec = cfg.spec(epoch, r, world, w, workers)
                batcher = batcher_for(catalog, cfg, spec)  # full batches only, where a worker hands its tail on
                slices = slices_for(catalog, cfg, spec)  # with the tails, for a rank's last worker
                shuffled = shuffle_lengths(slice_item_lengths(catalog, slices, spec), spec)
                assert exact[r, w] == batcher.count(len(shuffled), shuffled)
                if batcher.count_by == "windows":
                    share = ShareLengths(catalog, slices, spec)
                    assert [list(np.sort(x)) for x in share.windows(cfg.window)] == [
                        list(np.sort(x)) for x in ArrayLengths(shuffled).windows(cfg.window)
                    ]
        assert (table.bound <= exact).all()
        limits = countsmod.EpochLimits(
            countsmod.EpochCounts(table.bound, None, countsmod._Background(lambda: exact)), 0, workers
        )
        share = countsmod.round_robin_share(exact[0], int(exact.sum(axis=1).min()))
        for w in range(workers):
            assert limits.worker_limit(w).bound <= share[w] == limits.worker_limit(w).value()


def test_a_forked_process_counts_again_or_reads_the_node_cache(scale_root, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile as tf

    monkeypatch.setattr(tf, "tempdir", None)  # gettempdir() follows TMPDIR again
    catalog = open_source(str(scale_root))
    cfg = Config(seed=1, shuffle_buffer=50, **MODES["pack"])
    counts = countsmod.EpochCounts.create(catalog, cfg, 0, 4, 2)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=lambda: queue.put(counts.exact().tolist()))
    child.start()
    got = queue.get(timeout=120)
    child.join(30)
    assert got == counts.exact().tolist()
    cached = list(Path(countsmod.counts_cache_dir(catalog)).glob("counts-*.npy"))
    assert len(cached) == 1 and np.array_equal(np.load(cached[0]), counts.exact())


# ----------------------------------------------------------------------------------------------
# stats on a sample


def test_stats_on_a_sample_agree_with_the_whole_stream(scale_root):
    catalog = open_source(str(scale_root))
    settings_ = dict(batch_size=8, max_tokens=400, seq_len=40, window=60, seed=2)
    whole, none = all_modes(catalog, sample=0, **settings_)
    sampled, sample = all_modes(catalog, sample=60, **settings_)
    assert none is None and sample.runs == 60 and sample.total_documents == 37 * SHARDS
    for w, s in zip(whole, sampled):
        assert (w.mode, w.settings) == (s.mode, s.settings)
        if s.padding_ci is None:  # concat: exact from the index
            assert (w.batches, w.padded) == (s.batches, s.padded)
            continue
        assert abs(w.padding_pct - s.padding_pct) <= max(3 * s.padding_ci, 0.5), (w, s)
        assert abs(w.batches - s.batches) <= 0.1 * w.batches + 2, (w, s)


# ----------------------------------------------------------------------------------------------
# Writers: pack and merge write lengths.npy and groups.npy a piece at a time


@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_a_side_file_written_in_pieces_is_the_one_written_whole(tmp_path, dtype):
    from wdsllm.format.side import SideWriter

    rng = np.random.default_rng(3)
    values = rng.integers(0, 1 << 30, (fmt.CHUNK_BYTES * 5) // (2 * np.dtype(dtype).itemsize)).astype(dtype)
    path = str(tmp_path / "side.npy")
    writer = SideWriter(path, "side.npy", dtype, len(values))
    cuts = np.sort(rng.integers(0, len(values), 9))
    for a, b in zip([0, *cuts], [*cuts, len(values)]):  # pieces across chunk edges, some empty
        writer.write(values[a:b])
    ref = writer.finish()
    whole = fmt.npy_bytes(values)
    expect = fmt.SideFile.of("side.npy", whole)
    assert Path(path).read_bytes() == whole
    assert (ref, ref.chunks) == (expect, expect.chunks) and len(ref.chunks) == 3
    assert fmt.SideFile.of_file("side.npy", path).chunks == ref.chunks

    short = SideWriter(path + "2", "short.npy", dtype, 3)
    short.write(np.ones(2, dtype))
    with pytest.raises(fmt.FormatError, match="2 values written, its header announces 3"):
        short.finish()
    assert not os.path.exists(path + "2")  # nothing half-written is left
    narrow = SideWriter(path + "3", "narrow.npy", np.uint32, 2)
    with pytest.raises(fmt.FormatError, match="does not fit uint32"):
        narrow.write(np.array([1, -1]))
    narrow.abort()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3_000_000), max_size=40), min_size=1, max_size=5))
def test_the_length_summary_of_pieces_is_the_histogram_of_the_whole(pieces):
    """Summarised a piece at a time (lengths below and above the per-value counts' range), the
    index's doc_lengths are what numpy computes over the whole array."""
    whole = np.asarray([v for p in pieces for v in p], np.int64)
    summary = fmt.LengthSummary()
    for p in pieces:
        summary.add(np.asarray(p, np.uint32))
    got = summary.to_json()
    if not len(whole):
        assert got == {"edges": [], "counts": [], "count": 0}
        return
    edges = [0] + [1 << k for k in range(max(1, int(whole.max()).bit_length()) + 1)]
    assert got["edges"] == edges and got["counts"] == np.histogram(whole, bins=edges)[0].tolist()
    assert (got["count"], got["min"], got["max"]) == (len(whole), whole.min(), whole.max())
    assert got["mean"] == round(float(whole.mean()), 3)
    assert [got["p50"], got["p90"], got["p99"]] == np.percentile(whole, [50, 90, 99]).tolist()


def test_side_files_are_written_in_bounded_memory(tmp_path):
    """What pack and merge use: 16 MB of lengths through SideFiles, never held."""
    import tracemalloc

    from wdsllm import storage
    from wdsllm.pack.sidefiles import SideFiles

    n, step = 4_000_000, 100_000
    out = storage.Output(str(tmp_path / "ds"))
    tracemalloc.start()
    try:
        with SideFiles(out, n, 0) as sides:
            for a in range(0, n, step):
                sides.add_lengths((np.arange(a, a + step) % 5000).astype(np.uint32))
            lengths_file, groups_file = sides.put()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * n // 4  # a quarter of the file's size: pieces, never the whole
    assert lengths_file == fmt.SideFile.of_file(fmt.LENGTHS_NAME, str(tmp_path / "ds" / fmt.LENGTHS_NAME))
    assert np.array_equal(np.load(tmp_path / "ds" / fmt.LENGTHS_NAME), np.arange(n) % 5000)
    assert groups_file.bytes == len(fmt.npy_bytes(np.zeros(0, np.int64)))
    assert sides.summary.to_json() == fmt.length_histogram(np.arange(n) % 5000)
    assert sorted(os.listdir(tmp_path / "ds")) == [fmt.GROUPS_NAME, fmt.LENGTHS_NAME]  # no staging left


def _part(root: Path, task: int, docs: int, shards: int, version: int, seed: int) -> Path:
    """A pack task's output of ``shards`` hardlinked copies of one synthetic shard, in ``version``
    (format 3: no chunk digests; format 4: shards.npy past 10,000 shards)."""
    base = root / f"base-{task}"
    write_dataset(base, [docs], seed=seed, version=version, task=task, options={"task_index": task, "num_tasks": 2})
    part = root / "parts" / f"task-{task:05d}"
    scale_data.build(str(base), str(part), shards)
    if version < 4:  # what a format-3 writer wrote: side files vouched for by their sha256 alone
        body = json.loads((part / fmt.INDEX_NAME).read_text())
        for key in ("lengths_file", "groups_file"):
            body[key] = {k: body[key][k] for k in ("name", "bytes", "sha256")}
        (part / fmt.INDEX_NAME).write_text(json.dumps(body))
    return part


@pytest.mark.slow  # 10,061 shards moved, each fsynced
def test_a_format_3_and_a_format_4_part_merge_into_format_4_with_shards_npy(tmp_path):
    """Format 4 changed only the index and how side files are vouched for, so the parts of one
    pack written by both merge (into format 4); a merged table of more than 10,000 shards goes to
    shards.npy, and the merged side files carry chunk digests."""
    from wdsllm.pack.merge import merge

    a = _part(tmp_path, 0, 7, 60, 3, seed=1)
    b = _part(tmp_path, 1, 5, fmt.INLINE_SHARDS_MAX + 1, 4, seed=2)
    index_a, _ = fmt.read_index(str(a))
    index_b, _ = fmt.read_index(str(b))
    assert (index_a.version, index_a.shards_file, index_b.version) == (3, None, 4) and index_b.shards_file
    lengths = np.concatenate([np.load(a / fmt.LENGTHS_NAME), np.load(b / fmt.LENGTHS_NAME)])
    groups = np.concatenate([np.load(a / fmt.GROUPS_NAME), np.load(b / fmt.GROUPS_NAME)])
    first, last = (a / "shard-000000.tar").read_bytes(), (b / "shard-000000.tar").read_bytes()

    out = tmp_path / "merged"
    index, parts = merge([str(tmp_path / "parts")], str(out))
    assert len(parts) == 2 and not list((tmp_path / "parts").glob("*/*.tar"))  # moved
    shards = 60 + fmt.INLINE_SHARDS_MAX + 1
    index, body = fmt.read_index(str(out))
    assert index.version == fmt.FORMAT_VERSION == 4 and "shards" not in body and index.shards_file is not None
    assert len(index.shards) == shards and index.shards.name(shards - 1) == fmt.shard_name("shard", shards - 1)
    assert index.documents == 60 * 7 + (shards - 60) * 5 == len(lengths)
    assert np.array_equal(np.load(out / fmt.LENGTHS_NAME), lengths)
    assert np.array_equal(np.load(out / fmt.GROUPS_NAME), groups)
    assert index.doc_lengths == fmt.length_histogram(lengths)
    for ref in (index.lengths_file, index.groups_file, index.shards_file):
        assert ref.chunks and ref == fmt.SideFile.of_file(ref.name, str(out / ref.name))
        assert ref.chunks == fmt.SideFile.of_file(ref.name, str(out / ref.name)).chunks
    assert (out / "shard-000059.tar").read_bytes() == first and (out / "shard-000060.tar").read_bytes() == last
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    # the loader reads it: every document of the last shard, through shards.npy
    catalog = open_source(str(out))
    assert catalog.index.shards_file is not None and len(catalog.index.shards) == shards


def test_a_part_whose_lengths_are_damaged_stops_the_merge_before_a_shard_moves(tmp_path):
    from wdsllm.pack.merge import merge

    a = _part(tmp_path, 0, 7, 3, 4, seed=1)
    _part(tmp_path, 1, 5, 4, 3, seed=2)
    data = bytearray((a / fmt.LENGTHS_NAME).read_bytes())
    data[-1] ^= 1
    (a / fmt.LENGTHS_NAME).write_bytes(bytes(data))
    with pytest.raises(fmt.FormatError, match="lengths.npy"):
        merge([str(tmp_path / "parts")], str(tmp_path / "merged"))
    assert sorted(n for n in os.listdir(a) if n.endswith(".tar")) == [fmt.shard_name("shard", i) for i in range(3)]
    left = os.listdir(tmp_path / "merged")  # its plan stays, for a run once the part is repaired
    assert fmt.INDEX_NAME not in left and not [n for n in left if n.endswith((".tar", ".npy", ".tmp"))]
