"""Changes made for a later planned step (issue #42): ``at=`` and ``steer_horizon``. The run is the
one a change made at that step gives, bit for bit, with the re-plan made ahead in a thread (and
its pass started there) rather than while the stream waits; resume between the call and the
step holds the pending change; bad steps are refused."""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter

import pytest
import test_steering_plans as plans
import yaml
from test_steering_plans import assert_same_run, docs_of, make, resumed_run, same, steered_run

import wdsllm
from wdsllm.errors import StateError, SteeringError

one = plans.one  # the fixtures of the steering tests
two_sources = plans.two_sources


@pytest.fixture(scope="module")
def mix(two_sources) -> wdsllm.Mixture:
    return wdsllm.Mixture(two_sources, weights={"a": 1, "b": 1}, unit="items", epoch_items=240)


MIX_KW = dict(batch_size=8, shuffle_buffer=64)


def run(src, call_after: int, change, forked: bool = False, **kw) -> tuple[list[dict], dict]:
    """Every batch of epochs 0 and 1, ``change(loader)`` made after ``call_after`` of them; the
    loader's metrics at the end. ``forked``: real DataLoader workers."""
    loader = wdsllm.loader(src, num_workers=kw.pop("workers"), seed=3, **kw) if forked else None
    out, loader = steered_run(src, change, call_after, loader=loader, **kw)
    metrics = loader.metrics()
    loader.close()
    return out, metrics


CHANGES = {
    "weights": lambda at: lambda ld: ld.set_weights({"a": 0.8, "b": 0.2}, at=at),
    "exclude a source": lambda at: lambda ld: ld.exclude(sources=["b"], at=at),
    "exclude documents": lambda at: lambda ld: ld.exclude(docs=[(1 << 32) | k for k in range(0, 40, 3)], at=at),
}


@pytest.mark.parametrize("kind", sorted(CHANGES))
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("step", [12, 35])  # in the epoch of the call (27 steps), in the next one
def test_a_change_made_ahead_is_the_change_made_at_its_step(mix, kind, workers, step):
    now, _ = run(mix, step, CHANGES[kind](None), workers=workers, **MIX_KW)
    ahead, metrics = run(mix, 4, CHANGES[kind](step), workers=workers, **MIX_KW)
    assert len(ahead) == len(now)
    for i, (a, b) in enumerate(zip(ahead, now)):
        assert same(a, b), f"batch {i} differs"
    assert metrics["steer_replans_ahead"] == 1 and metrics["steer_replans_waited"] == 0
    assert metrics["steer_pending_changes"] == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_change_made_for_an_earlier_step_goes_first_and_both_are_made_ahead(mix, workers):
    """Weights for step 20, then an exclusion for step 10: the re-plan begun for the weights is
    abandoned (an earlier change reshapes what it follows), each is made ahead in its turn."""

    def both(loader):
        assert loader.set_weights({"a": 0.8, "b": 0.2}, at=20) == 20
        assert loader.exclude(docs=[(1 << 32) | k for k in range(0, 40, 3)], at=10) == 10

    def at_their_steps(loader):
        if loader.planned_step == 10:
            loader.exclude(docs=[(1 << 32) | k for k in range(0, 40, 3)])

    ahead, metrics = run(mix, 4, both, workers=workers, **MIX_KW)
    loader = make(mix, workers=workers, **MIX_KW)
    now = []
    for e in (0, 1):
        loader.set_epoch(e)
        for batch in loader:
            now.append(batch)
            at_their_steps(loader)
            if loader.planned_step == 20:
                loader.set_weights({"a": 0.8, "b": 0.2})
    loader.close()
    assert len(ahead) == len(now) and all(same(a, b) for a, b in zip(ahead, now))
    assert metrics["steer_replans_ahead"] == 2 and metrics["steer_replans_waited"] == 0


def test_with_forked_workers_the_pass_started_ahead_is_the_pass_at_the_step(mix, caplog):
    """Real DataLoader workers: the re-plan's workers fork between steps once it is made."""
    change = CHANGES["exclude a source"]

    def ahead_of_time(loader):
        change(12)(loader)
        loader._ahead.thread.join()  # made: the next step starts the new pass's workers

    now, _ = run(mix, 12, change(None), workers=2, forked=True, **MIX_KW)
    with caplog.at_level(logging.DEBUG, logger="wdsllm.load.steer"):
        ahead, metrics = run(mix, 3, ahead_of_time, workers=2, forked=True, **MIX_KW)
    assert len(ahead) == len(now) and all(same(a, b) for a, b in zip(ahead, now))
    assert metrics["steer_replans_ahead"] == 1
    assert "the workers of the re-plan for step 12 start at step 4" in caplog.text


def test_the_horizon_sets_the_step_a_change_takes_effect_at(mix):
    got = []

    def change(loader):
        got.append(loader.set_weights({"a": 0.8, "b": 0.2}))
        assert loader.metrics()["steer_pending_changes"] == 1
        assert loader.weights_now() == (0.5, 0.5)  # in force until its step

    horizon, _ = run(mix, 4, change, steer_horizon=5, **MIX_KW)
    assert got == [9]
    named, _ = run(mix, 4, CHANGES["weights"](9), **MIX_KW)
    assert all(same(a, b) for a, b in zip(horizon, named)) and len(horizon) == len(named)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cut", [3, 4, 7, 11, 12, 15])
def test_resume_between_the_call_and_its_step_equals_uninterrupted(mix, workers, cut):
    """The call after 4 batches names step 12: a state saved between holds the pending change."""
    change = CHANGES["weights"](12)
    full, _ = run(mix, 4, change, workers=workers, **MIX_KW)
    build = functools.partial(make, mix, workers=workers, **MIX_KW)
    assert_same_run(resumed_run(build, change, 4, cut), full, cut)


def test_a_pending_change_is_in_the_state_and_an_edit_of_it_is_refused(mix):
    loader = make(mix, **MIX_KW)
    it = iter(loader)
    next(it)
    loader.exclude(sources=["b"], at=10)
    state = loader.state_dict()
    body = json.loads(state["state"])
    assert body["version"] == 8 and body["steering"]["pending"][0]["at"] == 10
    assert body["steering"]["log"] == []
    body["steering"]["pending"][0]["at"] = 11
    edited = {**state, "state": json.dumps(body)}
    with pytest.raises(StateError, match="digest"):
        make(mix, **MIX_KW).load_state_dict(edited)
    loader.close()


def test_an_elastic_resume_between_the_call_and_its_step_takes_it_at_the_step(one):
    """Two ranks call it after 2 steps for step 5; rank 0's state after 3 resumes on one rank."""
    gone = [(2 << 32) | k for k in range(35)]  # shard 2, whole
    consumed: Counter = Counter()
    state = None
    for r in (0, 1):
        ld = make(one, r, 2, 2)
        it = iter(ld)
        for i in range(3):
            if i == 2:
                assert ld.exclude(docs=gone, at=5) == 5
            consumed.update(docs_of(next(it)))
        state = state or ld.state_dict()
    resumed = make(one, 0, 1, 1)
    resumed.load_state_dict(state)
    assert resumed.metrics()["steer_pending_changes"] == 1
    batches = list(resumed)
    rest = Counter(d for b in batches for d in docs_of(b))
    assert max((consumed + rest).values()) == 1
    assert [c.at for c in resumed.steering.log.changes] == [5]
    after = {d for b in batches[5 - 3 :] for d in docs_of(b)}
    assert not after & set(gone)


@pytest.mark.parametrize(
    "at, match",
    [(2, "next planned step is 3"), (-1, "not a planned step"), (True, "not a planned step"), ("9", "not a planned")],
)
def test_a_step_already_planned_or_not_a_step_is_refused(mix, at, match):
    loader = make(mix, **MIX_KW)
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(SteeringError, match=match):
        loader.set_weights({"a": 0.8, "b": 0.2}, at=at)
    with pytest.raises(SteeringError, match=match):
        loader.exclude(sources=["b"], at=at)
    assert loader.metrics()["steer_pending_changes"] == 0 and not loader.steering.log.changes
    loader.close()


def test_a_pending_exclusion_is_a_replay_when_given_again_and_its_source_cannot_be_weighted(mix):
    loader = make(mix, **MIX_KW)
    it = iter(loader)
    next(it)
    assert loader.exclude(sources=["b"], at=8) == 8
    loader.exclude(sources=["b"], at=9)  # a replay: nothing more
    assert loader.metrics()["steer_pending_changes"] == 1
    with pytest.raises(SteeringError, match="excluded and must weigh 0"):
        loader.set_weights({"a": 0.5, "b": 0.5}, at=9)
    with pytest.raises(SteeringError, match="leave nothing"):
        loader.exclude(sources=["a"], at=9)
    loader.close()


def test_a_steering_file_with_a_horizon_takes_its_weights_once(mix, tmp_path, caplog):
    steer = tmp_path / "steer.yaml"
    steer.write_text(yaml.safe_dump({"weights": {"a": 0.7, "b": 0.3}}))
    loader = make(mix, steer_file=str(steer), reload_every=2, steer_horizon=5, **MIX_KW)
    batches = list(loader)
    changes = loader.steering.log.weight_changes
    assert [c.at for c in loader.steering.log.changes] == [5] and len(changes) == 1
    assert changes[0].weights == pytest.approx((0.7, 0.3))
    assert len(batches) > 5
    loader.close()


def test_a_change_a_state_could_not_hold_is_refused_at_the_call(mix, monkeypatch):
    """Each change inside an epoch plans over the plan before; past the depth a state reads, the
    call is refused (not the resume), and the next epoch starts flat again."""
    from wdsllm.load import state as statemod

    monkeypatch.setattr(statemod, "MAX_PLAN_DEPTH", 2)
    loader = make(mix, **MIX_KW)
    it = iter(loader)
    next(it)
    loader.set_weights({"a": 0.6, "b": 0.4})
    next(it)
    loader.set_weights({"a": 0.7, "b": 0.3}, at=4)  # the second plan, pending
    with pytest.raises(SteeringError, match="at most 2"):
        loader.set_weights({"a": 0.8, "b": 0.2})
    state = loader.state_dict()
    resumed = make(mix, **MIX_KW)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [c.at for c in resumed.steering.log.changes] == [1, 4] and rest
    resumed.set_epoch(1)
    assert resumed.set_weights({"a": 0.8, "b": 0.2}) == resumed.planned_step  # a fresh epoch: flat
    loader.close()
    resumed.close()
