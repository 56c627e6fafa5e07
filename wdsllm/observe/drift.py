"""A mixture's drift: how far the sources' share of the last steps strays from the schedule's.

Each step's delivered units per source (tokens or items, the mixture's unit) are taken from the
loader's ``MixTally`` as it counts them; over the window of the last ``wait_window`` steps, a
source's drift is its share of the window's units less the share the schedule gives it, weighted
by the units of each step (the phase in force at each step's position in the run). A mixture plan
interleaves its sources in rounds of one shuffle block in a fixed even pattern, so a window of
whole rounds of an unscheduled mixture has no drift; at a schedule point the drift follows the
new weights as the window fills with the new phase.

The window's sums are kept as steps enter and leave it, in integers (units per source, and units
per phase): a report costs the same whatever the window, and a window of whole rounds gives a
drift of exactly 0. A step's phase is found when a report first asks (it needs the world size).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..load.mixstats import MixTally, normalised, phase_at, phase_weights


class _Step:
    """One step in the window: its units per source, their sum, where the run stood before it,
    and its phase once a report placed it."""

    __slots__ = ("before", "epoch", "phase", "total", "units")

    def __init__(self, units: np.ndarray, epoch: int, before: int):
        self.units, self.total, self.epoch, self.before = units, int(units.sum()), epoch, before
        self.phase: int | None = None


class MixDrift:
    """Per-step units of each source over a window, with the step's place in the run."""

    def __init__(self, tally: MixTally, window: int):
        self.tally = tally
        self.unit = 0 if tally.source.mixture.unit == "tokens" else 1
        self.window = window
        self.steps: deque[_Step] = deque(maxlen=window)
        self._seen = tally.total[:, self.unit].copy()
        self._realized = np.zeros(len(self._seen), np.int64)  # the window's units per source
        self._phase_units: dict[int, int] = {}  # the window's units per phase (placed steps)
        self._world: tuple[int, int] | None = None  # the world size and phases the steps were placed for

    def stepped(self) -> None:
        """After the loader counted a batch: what it added, per source."""
        now = self.tally.total[:, self.unit]
        units = now - self._seen
        self._seen = now.copy()
        before = int(self.tally.this_epoch[:, self.unit].sum() - units.sum())
        if len(self.steps) == self.window:
            oldest = self.steps[0]
            self._realized -= oldest.units
            if oldest.phase is not None:
                self._phase_units[oldest.phase] -= oldest.total
        self.steps.append(_Step(units, self.tally.epoch or 0, before))
        self._realized += units

    def _place(self, world: int) -> None:
        """The phase of each step not placed yet (all of them when the world size or the phases
        changed: weights set while the run trained)."""
        planner = self.tally.source.mix_planner()
        if (world, planner.noted_version) != self._world:
            self._world, self._phase_units = (world, planner.noted_version), {}
            for step in self.steps:
                step.phase = None
        phases = planner.report_phases()
        for step in reversed(self.steps):  # placed steps are the older ones
            if step.phase is not None:
                break
            # ranks stay in step (equal batches): the run's position is this rank's units times world
            step.phase = phase_at(phases, step.epoch * planner.epoch + step.before * max(1, world))
            self._phase_units[step.phase] = self._phase_units.get(step.phase, 0) + step.total

    def drift(self, world: int) -> np.ndarray:
        """Each source's share of the window's units less its scheduled share (0 for an empty window)."""
        self._place(world)
        whole = int(self._realized.sum())
        if not whole:
            return np.zeros(len(self._realized))
        phases = self.tally.source.mix_planner().report_phases()
        target = np.zeros(len(self._realized))
        for phase, units in self._phase_units.items():
            if units:
                target += units * np.asarray(normalised(phases[phase][1]))
        return (self._realized - target) / whole

    def metrics(self, world: int) -> dict[str, float]:
        drift = self.drift(world)
        tally, planner = self.tally, self.tally.source.mix_planner()
        # the schedule's phase in force at the run's present position
        position = (tally.epoch or 0) * planner.epoch + int(tally.this_epoch[:, self.unit].sum()) * max(1, world)
        target = phase_weights(planner, position)
        out = {"mix_drift_max": float(np.abs(drift).max()) if len(drift) else 0.0}
        for s, name in enumerate(tally.source.names()):
            out[f"mix/{name}/tokens"] = float(tally.total[s, 0])
            out[f"mix/{name}/items"] = float(tally.total[s, 1])
            out[f"mix/{name}/target_share"] = float(target[s])
            out[f"mix/{name}/drift"] = float(drift[s])
        return out
