"""A mixture's drift over the window: 0 over every full window of an unscheduled mix (its plan
interleaves the sources in an even pattern, one round per shuffle block), not hidden by the
window (one step shows the pattern), and following a schedule point."""

from __future__ import annotations

from pathlib import Path

from pack_helpers import cached
from synth import write_dataset

import wdsllm

STEP_ITEMS = 4
ROUND_STEPS = 3  # shuffle_buffer=12 items: one round of the plan's pattern is 3 batches of 4


def _sources() -> dict[str, Path]:
    def build(d: Path) -> dict[str, Path]:
        write_dataset(d / "a", [60, 60], seed=1)
        write_dataset(d / "b", [60], seed=2)
        return {"a": d / "a", "b": d / "b"}

    return cached("observe-drift", build)


def _drifts(window: int, schedule=None) -> tuple[list[float], dict]:
    mix = wdsllm.Mixture(_sources(), weights={"a": 2, "b": 1}, unit="items", schedule=schedule)
    with wdsllm.loader(mix, batch_size=STEP_ITEMS, shuffle_buffer=12, wait_window=window, watchdog_s=None) as loader:
        drifts = []
        for _ in loader:
            metrics = loader.metrics()
            drifts.append(metrics["mix_drift_max"])
    return drifts, metrics


def test_no_drift_over_full_windows_of_an_unscheduled_mix():
    drifts, metrics = _drifts(ROUND_STEPS)
    assert len(drifts) == 45
    assert drifts[: ROUND_STEPS - 1] != [0.0, 0.0], "a window not yet full"
    assert drifts[ROUND_STEPS - 1 :] == [0.0] * (45 - ROUND_STEPS + 1)
    assert metrics["mix/a/items"] == 120 and metrics["mix/b/items"] == 60
    assert metrics["mix/a/target_share"] == 2 / 3
    one_step, _ = _drifts(1)
    assert max(one_step) > 0, "a single batch of 4 cannot hold 2:1"


def test_drift_follows_a_schedule_point():
    point = 18 * STEP_ITEMS  # after step 18 the weights are 1:1
    drifts, metrics = _drifts(ROUND_STEPS, schedule=[{"at_items": point, "weights": {"a": 1, "b": 1}}])
    steps = range(1, len(drifts) + 1)
    before = [d for s, d in zip(steps, drifts) if ROUND_STEPS <= s <= 18]
    after = [d for s, d in zip(steps, drifts) if s - ROUND_STEPS >= 18]
    assert before == [0.0] * len(before) and after == [0.0] * len(after)
    # what was delivered follows the new weights after the point: 2:1 of 72 items, then 1:1 of 108
    assert metrics["mix/a/items"] == 48 + 54 and metrics["mix/b/items"] == 24 + 54
    assert metrics["mix/a/target_share"] == metrics["mix/b/target_share"] == 0.5
