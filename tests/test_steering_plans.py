"""Changes that re-plan the rest of a run (issue #42): ``exclude`` and ``set_weights`` take effect
at the next planned step on every rank, never yield what they exclude, keep every other document
once per epoch, and resume exactly (also on another world size) from before, at or after them."""

from __future__ import annotations

import functools
import json
from collections import Counter

import numpy as np
import pytest
import torch
from synth import write_dataset

import wdsllm
from wdsllm.errors import SteeringError


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("steer-one")
    write_dataset(d, [30, 25, 35, 20], seed=4, max_len=30)
    return str(d)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("steer-mix")
    write_dataset(d / "a", [60] * 5, seed=1, max_len=20)
    write_dataset(d / "b", [60] * 5, seed=2, max_len=20)
    return {"a": str(d / "a"), "b": str(d / "b")}


def docs_of(batch: dict) -> list[int]:
    return [int(d[0]) for d in batch["docs"].tolist()]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def make(src, rank=0, world=1, workers=0, **kw):
    kw.setdefault("batch_size", 4)
    return wdsllm.loader(src, rank=rank, world_size=world, num_workers=workers, _in_process=True, seed=3, **kw)


def steered_run(src, change, at, epochs=(0, 1), world=1, rank=0, workers=0, loader=None, **kw):
    """Every batch of ``epochs`` with ``change(loader)`` made after ``at`` batches (of ``loader``
    where given, else one ``make`` builds)."""
    loader = loader or make(src, rank, world, workers, **kw)
    out = []
    for e in epochs:
        loader.set_epoch(e)
        for batch in loader:
            out.append(batch)
            if len(out) == at:
                change(loader)
    if len(out) < at:
        change(loader)
    return out, loader


def resumed_run(build, change, at: int, cut: int) -> list[dict]:
    """Batches of epochs 0 and 1 with ``change`` made after ``at`` batches, the run stopped after
    ``cut``, its state saved (through JSON) and resumed in a fresh loader (which makes the change
    again where the first run made it, if the cut came before it, as a launch script would)."""
    first = build()
    got = []
    for e in (0, 1):
        first.set_epoch(e)
        for batch in first:
            got.append(batch)
            if len(got) == at:
                change(first)
            if len(got) == cut:
                break
        if len(got) == cut:
            break
    state = json.loads(json.dumps(first.state_dict()))
    second = build()
    second.load_state_dict(state)
    rest = []
    for e in range(second.epoch, 2):
        second.set_epoch(e)
        for batch in second:
            rest.append(batch)
            if len(got) + len(rest) == at and cut < at:
                change(second)
    return got + rest


def assert_same_run(got: list[dict], full: list[dict], cut: int) -> None:
    assert len(got) == len(full)
    for i, (a, b) in enumerate(zip(got, full)):
        assert same(a, b), f"batch {i} differs after resuming at {cut}"


# ----------------------------------------------------------------------------------------------
# exclude


@pytest.mark.parametrize("workers", [0, 2])
def test_an_exclusion_mid_epoch_leaves_out_what_it_names_and_keeps_the_rest_once(one, workers):
    plain = [d for b in make(one, workers=workers) for d in docs_of(b)]
    shard_2 = [d for d in plain if d >> 32 == 2]
    at = 6
    seen_before = set(plain[: at * 4])
    gone_docs = [d for d in plain[at * 4 :] if d >> 32 != 2][:5]

    def change(loader):
        assert loader.exclude(shards=[2], docs=gone_docs) == at
        assert loader.exclude(docs=gone_docs, shards=[2]) == at  # a replay

    got, loader = steered_run(one, change, at, epochs=(0,), workers=workers)
    docs = [d for b in got for d in docs_of(b)]
    assert docs[: at * 4] == plain[: at * 4]
    after = docs[at * 4 :]
    assert not set(after) & (set(gone_docs) | set(shard_2))
    assert Counter(docs) == Counter(d for d in plain if d in seen_before or (d not in gone_docs and d >> 32 != 2))
    loader.set_epoch(1)  # the next epoch plans without them from its start
    later = [d for b in loader for d in docs_of(b)]
    assert Counter(later) == Counter(d for d in plain if d not in gone_docs and d >> 32 != 2)


def test_an_exclusion_on_two_ranks_keeps_their_batches_equal_and_every_other_document_once(one):
    at = 3
    gone = [0, 1, 2, 3, 4, 5]  # ordinals 0..5 of shard 0
    runs = [steered_run(one, lambda ld: ld.exclude(docs=gone), at, epochs=(0,), world=2, rank=r)[0] for r in (0, 1)]
    assert len(runs[0]) == len(runs[1])
    docs = Counter(d for run in runs for b in run for d in docs_of(b))
    before = {d for run in runs for b in run[:at] for d in docs_of(b)}
    assert max(docs.values()) == 1
    assert not (set(docs) - before) & set(gone)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cut", [2, 6, 7, 12, 30])
def test_resume_before_at_or_after_an_exclusion_equals_uninterrupted(one, workers, cut):
    at = 6

    def change(loader):
        loader.exclude(shards=[1], docs=[(3 << 32) | 4])

    full, _ = steered_run(one, change, at, workers=workers)
    assert_same_run(resumed_run(lambda: make(one, workers=workers), change, at, cut), full, cut)


def test_an_elastic_resume_after_an_exclusion_keeps_every_other_document_once(one):
    at, cut = 3, 5
    gone = [(2 << 32) | k for k in range(10)]
    consumed: Counter = Counter()
    state = None
    for r in (0, 1):
        ld = make(one, r, 2, 2)
        it = iter(ld)
        for i in range(cut):
            if i == at:
                ld.exclude(docs=gone)
            consumed.update(docs_of(next(it)))
        state = state or ld.state_dict()
    resumed = make(one, 0, 1, 1)
    resumed.load_state_dict(state)
    rest = Counter(d for b in resumed for d in docs_of(b))
    everything = Counter(d for b in make(one) for d in docs_of(b))
    assert max((consumed + rest).values()) == 1
    assert set(consumed + rest) == set(everything) - (set(gone) - set(consumed))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(sources=["web"]), "one dataset, not a mixture"),
        (dict(shards=[99]), "not one of this dataset's 4 shards"),
        (dict(docs=[(9 << 32) | 1]), "names no item"),
        (dict(docs=[(0 << 32) | 999]), "names no item"),
        (dict(), "names nothing"),
        (dict(shards=[0, 1, 2, 3]), "leave nothing to read"),
    ],
)
def test_a_bad_exclusion_is_refused_and_nothing_changes(one, kw, match):
    loader = make(one)
    it = iter(loader)
    next(it)
    with pytest.raises(SteeringError, match=match):
        loader.exclude(**kw)
    assert not loader.steering.log.changes
    assert len(list(it)) == len(loader) - 1


# ----------------------------------------------------------------------------------------------
# set_weights


def test_new_weights_shape_the_rest_of_the_epoch_and_the_next(two_sources):
    mix = wdsllm.Mixture(two_sources, weights={"a": 0.5, "b": 0.5}, unit="items", epoch_items=240)
    kw = dict(batch_size=8, shuffle_buffer=64)
    at = 10

    def change(loader):
        assert loader.set_weights({"a": 0.8, "b": 0.2}) == at

    got, _ = steered_run(mix, change, at, epochs=(0, 1), **kw)
    per_epoch = [b for b in got if int(b["epoch"]) == 0], [b for b in got if int(b["epoch"]) == 1]
    sources = [np.concatenate([b["sources"].numpy() for b in part]) for part in per_epoch]
    before, after = sources[0][: at * 8], sources[0][at * 8 :]
    assert abs((before == 0).mean() - 0.5) < 0.1
    assert abs((after == 0).mean() - 0.8) < 0.05
    assert abs((sources[1] == 0).mean() - 0.8) < 0.05  # the next epoch's quotas follow them
    for part in per_epoch:
        docs = Counter(d for b in part for d in docs_of(b))
        assert max(docs.values()) == 1
    assert len(sources[1]) == 240  # the next epoch holds its full size


@pytest.mark.parametrize("cut", [4, 10, 13, 60])
def test_resume_around_new_weights_equals_uninterrupted(two_sources, cut):
    mix = wdsllm.Mixture(two_sources, weights={"a": 0.5, "b": 0.5}, unit="items", epoch_items=240)
    kw = dict(batch_size=8, shuffle_buffer=64, workers=2)
    at = 10

    def change(loader):
        loader.set_weights({"a": 0.7, "b": 0.3})

    full, _ = steered_run(mix, change, at, **kw)
    build = functools.partial(make, mix, workers=2, batch_size=8, shuffle_buffer=64)
    assert_same_run(resumed_run(build, change, at, cut), full, cut)


@pytest.mark.parametrize(
    "weights, match",
    [
        ({"a": 0.5, "c": 0.5}, "unknown sources"),
        ({"a": 1.0}, "missing sources"),
        ({"a": -1.0, "b": 2.0}, "finite number, zero or more"),
        ({"a": float("nan"), "b": 1.0}, "finite number"),
        ({"a": float("inf"), "b": 1.0}, "finite number"),
        ({"a": 0, "b": 0}, "all zero"),
    ],
)
def test_bad_weights_are_refused_and_the_run_keeps_its_weights(two_sources, weights, match):
    mix = wdsllm.Mixture(two_sources, weights={"a": 0.5, "b": 0.5}, unit="items", epoch_items=240)
    loader = make(mix)
    with pytest.raises(SteeringError, match=match):
        loader.set_weights(weights)
    assert not loader.steering.log.changes


def test_an_excluded_source_gives_its_weight_to_the_others(two_sources):
    mix = wdsllm.Mixture(two_sources, weights={"a": 0.5, "b": 0.5}, unit="items", epoch_items=240)
    got, loader = steered_run(mix, lambda ld: ld.exclude(sources=["b"]), 5, epochs=(0, 1), batch_size=8)
    late = np.concatenate([b["sources"].numpy() for b in got[5:]])
    assert (late == 0).all()
    assert sum(len(b["sources"]) for b in got if int(b["epoch"]) == 1) == 240
    with pytest.raises(SteeringError, match="excluded and must weigh 0"):
        loader.set_weights({"a": 0.5, "b": 0.5})


# ----------------------------------------------------------------------------------------------
# a steering file, re-read while the run trains


def test_a_steering_file_is_taken_every_n_steps_and_a_bad_edit_keeps_the_settings(two_sources, tmp_path, caplog):
    mix = wdsllm.Mixture(two_sources, weights={"a": 0.5, "b": 0.5}, unit="items", epoch_items=240)
    steer = tmp_path / "steer.yaml"
    steer.write_text("weights: {a: 0.5, b: 0.5}\n")
    loader = make(mix, batch_size=8, steer_file=str(steer), reload_every=5, epochs=None, equal_batches=True)
    it = iter(loader)
    for _ in range(4):
        next(it)
    steer.write_text("weights: {a: 0.9, b: 0.1}\nskip: [[7, 9]]\n")
    next(it)  # step 4; the file is read again before step 5
    after = [next(it) for _ in range(4)]
    assert [c.change.kind for c in loader.steering.log.changes] == ["weights", "skip"]
    assert loader.planned_step == 5 + 4 + 2  # steps 7 and 8 were skipped
    share = np.concatenate([b["sources"].numpy() for b in after])
    assert (share == 0).mean() > 0.8
    steer.write_text("weights: {a: -1, b: 2}\n")  # refused: the run keeps 0.9 / 0.1
    with caplog.at_level("ERROR", logger="wdsllm"):
        for _ in range(5):
            next(it)
    assert "was not taken" in caplog.text and "finite number" in caplog.text
    assert loader.weights_now() == pytest.approx((0.9, 0.1))
    steer.write_text("weights: {a: 0.9, b: 0.1}\nskip: [[7, 9]]\nexclude: {sources: [b]}\n")
    assert loader.planned_step == 16
    rest = [next(it) for _ in range(12)]  # the file is read again at step 20
    assert len([c for c in loader.steering.log.changes if c.change.kind == "skip"]) == 1  # a replay
    assert all((b["sources"] == 0).all() for b in rest[4:])


def test_reload_every_needs_a_file(one):
    with pytest.raises(wdsllm.ConfigError, match="steer_file"):
        make(one, reload_every=3)


def test_metrics_say_what_was_skipped_excluded_and_weighted(two_sources, one):
    loader = make(one, batch_size=4, schedule=wdsllm.Schedule(batch_size=[(0, 4), (4, 8)]))
    loader.skip(2, 3)
    it = iter(loader)
    for _ in range(4):
        next(it)
    m = loader.metrics()
    assert m["steer_planned_step"] == 5 and m["steer_skipped_steps"] == 1 and m["steer_skipped_batches"] == 1
    assert m["steer_skipped_items"] == 4 and m["steer_skipped_tokens"] > 0
    assert m["steer_schedule_phase"] == 1 and m["steer_step_batches"] == 2
    loader.exclude(shards=[3])
    next(it)
    m = loader.metrics()
    assert m["steer_excluded_items"] > 0 and m["steer_excluded_tokens"] >= m["steer_excluded_items"]
    mix = wdsllm.Mixture(two_sources, weights={"a": 0.5, "b": 0.5}, unit="items", epoch_items=240)
    mixed = make(mix, batch_size=8)
    it = iter(mixed)
    next(it)
    mixed.set_weights({"a": 3, "b": 1})
    assert mixed.metrics()["steer_weight/a"] == pytest.approx(0.75)


def test_stats_and_explain_take_a_states_changes(two_sources, tmp_path):
    import subprocess
    import sys

    mix_file = tmp_path / "mix.yaml"
    mix_file.write_text(
        f"sources: {{a: {two_sources['a']}, b: {two_sources['b']}}}\nweights: {{a: 0.5, b: 0.5}}\n"
        "unit: items\nepoch_items: 240\n"
    )
    loader = wdsllm.loader(str(mix_file), batch_size=8, seed=1)
    it = iter(loader)
    next(it)
    loader.set_weights({"a": 0.9, "b": 0.1})
    loader.skip(3, 5)
    next(it)
    assert loader.exclude(sources=["b"], at=6) == 6  # pending in the state
    state = tmp_path / "state.json"
    state.write_text(json.dumps(loader.state_dict()))
    rest = [next(it) for _ in range(3)]  # planned steps 2, 5, 6

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "wdsllm.cli", *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    got = cli("stats", mix_file, "--state", state, "--schedule", '{"batch_size": [[0, 32], [1, 64]]}', "--json")
    assert [c["kind"] for c in got["steering"]["changes"]] == ["weights", "skip"]
    assert [(c["kind"], c["at"]) for c in got["steering"]["pending"]] == [("exclude", 6)]
    assert set(rest[2]["sources"].tolist()) == {0}  # planned step 6: source b is gone
    assert got["modes"][0]["steps"] == -(-(got["modes"][0]["batches"] - 1) // 2) + 1
    for step, batch in enumerate(rest):  # step 1 after the state is planned step 5: the skip is taken
        shown = cli(
            "explain", mix_file, "--state", state, "--step", step, "--option", "batch_size=8", "--seed", 1, "--json"
        )
        assert [(d["shard"], d["ordinal"]) for d in shown] == [
            (int(i) >> 32, int(i) & 0xFFFFFFFF) for i in docs_of(batch)
        ]


def test_the_drift_is_judged_by_the_weights_in_force_from_the_step_they_were_set(two_sources):
    mix = wdsllm.Mixture(two_sources, weights={"a": 0.5, "b": 0.5}, unit="items", epoch_items=240)
    loader = make(mix, batch_size=8, shuffle_buffer=64, wait_window=8)
    it = iter(loader)
    for _ in range(6):
        next(it)
    loader.set_weights({"a": 0.8, "b": 0.2})
    for _ in range(8):  # the window holds the new phase only
        next(it)
    m = loader.metrics()
    assert m["mix/a/target_share"] == pytest.approx(0.8)
    assert m["mix_drift_max"] < 0.1


def test_weights_that_would_repeat_a_source_beyond_what_a_plan_holds_are_refused(two_sources):
    mix = wdsllm.Mixture(two_sources, weights={"a": 0.5, "b": 0.5}, unit="items", epoch_items=300 * 70_000)
    loader = make(mix, batch_size=8)
    with pytest.raises(SteeringError, match="times over"):
        loader.set_weights({"a": 1.0, "b": 0.0})
    assert not loader.steering.log.changes


@pytest.mark.parametrize("world,workers", [(1, 3), (2, 2)])
def test_a_replanned_epoch_counted_by_its_shares_items_equals_its_slices_counted(two_sources, one, world, workers):
    """Batches of items: the rest of an epoch after a change is counted from its strands' totals
    (``RemainderPlan.share_items``), exactly what counting every consumer's dealt slices gives."""
    from wdsllm.load.counts import EpochCounts, _shares_exact
    from wdsllm.load.steer.plans import Leaving, SteeredPlan

    mix = wdsllm.Mixture(two_sources, weights={"a": 1.0, "b": 1.0}, unit="items")
    for src, leaving in ((mix, Leaving(weights=(0.8, 0.2))), (mix, Leaving(sources=(1,))), (one, Leaving(shards=(2,)))):
        loader = make(src, batch_size=5, shuffle_buffer=16)
        catalog, cfg = loader.source.catalog, loader.cfg
        consumed = [[3 * (r + w + 1) for w in range(2)] for r in range(2)]
        plan = SteeredPlan(0, 2, 2, consumed, None, leaving=leaving)
        counts = EpochCounts.create(catalog, cfg, 0, world, workers, plan)
        assert counts.exact().tolist() == _shares_exact(catalog, cfg, 0, world, workers, plan, None).tolist()
        assert counts.exact().sum() > 0
        loader.close()
