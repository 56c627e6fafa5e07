"""A million shards opened at the cost of a thousand (issue #44): what a consumer reads is planned
as columns, not one object per shard; pieces of documents are counted in one pass over the
lengths; large side files are scanned a chunk at a time, each chunk checked; the shard table is
checked by its chunk digests and never changes once read.

Each test holds the fast path to the answer the one-by-one path gives (the reference written out
here), on random inputs and on real datasets.
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synth import write_dataset

import wdsllm
from wdsllm import format as fmt
from wdsllm.format.side import SideArray
from wdsllm.load import counts as countsmod
from wdsllm.load import plan as planmod
from wdsllm.load.block import pieces_per_doc
from wdsllm.load.config import Config
from wdsllm.load.plan import Slice, Slices, epoch_layout, slices_of_range
from wdsllm.load.sources.lengths import range_pieces
from wdsllm.load.sources.open import open_source
from wdsllm.load.stream import counts_known, slice_item_counts, slice_item_lengths

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import scale_data  # noqa: E402 - the builder of tools/bench_scale.py

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def slices_one_by_one(order, counts, ends, a, b, firsts=None) -> list[Slice]:
    """The reference: items [a, b) of the blocks in ``order``, a slice per block touched."""
    out = []
    i = int(np.searchsorted(ends, a, side="right"))
    while i < len(order) and a < b:
        start = int(ends[i] - counts[i])
        lo, hi = a - start, min(b, int(ends[i])) - start
        first = 0 if firsts is None else int(firsts[i])
        if hi > lo:
            out.append(Slice(int(order[i]), first + lo, first + hi))
        a = start + hi
        i += 1
    return out


@SETTINGS
@given(
    counts=st.lists(st.integers(0, 6), min_size=0, max_size=40),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    with_firsts=st.booleans(),
    seed=st.integers(0, 100),
)
def test_a_share_is_columns_equal_to_the_slices_one_by_one(counts, cut, with_firsts, seed):
    counts = np.asarray(counts, np.int64)
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    a, b = sorted(int(x * total) for x in cut)
    order = np.random.default_rng(seed).permutation(len(counts))
    firsts = np.random.default_rng(seed).integers(0, 5, len(counts)) if with_firsts else None
    got = slices_of_range(order, counts, ends, a, b, firsts)
    assert isinstance(got, Slices) and not got.special
    assert got == slices_one_by_one(order, counts, ends, a, b, firsts)
    assert list(got) == slices_one_by_one(order, counts, ends, a, b, firsts)


def test_slices_join_keep_their_odd_ones_and_compare_as_lists():
    plain = Slices(np.array([4, 2]), np.array([0, 3]), np.array([5, 9]))
    odd = [Slice(7, 1, 2, pick=np.array([0, 2])), Slice(1, 0, None)]
    joined = plain + odd
    assert len(joined) == 4 and sorted(joined.special) == [2, 3]
    assert joined == [Slice(4, 0, 5), Slice(2, 3, 9), *odd] and joined[-1].stop is None
    assert joined[1:3] == [Slice(2, 3, 9), odd[0]] and list(joined[::2]) == [Slice(4, 0, 5), odd[0]]
    assert odd + plain == [*odd, *plain] and Slices.of(joined) is joined
    assert Slices.of([Slice(3, 2, 8)]).special == {}  # a plain range goes to the columns


@SETTINGS
@given(
    lengths=st.lists(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 16, 17, 40]), min_size=1, max_size=80),
    bounds=st.lists(st.integers(0, 80), min_size=0, max_size=12),
    max_len=st.sampled_from([1, 3, 8]),
    step=st.integers(1, 9),
    overlap=st.booleans(),
)
def test_pieces_of_ranges_equal_the_pieces_of_their_documents(lengths, bounds, max_len, step, overlap):
    values = np.asarray(lengths, np.uint32)
    cuts = sorted(min(len(values), x) for x in bounds)
    a, b = np.asarray(cuts[0::2][: len(cuts) // 2], np.int64), np.asarray(cuts[1::2], np.int64)
    if overlap and len(a):
        a, b = np.r_[a, 0], np.r_[b, len(values)]  # a range over all the others
    shuffled = np.random.default_rng(len(a)).permutation(len(a))
    a, b = a[shuffled], b[shuffled]

    def chunks(lo, hi):  # small steps: documents of interest on every side of a step's edge
        for at in range(lo, hi, step):
            yield at, values[at : min(hi, at + step)]

    want = [int(pieces_per_doc(values[x:y].astype(np.int64), max_len).sum()) for x, y in zip(a, b)]
    assert range_pieces(chunks, a, b, max_len).tolist() == want


def pieces_one_by_one(values: np.ndarray, a: np.ndarray, b: np.ndarray, max_len: int) -> list[int]:
    """The reference: ``pieces_per_doc`` of every range's documents, summed range by range."""
    return [int(pieces_per_doc(values[x:y].astype(np.int64), max_len).sum()) for x, y in zip(a, b)]


@SETTINGS
@given(
    lengths=st.lists(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 16, 17, 40]), min_size=0, max_size=80),
    pairs=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 80)), max_size=12),
    cuts=st.lists(st.integers(0, 80), max_size=12),
    max_len=st.sampled_from([1, 3, 8, 40]),
    step=st.integers(1, 9),
    dtype=st.sampled_from([np.uint32, np.int64]),
)
def test_pieces_of_any_ranges_equal_the_pieces_of_their_documents(lengths, pairs, cuts, max_len, step, dtype):
    """Ranges in any order that overlap, nest, touch, repeat or are empty (b <= a), and ranges one
    after another along the file (a dataset's shards in order, counted as one span); documents
    empty, of exactly max_len and longer, on every side of a chunk's edge."""
    values = np.asarray(lengths, dtype)
    n = len(values)

    def chunks(lo, hi):
        for at in range(lo, hi, step):
            yield at, values[at : min(hi, at + step)]

    a = np.asarray([min(n, x) for x, _ in pairs], np.int64)
    b = np.asarray([min(n, y) for _, y in pairs], np.int64)
    assert range_pieces(chunks, a, b, max_len).tolist() == pieces_one_by_one(values, a, b, max_len)
    edges = np.asarray(sorted({0, n, *(min(n, x) for x in cuts)}), np.int64)
    a, b = edges[:-1], edges[1:]  # the file cut into consecutive ranges
    assert range_pieces(chunks, a, b, max_len).tolist() == pieces_one_by_one(values, a, b, max_len)


def test_a_scan_maps_windows_at_any_chunk_size_and_counts_pieces_across_them(tmp_path, monkeypatch):
    """Chunks of a side file that are no multiple of a page and windows of a few chunks: every
    window's map starts at a page, and pieces of ranges across windows and chunks are counted
    as one by one."""
    monkeypatch.setattr("wdsllm.format.side.READ_BYTES", 3 * 4096)  # windows of 12,200 bytes
    rng = np.random.default_rng(3)
    values = rng.choice(np.array([0, 1, 5, 8, 9, 30], np.uint32), 20_000)
    path, ref = _side_file(tmp_path, values, chunk_bytes=100)
    side = SideArray(str(path), ref, path=str(path))
    got = [(first, part.copy()) for first, part in side.scan(7, 19_990)]
    assert np.array_equal(np.concatenate([p for _, p in got]), values[7:19_990]) and len(got) == 7
    cuts = np.sort(rng.integers(0, len(values), 300))
    for a, b in [(cuts[:-1], cuts[1:]), (cuts[::2], cuts[::-2])]:
        assert range_pieces(side.scan, a, b, 8).tolist() == pieces_one_by_one(values, a, b, 8)


def _side_file(tmp_path: Path, values: np.ndarray, chunk_bytes: int) -> tuple[Path, fmt.SideFile]:
    path = tmp_path / "values.npy"
    data = fmt.npy_bytes(values)
    path.write_bytes(data)
    chunks = tuple(fmt.chunk_digest(data[x : x + chunk_bytes]) for x in range(0, len(data), chunk_bytes))
    return path, fmt.SideFile("values.npy", len(data), hashlib.sha256(data).hexdigest(), chunks, chunk_bytes)


def test_a_scan_reads_the_values_and_checks_every_chunk_it_reads(tmp_path):
    values = np.random.default_rng(0).integers(0, 1 << 30, 5000).astype(np.uint32)
    path, ref = _side_file(tmp_path, values, chunk_bytes=256)
    side = SideArray(str(path), ref, path=str(path))
    for a, b in [(0, 5000), (3, 4), (63, 1900), (4990, 6000), (70, 70)]:
        got = [(first, part.copy()) for first, part in side.scan(a, b)]
        assert np.array_equal(np.concatenate([p for _, p in got]) if got else [], values[a:b])
        assert [first for first, _ in got] == [a + sum(len(p) for _, p in got[:k]) for k in range(len(got))]
    assert all(side._checked)  # every chunk read was checked

    data = bytearray(path.read_bytes())
    data[2000] ^= 1  # in chunk 7 (bytes 1792-2048): elements 466-529
    path.write_bytes(bytes(data))
    changed = SideArray(str(path), ref, path=str(path))
    assert sum(len(p) for _, p in changed.scan(1000, 1200)) == 200  # chunks 16-19: untouched
    with pytest.raises(fmt.FormatError, match="bytes 1792-2048 do not match"):
        list(changed.scan(400, 500))


def test_the_shard_table_is_read_only_and_keeps_its_totals(tmp_path):
    root = tmp_path / "base"
    write_dataset(root, [7, 3, 5])
    index, _ = fmt.read_index(str(root))
    assert index.totals() == {
        "shards": 3,
        "samples": 4,  # groups of 5 documents
        "documents": 15,
        "tokens": index.tokens,
        "bytes": index.shards.total("bytes"),
    }
    with pytest.raises(ValueError, match="read-only"):
        index.shards.column("documents")[0] = 1
    table = fmt.ShardTable(np.zeros((2, len(fmt.SHARD_COLUMNS)), np.int64), prefix="shard")
    with pytest.raises(ValueError, match="read-only"):
        table.columns[0, 0] = 1


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> Path:
    """12,000 shards (a shard table in shards.npy), documents of 1 to 60 tokens."""
    base = tmp_path_factory.mktemp("base")
    write_dataset(base, [9], seed=4, max_len=60, group_docs=4)
    root = tmp_path_factory.mktemp("many") / "ds"
    scale_data.build(str(base), str(root), 12_000)
    return root


def test_a_plan_of_many_shards_is_columns_and_counts_as_one_by_one(many_shards):
    source = open_source(str(many_shards))
    assert source.index.shards_file is not None and not source.index.shards.column("tokens").flags.writeable
    for max_len in (None, 16):
        cfg = Config(batch_size=4, max_len=max_len, seed=3)
        spec = cfg.spec(0, 0, 1, 0, 1)
        slices = planmod.slices_for(source, cfg, spec)
        assert isinstance(slices, Slices) and len(slices) == 12_000 and not slices.special
        assert counts_known(source, slices, spec)
        counts = slice_item_counts(source, slices, spec)
        one_by_one = [len(slice_item_lengths(source, [sl], spec)) for sl in slices[:500]]
        assert counts[:500] == one_by_one and sum(counts) == len(slice_item_lengths(source, slices, spec))


def test_the_tokens_of_a_shards_first_documents_read_only_the_shards_cut(many_shards):
    """A share's edge inside a shard reads lengths (from the nearer end); a shard taken whole or
    not at all reads none, its tokens are the index's."""
    source = open_source(str(many_shards))
    rng = np.random.default_rng(5)
    shards = rng.integers(0, len(source.urls), 400)
    k = np.minimum(source.items_per_shard[shards], rng.integers(0, 12, 400))  # none, some or all of 9
    got, read = countsmod.head_tokens(source, shards, k)
    assert got.tolist() == [int(source.lengths().of_unit(int(s), 0, int(j)).sum()) for s, j in zip(shards, k)]
    assert len(read) == int(((k > 0) & (k < source.items_per_shard[shards])).sum())


@pytest.mark.parametrize("max_len", [None, 16])
def test_the_tokens_of_every_share_are_its_items_lengths_summed(many_shards, tmp_path, max_len, monkeypatch):
    """Every (rank, worker)'s tokens from the index and the lengths at its edges, where blocks are
    whole shards (12,000 of them) and where they cut shards (6), equal its items' lengths summed."""
    monkeypatch.setattr(planmod, "MIN_BLOCK_TOKENS", 64)  # blocks of a few documents where shards are few
    few = tmp_path / "few"
    write_dataset(few, [130, 2, 170, 90, 1, 110], seed=2, max_len=60, group_docs=3)
    for root in (many_shards, few):
        source = open_source(str(root))
        cfg = Config(batch_size=4, max_len=max_len, seed=3)
        spec = cfg.spec(0, 0, 3, 0, 2)
        layout = planmod.source_layout(source, cfg, spec)
        assert layout.whole == (root == many_shards)
        tokens, _ = countsmod._share_tokens(source, layout, max_len)
        for r in range(3):
            for w in range(2):
                items = slice_item_lengths(source, layout.slices(r, w), cfg.spec(0, r, 3, w, 2))
                assert tokens[r, w] == int(np.sum(items)), (root, r, w)


@pytest.mark.parametrize("world,workers", [(1, 1), (3, 2), (7, 1)])
def test_pieces_shares_cover_the_epochs_pieces_in_order(tmp_path, world, workers):
    """Documents split at max_len: the consumers' shares, end to end, are the epoch's pieces in
    its block order, each once, whatever the blocks between a share's edges."""
    root = tmp_path / "ds"
    write_dataset(root, [13, 2, 17, 9, 1, 11], seed=1, max_len=30, group_docs=3)
    source = open_source(str(root))
    cfg = Config(batch_size=2, max_len=7, seed=5)
    spec = cfg.spec(0, 0, world, 0, workers)
    pieces = planmod.piece_counter(source, spec)
    layout = epoch_layout(source.items_per_shard, seed=5, epoch=0, world=world, workers=workers, doc_pieces=pieces)
    lengths = source.lengths()
    blocks = zip(layout.order.tolist(), layout.firsts.tolist(), layout.counts.tolist())
    docs = np.concatenate([lengths.of_unit(s, f, f + n) for s, f, n in blocks])
    expected = [min(7, d - k) for d in docs.tolist() for k in range(0, d, 7)]  # a document's pieces in order
    shares = [
        slice_item_lengths(source, layout.slices(r, w), cfg.spec(0, r, world, w, workers))
        for r in range(world)
        for w in range(workers)
    ]
    assert np.array_equal(np.concatenate(shares), expected)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_the_epochs_pieces_are_counted_by_the_loader_not_by_each_of_its_workers(tmp_path, monkeypatch):
    """The pass over every document's length that finds where each share of pieces begins is
    made in the loader's process before its DataLoader workers start (forked, they inherit it),
    not once in every worker. (A rank's last worker still counts the other workers' shares, to
    find the tails handed to it, once it reaches them.)"""
    root = tmp_path / "ds"
    info = write_dataset(root, [13, 2, 17, 9, 1, 11], seed=1, max_len=60, group_docs=3)
    documents = len(info["expect"])
    passes = tmp_path / "passes"

    def noted(chunks, a, b, max_len):  # range_pieces, noting the process and the documents it covers
        with open(passes, "a") as f:
            f.write(f"{os.getpid()} {int(np.maximum(np.asarray(b) - np.asarray(a), 0).sum())}\n")
        return range_pieces(chunks, a, b, max_len)

    monkeypatch.setattr("wdsllm.load.sources.lengths.range_pieces", noted)
    opts = dict(rank=0, world_size=1, batching="pack", seq_len=8, batch_size=2, seed=4)
    with wdsllm.loader(str(root), num_workers=2, multiprocessing_context="fork", **opts) as ld:
        assert all(sum(1 for _ in ld) == len(ld) for _ in range(2))
    found = [line.split() for line in passes.read_text().splitlines()]
    whole = [pid for pid, covered in found if int(covered) == documents]
    assert whole and set(whole) == {str(os.getpid())}, found


def test_the_exact_count_begins_once_the_first_batch_is_out(tmp_path):
    """Pack batches are counted exactly by a pass in the background; it never runs beside the
    first batch (whose CPU time it would share), and a worker past its bound still gets it."""
    root = tmp_path / "ds"
    write_dataset(root, [40, 25, 33], seed=2, max_len=50)
    ld = wdsllm.loader(str(root), rank=0, world_size=2, batching="pack", seq_len=32, batch_size=2, seed=1)
    limits = ld.source.limits(0, 1)
    assert not limits.ready() and limits.counts._job._pid is None  # made, not started
    it = iter(ld)
    next(it)
    job = ld.limits.counts._job
    assert job._pid == os.getpid()  # started once the batch was out
    assert sum(1 for _ in it) + 1 == ld.limits.per_rank

    limit = countsmod.EpochCounts.create(open_source(str(root)), ld.cfg, 0, 2, 1)
    held = countsmod.EpochLimits(limit, 0, 1).worker_limit(0)
    assert limit._job._pid is None and held.value() == ld.limits.per_worker[0]  # asked: counted then


def test_the_epochs_blocks_are_kept_for_the_plan_and_let_go_with_their_dataset(many_shards):
    source = open_source(str(many_shards))
    items, tokens = source.items_per_shard, source.tokens_per_shard
    blocks = planmod.epoch_blocks(items, tokens, 3, 0, True)
    assert planmod.epoch_blocks(items, tokens, 3, 0, True) is blocks  # the counts', then the plan's
    ends = blocks.piece_ends(planmod.DocPieces(source.lengths(), 16))  # kept with the blocks
    assert blocks.piece_ends(planmod.DocPieces(source.lengths(), 16)) is ends
    assert not ends.flags.writeable and int(ends[-1]) == pieces_per_doc(source.lengths().whole() + 0, 16).sum()
    assert planmod.epoch_blocks(items, tokens, 3, 1, True) is not blocks  # another epoch
    assert planmod.epoch_blocks(np.array(items), tokens, 3, 1, True) is not planmod.epoch_blocks(
        np.array(items), tokens, 3, 1, True
    )  # arrays that may change are not kept
    del source, items, tokens, blocks, ends
    gc.collect()
    assert planmod._recent_blocks.kept is None  # nothing holds the dataset's table any more
