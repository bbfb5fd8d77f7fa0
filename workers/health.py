"""A rank's test for a diverged run, step by step: a loss spike (its z-score over the losses of the
steps before it) or a run of non-finite steps that reaches max_nonfinite_steps. The service rolls
such a run back (service/scheduling/health.py; docs/api.md, "Training health").

Pure and standard library only: every rank sees the same all-reduced loss and skips the same steps,
so every rank decides the same at the same step, with no collective of its own.

May import: workers.config, workers.records.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from workers.config import HealthConfig
from workers.records import Divergence, DivergenceKind, MetricRow

MIN_RELATIVE_DEVIATION = 1e-6
"""The least deviation a window counts, as a fraction of its mean: a plateau whose losses differ in
float32's last bits does not make every later wobble a spike of thousands of σ."""


def zscore(loss: float, window: list[float]) -> float:
    """Standard deviations `loss` lies above the window's mean: the window's sample deviation, at
    least MIN_RELATIVE_DEVIATION of its mean (0 for a window of zero losses, which tests nothing)."""
    mean = statistics.fmean(window)
    deviation = max(statistics.stdev(window), MIN_RELATIVE_DEVIATION * abs(mean))
    return (loss - mean) / deviation if deviation > 0 else 0.0


class DivergenceWatch:
    """One attempt's test, fed each step's row: the losses of the last `spike_window` clean steps (finite,
    not skipped) of this attempt, and the skips in a row the loop counts. A resumed attempt tests
    spikes once it has a whole window of its own steps."""

    def __init__(self, health: HealthConfig, *, max_nonfinite_steps: int) -> None:
        self._health = health
        self._max_nonfinite_steps = max_nonfinite_steps
        self._window: deque[float] = deque(maxlen=health.spike_window)

    def check(self, row: MetricRow, *, skipped_in_a_row: int) -> Divergence | None:
        """The divergence `row`'s step makes, if any; a clean step's loss joins the window after it is
        tested (a spike's too: with max_rollbacks 0 the run goes on, and the window with it)."""
        if skipped_in_a_row >= self._max_nonfinite_steps:
            loss = row.loss if row.loss is not None and math.isfinite(row.loss) else None
            return Divergence(kind=DivergenceKind.NONFINITE, step=row.step, loss=loss, num_steps=skipped_in_a_row)
        if row.skipped or row.loss is None or not math.isfinite(row.loss):
            return None
        found = None
        threshold = self._health.spike_zscore
        if threshold is not None and len(self._window) == self._window.maxlen:
            z = zscore(row.loss, list(self._window))
            if z > threshold:
                found = Divergence(kind=DivergenceKind.SPIKE, step=row.step, loss=row.loss, zscore=z)
        self._window.append(row.loss)
        return found
