"""``load/runs.py``: slices cut, dealt in rounds and thinned as columns give exactly what cutting
them one ``Slice`` at a time gives (the references below are the loops the columns replaced)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wdsllm.load import runs
from wdsllm.load.slices import Slice, Slices


def cut_reference(slices, counts, a, b, split):
    out, pos = [], 0
    for sl, n in zip(slices, counts):
        lo, hi = max(a, pos) - pos, min(b, pos + n) - pos
        if hi > lo:
            if lo == 0 and hi == n:
                out.append(sl)
            elif sl.pick is not None:
                out.append(Slice(sl.shard, sl.start, sl.stop, sl.stride, sl.pick[lo:hi], sl.group))
            elif not split and sl.stride == 1 and sl.stop is not None:
                out.append(Slice(sl.shard, sl.start + lo, sl.start + hi, group=sl.group))
            else:
                out.append(Slice(sl.shard, sl.start, sl.stop, sl.stride, np.arange(lo, hi), sl.group))
        pos += n
    return out


def remaining_reference(slices, counts, consumed):
    out, pos = [], 0
    for sl, n in zip(slices, counts):
        lo, hi = np.searchsorted(consumed, [pos, pos + n])
        gone = consumed[lo:hi] - pos
        if len(gone) == 0:
            out.append(sl)
        elif len(gone) < n:
            keep = np.setdiff1d(np.arange(n), gone, assume_unique=True)
            out.append(
                Slice(sl.shard, sl.start, sl.stop, sl.stride, keep if sl.pick is None else sl.pick[keep], sl.group)
            )
        pos += n
    return out


def full(sl: Slice) -> tuple:
    return (*sl.key(), sl.group)


@st.composite
def slice_runs(draw, max_slices=12):
    """Slices with their counts: plain ranges (some empty), picks and strided ones, in parts."""
    out, counts = [], []
    for _ in range(draw(st.integers(0, max_slices))):
        shard, start = draw(st.integers(0, 40)), draw(st.integers(0, 20))
        n = draw(st.integers(0, 9))
        group = draw(st.sampled_from([0, 0, 1, 2]))
        kind = draw(st.sampled_from(["range", "range", "range", "pick", "stride"]))
        if kind == "range":
            out.append(Slice(shard, start, start + n, group=group))
        elif kind == "pick":
            pick = np.sort(
                np.asarray(draw(st.lists(st.integers(0, 30), min_size=n, max_size=n, unique=True)), np.int64)
            )
            out.append(Slice(shard, start, start + 31, pick=pick, group=group))
        else:
            out.append(Slice(shard, start, start + 2 * n, stride=2, group=group))
        counts.append(n)
    return out, counts


@settings(max_examples=150, deadline=None)
@given(slice_runs(), st.data(), st.booleans())
def test_a_cut_is_the_slice_by_slice_cut(made, data, split):
    slices, counts = made
    total = sum(counts)
    a = data.draw(st.integers(0, total))
    b = data.draw(st.integers(a, total))
    got = runs.Run.of(slices, counts).cut(a, b, split)
    assert [full(s) for s in got] == [full(s) for s in cut_reference(slices, counts, a, b, split)]
    head = runs.Run.of(slices, counts).first(a)  # empty slices may stay: they hold nothing
    assert head.total == a and [full(s) for s, n in zip(head.slices, head.counts) if n] == [
        full(s) for s in cut_reference(slices, counts, 0, a, True)
    ]


@settings(max_examples=100, deadline=None)
@given(st.lists(slice_runs(max_slices=5), min_size=1, max_size=4), st.data(), st.booleans())
def test_dealing_in_rounds_is_round_after_round_run_after_run(made, data, split):
    runs_in = [runs.Run.of(s, c) for s, c in made]
    rounds = data.draw(st.integers(1, 4))
    cuts = []
    for run in runs_in:
        a = data.draw(st.integers(0, run.total))
        inner = sorted(data.draw(st.lists(st.integers(a, run.total), min_size=rounds, max_size=rounds)))
        cuts.append([a, *inner])
    got = runs.deal(runs_in, np.asarray(cuts, np.int64), split)
    want = []
    for r in range(rounds):
        for (slices, counts), row in zip(made, cuts):
            want += cut_reference(slices, counts, row[r], row[r + 1], split)
    assert [full(s) for s in got] == [full(s) for s in want]


@settings(max_examples=100, deadline=None)
@given(slice_runs(), st.data())
def test_the_remainder_leaves_out_exactly_the_consumed_positions(made, data):
    slices, counts = made
    total = sum(counts)
    consumed = np.asarray(sorted(data.draw(st.sets(st.integers(0, max(0, total - 1)), max_size=total))), np.int64)
    consumed = consumed[consumed < total]
    got = runs.remaining(runs.Run.of(slices, counts), consumed)
    assert [full(s) for s in got] == [full(s) for s in remaining_reference(slices, counts, consumed)]


def test_strands_split_by_part_then_source_in_order():
    slices = [Slice(5, 0, 3), Slice(0, 0, 2, group=1), Slice(1, 4, 6), Slice(6, 0, 1, group=1), Slice(2, 0, 9)]
    got = runs.strands(runs.Run.of(slices, [3, 2, 2, 1, 9]), lambda shards: np.asarray(shards) // 4, 2)
    assert [[[full(s) for s in run.slices] for run in part] for part in got] == [
        [[full(slices[2]), full(slices[4])], [full(slices[0])]],
        [[full(slices[1])], [full(slices[3])]],
    ]
    assert [[run.counts.tolist() for run in part] for part in got] == [[[2, 9], [3]], [[2], [1]]]


def test_taking_slices_keeps_the_kept_whole_ones_and_the_parts():
    odd = Slice(3, 0, 9, pick=np.array([1, 4]), group=2)
    run = Slices.of([Slice(1, 0, 4, group=1), odd, Slice(2, 5, 6)])
    got = run.take(np.array([2, 1]))
    assert [full(s) for s in got] == [full(Slice(2, 5, 6)), full(odd)]
    assert got.special == {1: odd} and run.is_special(np.array([0, 1, 2])).tolist() == [False, True, False]
