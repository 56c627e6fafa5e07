"""A mixture's drift: how far the sources' share of the last steps strays from the schedule's.

Each step's delivered units per source (tokens or items, the mixture's unit) are taken from the
loader's ``MixTally`` as it counts them; over the window of the last ``wait_window`` steps, a
source's drift is its share of the window's units less the share the schedule gives it, weighted
by the units of each step (the phase in force at each step's position in the run). A mixture plan
interleaves its sources in rounds of one shuffle block in a fixed even pattern, so a window of
whole rounds of an unscheduled mixture has no drift; at a schedule point the drift follows the
new weights as the window fills with the new phase.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..load.mixstats import MixTally, phase_weights


class MixDrift:
    """Per-step units of each source over a window, with the step's place in the run."""

    def __init__(self, tally: MixTally, window: int):
        self.tally = tally
        self.unit = 0 if tally.source.mixture.unit == "tokens" else 1
        #: (units per source, epoch, units of this rank's epoch before the step)
        self.steps: deque[tuple[np.ndarray, int, int]] = deque(maxlen=window)
        self._seen = tally.total[:, self.unit].copy()

    def stepped(self) -> None:
        """After the loader counted a batch: what it added, per source."""
        now = self.tally.total[:, self.unit]
        units = now - self._seen
        self._seen = now.copy()
        before = int(self.tally.this_epoch[:, self.unit].sum() - units.sum())
        self.steps.append((units, self.tally.epoch or 0, before))

    def drift(self, world: int) -> np.ndarray:
        """Each source's share of the window's units less its scheduled share (0 for an empty window)."""
        k = self.tally.total.shape[0]
        realized, target = np.zeros(k), np.zeros(k)
        planner = self.tally.source.mix_planner()
        for units, epoch, before in self.steps:
            total = int(units.sum())
            if not total:
                continue
            # ranks stay in step (equal batches): the run's position is this rank's units times world
            position = epoch * planner.epoch + before * max(1, world)
            realized += units
            target += total * np.asarray(phase_weights(planner, position))
        whole = realized.sum()
        return (realized - target) / whole if whole else np.zeros(k)

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
