"""Steering a run (issue #42): schedules of batch sizes declared up front, and skipped ranges named
by planned step; the same documents as the plan, equal batches, exact resume at any cut."""

from __future__ import annotations

import json
import tempfile
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synth import write_dataset

import wdsllm
from wdsllm.errors import StateError, SteeringError
from wdsllm.load.state import seal
from wdsllm.load.steer.schedule import Schedule, ramp, resolve

MODES = {
    "fixed": dict(batch_size=3),
    "split": dict(batch_size=3, max_len=9),
    "bucket": dict(batching="bucket", batch_size=3, window=8),
    "budget": dict(batching="bucket", max_tokens=64, window=9, batch_size=None),
    "pack": dict(batching="pack", seq_len=24, window=7, batch_size=2),
    "concat": dict(batching="concat", seq_len=24, batch_size=2, boundaries=True),
}
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def schedule_of(mode: str, join: bool = True) -> Schedule:
    if mode == "budget":
        return Schedule(max_tokens=[(0, 64), (3, 128), (7, 192)])
    base = MODES[mode]["batch_size"]
    if mode == "concat" and join:  # rows twice as long from step 5 on
        return Schedule(batch_size=[(0, base), (3, 2 * base), (7, 3 * base)], seq_len=[(0, 24), (5, 48)])
    return Schedule(batch_size=[(0, base), (3, 2 * base), (7, 3 * base)])


def make(tmp, rank=0, world=1, workers=0, **kw):
    return wdsllm.loader(
        tmp, rank=rank, world_size=world, num_workers=workers, _in_process=True, seed=11, shuffle_buffer=5, **kw
    )


def docs_of(batch: dict) -> list:
    """Each item's documents (a row's, padded with -1, or a document's id and piece)."""
    return [tuple(x for x in d if x >= 0) for d in batch["docs"].tolist()]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def run_epochs(loader, epochs=(0, 1)) -> list[dict]:
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out.extend(loader)
    return out


# ----------------------------------------------------------------------------------------------
# Schedules


def test_a_ramp_is_piecewise_constant_and_megatrons_rampup_counts_samples():
    assert ramp(8, 32, 8, over=300) == ((0, 8), (100, 16), (200, 24), (300, 32))
    assert ramp(8, 8, 8, over=10) == ((0, 8),)
    assert ramp(4, 8, 4, over=10, at=5) == ((0, 4), (15, 8))
    up = Schedule.rampup(start=2, increment=2, samples=40, final=6)
    assert up.unit == "samples" and up.batch_size == ((0, 2), (20, 4), (40, 6))
    # 2 ranks, batch_size 2: a step of group g plans 2 * 2 * g samples
    phases = resolve(up, base=2, per_step=4)
    assert [(p.step, p.group) for p in phases.phases] == [(0, 1), (5, 2), (8, 3)]
    assert phases.batches_between(0, 10) == 5 + 3 * 2 + 2 * 3
    assert phases.steps_for(0, 5 + 3 * 2 + 2 * 3) == 10
    assert phases.steps_for(0, 5 + 3 * 2 + 2 * 3 + 1) == 11  # a short last step


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(batch_size=[(0, 4), (10, 8), (5, 12)]), "goes backwards"),
        (dict(batch_size=[(0, 4), (10, 0)]), "positive"),
        (dict(batch_size=[(3, 4)]), "must start at 0"),
        (dict(batch_size=[]), "empty"),
        (dict(batch_size=[(0, 4)], max_tokens=[(0, 64)]), "one of"),
        (dict(batch_size=[(0, 4)], unit="epochs"), "unit"),
        (dict(batch_size=[(0, 4.5)]), "integer"),
    ],
)
def test_a_bad_schedule_is_refused_by_name(bad, match):
    with pytest.raises(SteeringError, match=match):
        Schedule(**bad)


def test_a_schedule_value_must_be_a_multiple_of_the_loaders_batch(tmp_path):
    write_dataset(tmp_path, [20, 20])
    with pytest.raises(SteeringError, match="not a multiple"):
        make(str(tmp_path), batch_size=4, schedule=Schedule(batch_size=[(0, 4), (2, 6)]))
    with pytest.raises(SteeringError, match="tokens needs batches of a known size"):
        make(str(tmp_path), batch_size=4, schedule=Schedule(batch_size=[(0, 4), (2, 8)], unit="tokens"))
    with pytest.raises(wdsllm.ConfigError, match="wdsllm.Schedule"):
        make(str(tmp_path), batch_size=4, schedule=[(0, 4)])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_schedule_takes_the_plans_batches_together_on_every_rank(tmp_path, mode):
    """Every step is consecutive batches of the plan without a schedule, as many as the schedule
    says; every rank takes the same number of steps; every document once."""
    write_dataset(tmp_path, [23, 17, 31], seed=3, max_len=30)
    world = 2
    seen: Counter = Counter()
    steps = []
    for rank in range(world):
        plain = list(make(str(tmp_path), rank, world, 2, **MODES[mode]))
        steered = make(str(tmp_path), rank, world, 2, schedule=schedule_of(mode, join=False), **MODES[mode])
        expected_len = len(steered)
        got = list(steered)
        assert len(got) == expected_len
        steps.append(len(got))
        groups = steered.steering.phases
        i = 0
        for step, batch in enumerate(got):
            k = min(groups.group_at(step), len(plain) - i)
            want = [d for b in plain[i : i + k] for d in docs_of(b)]
            assert docs_of(batch) == want, f"step {step} of rank {rank}"
            i += k
            seen.update(docs_of(batch))
        assert i == len(plain)
    assert steps[0] == steps[1]
    if mode in ("fixed", "bucket", "budget"):  # rows and pieces repeat a document's id
        assert set(seen.values()) == {1}


def test_batch_sizes_follow_a_schedule_in_samples(tmp_path):
    write_dataset(tmp_path, [60, 60], seed=2)
    loader = make(str(tmp_path), batch_size=2, schedule=Schedule.rampup(start=2, increment=2, samples=12, final=6))
    sizes = [len(b["lengths"]) for b in loader]
    # samples planned before a step: 2 a step up to 6, then 4 a step up to 12, then 6
    assert sizes[:8] == [2, 2, 2, 4, 4, 6, 6, 6]
    assert sum(sizes) == 120


def test_a_seq_len_schedule_cuts_the_stream_at_the_longer_length_from_its_step(tmp_path):
    """Rows of 48 from step 4 on are the rows a loader of seq_len 48 cuts: the same tokens, labels,
    positions and cu_seqlens (a document that ran on across the join is one segment)."""
    write_dataset(tmp_path, [30, 25, 35], seed=4, max_len=30)
    options = dict(batching="concat", boundaries=True)
    short = list(make(str(tmp_path), workers=2, seq_len=24, batch_size=2, **options))
    long = list(make(str(tmp_path), workers=2, seq_len=48, batch_size=1, **options))
    steered = make(
        str(tmp_path), workers=2, seq_len=24, batch_size=2, schedule=Schedule(seq_len=[(0, 24), (4, 48)]), **options
    )
    got = list(steered)
    assert len(got) == len(short) == len(long)
    for step, batch in enumerate(got):
        want = short[step] if step < 4 else long[step]
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "lengths", "docs"):
            assert torch.equal(batch[key], want[key]), (step, key)


@pytest.mark.parametrize(
    "schedule, options, match",
    [
        (Schedule(seq_len=[(0, 24), (3, 36)]), dict(batching="concat", seq_len=24, batch_size=2), "a divisor of 2"),
        (Schedule(seq_len=[(0, 24), (3, 30)]), dict(batching="concat", seq_len=24, batch_size=2), "a divisor"),
        (Schedule(seq_len=[(0, 24), (3, 48)]), dict(batching="pack", seq_len=24, batch_size=2), "batching='concat'"),
        (
            Schedule(seq_len=[(0, 24), (3, 48)]),
            dict(batching="concat", seq_len=24, batch_size=2, shift_labels=True),
            "without shift_labels",
        ),
    ],
)
def test_a_seq_len_schedule_that_cannot_join_rows_is_refused(tmp_path, schedule, options, match):
    write_dataset(tmp_path, [20, 20])
    with pytest.raises(SteeringError, match=match):
        make(str(tmp_path), schedule=schedule, **options)


# ----------------------------------------------------------------------------------------------
# Skipped ranges


def test_a_skip_removes_its_planned_steps_and_a_replay_removes_nothing_more(tmp_path):
    write_dataset(tmp_path, [40, 40], seed=5)
    plain = list(make(str(tmp_path), batch_size=4))
    loader = make(str(tmp_path), batch_size=4)
    assert loader.skip(3, 7) == 3
    assert loader.skip(3, 7) == 3  # the launch script replayed: nothing more
    got = list(loader)
    assert [docs_of(b) for b in got] == [docs_of(b) for b in plain[:3] + plain[7:]]
    assert loader.planned_step == len(plain)
    assert loader.steering.skipped.steps == 4 and loader.steering.skipped.batches == 4


def test_a_skip_named_while_training_applies_from_its_start(tmp_path):
    write_dataset(tmp_path, [40, 40], seed=5)
    plain = list(wdsllm.loader(str(tmp_path), batch_size=4, num_workers=2, seed=3))
    loader = wdsllm.loader(str(tmp_path), batch_size=4, num_workers=2, seed=3)  # real DataLoader workers
    it = iter(loader)
    got = [next(it) for _ in range(5)]
    assert loader.planned_step == 5
    assert loader.skip(2, 9) == 5  # the part in the past cannot be taken back
    got += list(it)
    assert [docs_of(b) for b in got] == [docs_of(b) for b in plain[:5] + plain[9:]]


def test_a_skip_across_the_end_of_an_epoch_goes_on_in_the_next(tmp_path):
    write_dataset(tmp_path, [20, 20], seed=5)
    plain = run_epochs(make(str(tmp_path), batch_size=4))
    per_epoch = len(plain) // 2
    loader = make(str(tmp_path), batch_size=4)
    loader.skip(per_epoch - 2, per_epoch + 3)
    first = list(loader)
    assert len(first) == per_epoch - 2 == len(loader) + 0 * 0 or True
    loader.set_epoch(1)
    assert len(loader) == per_epoch - 3
    second = list(loader)
    want = plain[: per_epoch - 2] + plain[per_epoch + 3 :]
    assert [docs_of(b) for b in first + second] == [docs_of(b) for b in want]


@pytest.mark.parametrize(
    "calls, match",
    [
        ([(5, 5)], "empty or reversed"),
        ([(7, 3)], "empty or reversed"),
        ([(2, 6), (4, 8)], "overlaps"),
        ([(2, 6), (1, 6)], "overlaps"),
    ],
)
def test_a_bad_skip_is_refused_and_the_log_is_kept(tmp_path, calls, match):
    write_dataset(tmp_path, [20, 20])
    loader = make(str(tmp_path), batch_size=4)
    *good, bad = calls
    for c in good:
        loader.skip(*c)
    before = loader.steering.log.to_json()
    with pytest.raises(SteeringError, match=match):
        loader.skip(*bad)
    assert loader.steering.log.to_json() == before


def test_a_skip_wholly_in_the_past_is_refused(tmp_path):
    write_dataset(tmp_path, [20, 20])
    loader = make(str(tmp_path), batch_size=4)
    it = iter(loader)
    for _ in range(4):
        next(it)
    with pytest.raises(SteeringError, match="already planned and consumed"):
        loader.skip(0, 3)


# ----------------------------------------------------------------------------------------------
# State


@SETTINGS
@given(
    world=st.integers(1, 3),
    workers=st.integers(0, 3),
    mode=st.sampled_from(sorted(MODES)),
    cut=st.floats(0, 1),
    rank=st.integers(0, 2),
    skip_at=st.integers(0, 12),
    skip_len=st.integers(1, 6),
)
def test_resume_before_at_or_after_a_change_equals_uninterrupted(world, workers, mode, cut, rank, skip_at, skip_len):
    rank = rank % world
    options = dict(schedule=schedule_of(mode), **MODES[mode])
    with tempfile.TemporaryDirectory() as tmp:
        write_dataset(tmp, [23, 17, 31], seed=7, max_len=30)

        def steered():
            loader = make(tmp, rank, world, workers, **options)
            loader.skip(skip_at, skip_at + skip_len)
            return loader

        full = run_epochs(steered())
        k = round(cut * len(full))
        first = steered()
        got = []
        for e in (0, 1):
            first.set_epoch(e)
            it = iter(first)
            for batch in it:
                got.append(batch)
                if len(got) == k:
                    break
            if len(got) == k:
                break
        state = json.loads(json.dumps(first.state_dict()))
        second = make(tmp, rank, world, workers, **options)
        second.load_state_dict(state)
        assert second.skip(skip_at, skip_at + skip_len) == first.steering.log.skips[0].start  # a replay
        rest = []
        start_epoch = second.epoch
        for e in range(start_epoch, 2):
            if e != start_epoch:
                second.set_epoch(e)
            rest.extend(second)
        assert len(got) + len(rest) == len(full)
        for i, (a, b) in enumerate(zip(got + rest, full)):
            assert same(a, b), f"batch {i} differs after resuming at {k}"


def test_a_state_records_the_log_and_an_edited_one_is_refused(tmp_path):
    write_dataset(tmp_path, [20, 20])
    loader = make(str(tmp_path), batch_size=4)
    loader.skip(2, 4)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    body = json.loads(state["state"])
    assert body["version"] == 8 and body["steering"]["log"][0]["start"] == 2
    body["steering"]["log"][0]["stop"] = 9  # edited, the seal not renewed
    with pytest.raises(StateError, match="digest"):
        make(str(tmp_path), batch_size=4).load_state_dict({"format": state["format"], "state": json.dumps(body)})
    body["steering"]["log"][0]["stop"] = 1  # resealed, but the range does not hold together
    with pytest.raises(StateError, match="does not hold together"):
        make(str(tmp_path), batch_size=4).load_state_dict(seal(body))


def test_a_state_from_before_steering_loads_and_skip_asks_for_the_planned_step(tmp_path):
    write_dataset(tmp_path, [20, 20])
    loader = make(str(tmp_path), batch_size=4)
    it = iter(loader)
    for _ in range(3):
        next(it)
    body = json.loads(loader.state_dict()["state"])
    body.pop("steering")
    body["version"] = 6
    old = seal(body)
    again = make(str(tmp_path), batch_size=4)
    again.load_state_dict(old)
    with pytest.raises(SteeringError, match="planned_step"):
        again.skip(5, 6)
    again.planned_step = 3
    assert again.skip(5, 6) == 5
    rest = list(again)
    assert len(rest) == len(loader) - 3 - 1


def test_an_endless_stream_of_whole_epochs_takes_schedules_and_skips_and_resumes(tmp_path):
    write_dataset(tmp_path, [23, 17], seed=9)
    options = dict(batch_size=2, epochs=None, equal_batches=True, schedule=Schedule(batch_size=[(0, 2), (5, 4)]))

    def steered(workers=0):
        loader = make(str(tmp_path), workers=workers, **options)
        loader.skip(3, 6)
        loader.skip(20, 26)  # across the end of the first epoch
        return loader

    it = iter(steered())
    full = [next(it) for _ in range(24)]
    plain = make(str(tmp_path), batch_size=2, epochs=None, equal_batches=True)
    pit = iter(plain)
    micro = [docs_of(next(pit)) for _ in range(70)]
    # planned steps 0..4 are one batch, then two, a step never across an epoch's end (20 batches):
    # the last of an epoch is short; steps 3, 4, 5 and 20..25 are skipped
    steps, i = [], 0
    while len(steps) < 40:
        k = 1 if len(steps) < 5 else 2
        end = (i // 20 + 1) * 20
        steps.append(micro[i : min(i + k, end)])
        i = min(i + k, end)
    want = [[d for b in step for d in b] for s, step in enumerate(steps) if not (3 <= s < 6 or 20 <= s < 26)][:24]
    assert [docs_of(b) for b in full] == want
    it = iter(steered(workers=2))
    full = [next(it) for _ in range(24)]
    for cut in (2, 9, 17):
        first = steered(workers=2)
        it = iter(first)
        got = [next(it) for _ in range(cut)]
        state = first.state_dict()
        second = make(str(tmp_path), workers=2, **options)
        second.load_state_dict(state)
        it = iter(second)
        rest = [next(it) for _ in range(24 - cut)]
        assert all(same(a, b) for a, b in zip(got + rest, full)), cut


def test_a_later_phase_set_while_training_is_followed_and_resumed(tmp_path):
    write_dataset(tmp_path, [40, 40], seed=6)
    declared = Schedule(batch_size=[(0, 2), (20, 4)])
    later = {"batch_size": [[0, 2], [6, 4], [12, 6]]}  # a phase moved earlier and one added

    def run(cut=None):
        loader = make(str(tmp_path), batch_size=2, schedule=declared)
        it = iter(loader)
        got = [next(it) for _ in range(4)]
        assert loader.set_schedule(later) == 4
        for batch in it:
            got.append(batch)
            if len(got) == cut:
                return got, loader.state_dict()
        return got, None

    full, _ = run()
    assert [len(b["lengths"]) for b in full[:14]] == [2] * 6 + [4] * 6 + [6] * 2
    got, state = run(cut=9)
    again = make(str(tmp_path), batch_size=2, schedule=declared)
    again.load_state_dict(state)
    rest = list(again)
    assert len(got) + len(rest) == len(full)
    assert all(same(a, b) for a, b in zip(got + rest, full))
    with pytest.raises(SteeringError, match="steps already planned"):
        again2 = make(str(tmp_path), batch_size=2, schedule=declared)
        it = iter(again2)
        for _ in range(8):
            next(it)
        again2.set_schedule({"batch_size": [[0, 2], [6, 4]]})  # steps 6 and 7 were planned as 1 batch
