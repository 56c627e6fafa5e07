"""Unit tests of the pure core: a failure names the function, not a tar fixture."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wdsllm.load.batching import best_fit_decreasing
from wdsllm.load.counts import round_robin_share
from wdsllm.load.plan import split_range
from wdsllm.load.stream import StreamSpec, block_permutation, inverse_shuffle, pieces_per_doc, shuffle_lengths
from wdsllm.pack.shaping import DocGrouper, EncodedChunk, Position, RowPacker

FAST = settings(max_examples=60, deadline=None)


def spec(**kw) -> StreamSpec:
    base = dict(seed=7, epoch=2, rank=1, world=3, worker=0, workers=2, shuffle_buffer=5)
    base.update(kw)
    return StreamSpec(**base)


# ----------------------------------------------------------------------------------------------
# counts, plan, stream


@FAST
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=6), total=st.integers(0, 60))
def test_round_robin_share_is_dataloaders_order(counts, total):
    # DataLoader's order simulated one batch at a time: turns over workers that still have batches
    left, got, turn = list(counts), [0] * len(counts), 0
    for _ in range(min(total, sum(counts))):
        while left[turn] == 0:
            turn = (turn + 1) % len(counts)
        got[turn] += 1
        left[turn] -= 1
        turn = (turn + 1) % len(counts)
    assert round_robin_share(np.array(counts), total).tolist() == got


@FAST
@given(total=st.integers(0, 100), parts=st.integers(1, 9))
def test_split_range_covers_once_with_sizes_within_one(total, parts):
    ranges = [split_range(total, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_block_permutation_is_a_permutation_decided_by_its_key_alone():
    a = block_permutation(spec(), 3, 10)
    assert sorted(a.tolist()) == list(range(10))
    assert np.array_equal(a, block_permutation(spec(), 3, 10))
    for other in (spec(seed=8), spec(epoch=3), spec(rank=2), spec(worker=1)):
        assert not np.array_equal(a, block_permutation(other, 3, 10))
    assert not np.array_equal(a, block_permutation(spec(), 4, 10))
    assert np.array_equal(block_permutation(spec(world=9, workers=5), 3, 10), a)  # layout sizes do not enter


@FAST
@given(n=st.integers(0, 40), size=st.integers(0, 7))
def test_shuffle_and_its_inverse_agree(n, size):
    s = spec(shuffle_buffer=size)
    lengths = np.arange(n, dtype=np.int64) * 10
    shuffled = shuffle_lengths(lengths, s)
    assert sorted(shuffled.tolist()) == lengths.tolist()
    plan_positions = inverse_shuffle(np.arange(n, dtype=np.int64), n, s)
    assert np.array_equal(lengths[plan_positions], shuffled)


def test_pieces_per_doc():
    assert pieces_per_doc(np.array([1, 8, 9, 16, 17]), 8).tolist() == [1, 1, 2, 2, 3]


# ----------------------------------------------------------------------------------------------
# best-fit decreasing


@FAST
@given(lengths=st.lists(st.integers(1, 20), max_size=40), capacity=st.integers(20, 40))
def test_best_fit_decreasing_places_every_item_once_within_capacity(lengths, capacity):
    lengths = np.array(lengths, np.int64)
    bins = best_fit_decreasing(lengths, capacity)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(lengths[b].sum() <= capacity for b in bins)
    # no two bins could be merged: best fit leaves at most one bin at most half full
    assert sum(lengths[b].sum() * 2 <= capacity for b in bins) <= 1


def test_best_fit_decreasing_fills_the_fullest_bin_that_fits():
    # 7 opens bin 0 (room 3), 6 opens bin 1 (room 4); 3 goes to bin 0 (the fuller one that fits)
    assert best_fit_decreasing(np.array([3, 7, 6]), 10) == [[1, 0], [2]]


# ----------------------------------------------------------------------------------------------
# shaping (the packer's DocGrouper and RowPacker)


def chunk(lengths: list[int], first_line: int = 1, file: int = 0) -> EncodedChunk:
    lengths_a = np.array(lengths, np.int64)
    tokens = np.concatenate([np.full(n, i + first_line, np.uint16) for i, n in enumerate(lengths)])
    lines = np.arange(first_line, first_line + len(lengths), dtype=np.int64)
    return EncodedChunk(file, first_line, tokens, lengths_a, lines)


def test_doc_grouper_keeps_documents_whole_and_splits_only_the_long_ones():
    grouper = DocGrouper(sample_tokens=10, max_doc_tokens=6, dtype=np.dtype(np.uint16))
    groups = grouper.feed(chunk([4, 13, 2, 5])) + grouper.finish()
    lengths = np.concatenate([g.lengths for g in groups])
    assert lengths.tolist() == [4, 6, 6, 1, 2, 5]  # 13 became pieces of 6, 6 and 1
    assert np.concatenate([g.pieces for g in groups]).tolist() == [0, 0, 1, 2, 0, 0]
    assert np.concatenate([g.lines for g in groups]).tolist() == [1, 2, 2, 2, 3, 4]
    assert np.array_equal(np.concatenate([g.tokens for g in groups]), chunk([4, 13, 2, 5]).tokens)
    assert groups[-1].position == Position(0, 4, 0, 0, True)


def test_doc_grouper_resumes_after_its_position():
    whole = DocGrouper(10, None, np.dtype(np.uint16))
    groups = whole.feed(chunk([4, 3, 5, 6, 2])) + whole.finish()
    at = groups[0].position
    resumed = DocGrouper(10, None, np.dtype(np.uint16), resume=at)
    rest = resumed.feed(chunk([4, 3, 5, 6, 2])) + resumed.finish()
    assert np.array_equal(np.concatenate([g.tokens for g in rest]), np.concatenate([g.tokens for g in groups[1:]]))


def test_row_packer_cuts_one_stream_into_rows_and_marks_document_starts():
    packer = RowPacker(seq_len=4, rows_per_group=2, dtype=np.dtype(np.uint16))
    groups = packer.feed(chunk([3, 6, 2])) + packer.finish()
    assert np.array_equal(np.concatenate([g.tokens for g in groups]), chunk([3, 6, 2]).tokens)
    assert [g.rows for g in groups] == [2, 1]
    assert groups[0].starts.tolist() == [0, 3]  # documents 1 and 2 start in the first group
    assert groups[1].starts.tolist() == [1]  # document 3 starts one token into the third row
    assert sum(g.rows for g in groups) == -(-11 // 4)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    seq_len=st.integers(4, 64),
    picks=st.lists(st.integers(0, 1000), min_size=1, max_size=6),
)
def test_segment_lengths_from_the_batcher_match_the_row_layout(lengths, seq_len, picks):
    """The token counts a batcher records per segment (``seg_lens``, what a mixture's per-source
    count reads) equal what the segment table's offsets and the rows' lengths say, for rows packed
    whole (pack) and cut at seq_len (concat), after selection and compaction."""
    from wdsllm.load.batching.concat import _cut_rows
    from wdsllm.load.batching.pack import _rows_block
    from wdsllm.load.block import Block
    from wdsllm.load.mixplan import Mixing
    from wdsllm.load.mixstats import block_sources

    lens = np.asarray(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    docs = Block(np.arange(int(lens.sum()), dtype=np.uint16), starts, lens, np.arange(len(lens), dtype=np.int64))
    fits = [i for i in range(len(lens)) if lens[i] <= seq_len]
    bins = best_fit_decreasing(lens[fits], seq_len) if fits else []
    packed = [_rows_block(docs, [np.asarray(fits, np.int64)[b] for b in bins])] if fits else []
    cut = [_cut_rows(docs, seq_len, max(1, int(lens.sum()) // seq_len))[0]]
    mixing = Mixing((0, 1))
    for rows in packed + cut:
        sel = np.unique(np.asarray(picks) % len(rows))
        for block in (rows, rows.take(sel), rows.take(sel).compact()):
            assert block.seg_lens is not None
            _, with_lens = block_sources(block, mixing, "docs")
            _, from_layout = block_sources(dataclasses.replace(block, seg_lens=None), mixing, "docs")
            assert with_lens.tolist() == from_layout.tolist()
            assert int(with_lens.sum()) == int(block.lengths.sum())


@FAST
@given(
    st.lists(st.integers(0, 300), min_size=513, max_size=900),
    st.integers(0, 2**32 - 1),
)
def test_gather_tokens_joins_items_in_order_by_slices_or_by_index(lengths, seed):
    """Blocks of more than 512 items join their tokens by a slice per item or, for tiny items, by
    a token index (GATHER_BY_SLICES): the same tokens either way, in item order."""
    from wdsllm.load import block as blockmod

    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    tokens = rng.integers(0, 60_000, int(lengths.sum()) + 1000, dtype=np.uint16)
    starts = rng.integers(0, 1000, len(lengths)) + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    starts = starts[rng.permutation(len(starts))]  # in shuffled order, as a window holds them
    lengths = np.minimum(lengths, len(tokens) - starts)
    block = blockmod.Block(tokens, starts, lengths, np.arange(len(lengths), dtype=np.int64))
    want = np.concatenate([tokens[a : a + n] for a, n in zip(starts.tolist(), lengths.tolist())])
    assert np.array_equal(block.gather_tokens(), want)
    old = blockmod.GATHER_BY_SLICES
    try:
        for threshold in (1, 10**9):  # every block by slices, every block by index
            blockmod.GATHER_BY_SLICES = threshold
            assert np.array_equal(block.gather_tokens(), want)
    finally:
        blockmod.GATHER_BY_SLICES = old


@FAST
@given(st.lists(st.integers(0, 50), max_size=40), st.integers(1, 500), st.integers(1, 60))
def test_concat_cuts_are_the_sorted_unique_of_starts_and_row_edges(lengths, limit, seq_len):
    from wdsllm.load.batching.concat import _sorted_unique

    ends = np.cumsum(np.asarray(lengths, np.int64))
    starts = ends - np.asarray(lengths, np.int64)
    merged = np.concatenate([starts[starts < limit], np.arange(0, limit, seq_len)]).astype(np.int64)
    assert np.array_equal(_sorted_unique(merged.copy()), np.unique(merged))
