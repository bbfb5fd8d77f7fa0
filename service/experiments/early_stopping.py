"""Early stopping of a sweep's trials: ASHA (asynchronous successive halving, Li et al., MLSys 2020),
decided by the service from the metric rows it already stores.

A rung is a number of steps. Once a trial's job has done a rung's steps, its value there is recorded:
the sweep's metric at the last row at or before that step (of the surviving curve). It goes on if that
value is within the best 1/eta of the values the trials before it recorded at that rung (once they have
recorded bootstrap_count, by default eta - 1), else it is stopped: at its next step boundary, with a
checkpoint, and it ends `stopped_early` (no retry spent); the tick that ends it submits the sweep's next
trial and admits it onto the GPUs it held. The cutoff is Ray Tune's AsyncHyperBandScheduler's: the
(100/eta)-th percentile of the values recorded there, interpolated linearly; a value that is not finite
is past any cutoff. Ray Tune judges from the second trial at a rung on (bootstrap_count 0): with a few
trials two at a time, the second is judged against the first alone, and a slower starter that would end
best is stopped (benchmarks/sweeps.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.scheduling.job_states import flag_active, transition
from service.schemas.fields import ACTIVE, TERMINAL
from service.schemas.sweeps import SweepSpec
from service.store.tables import Job, Metric, SweepTrial


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value below which `fraction` of `values` lie, interpolated linearly between the two nearest
    (numpy's default): [1, 2, 3] at 1/3 is 1.67."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def cutoff(recorded: Sequence[float], eta: int, *, bootstrap: int = 0) -> float | None:
    """The greatest value that goes on at a rung where the trials before recorded `recorded`; None
    while fewer than max(1, bootstrap) have (every trial goes on)."""
    return percentile(recorded, 1 / eta) if len(recorded) >= max(1, bootstrap) else None


def value_at(session: Session, job_id: int, rung: int, metric: str) -> float | None:
    """The job's `metric` at the last row at or before step rung - 1 that has it; None if none does."""
    column = Metric.eval_loss if metric == "eval_loss" else Metric.loss
    return session.scalar(
        select(column)
        .where(Metric.job_id == job_id, Metric.superseded.is_(False), Metric.step < rung, column.is_not(None))
        .order_by(Metric.step.desc())
        .limit(1)
    )


def decide(session: Session, spec: SweepSpec, trials: list[SweepTrial], jobs: dict[int, Job]) -> list[int]:
    """Record the rungs each trial's job has reached since the last tick, in the order of the trials,
    and stop each one past its rung's cutoff; the ids of the jobs stopped."""
    assert spec.early_stopping is not None
    rungs, eta = spec.early_stopping.rungs, spec.early_stopping.eta
    stopped = []
    for trial in trials:
        job = jobs.get(trial.job_id) if trial.job_id is not None else None
        if job is None or job.step is None:
            continue
        recorded = dict(trial.rungs or {})
        for rung in rungs:
            if job.step + 1 < rung:
                break
            if str(rung) in recorded:
                continue
            value = value_at(session, job.id, rung, spec.metric)
            before = [v for t in trials if t is not trial and (v := (t.rungs or {}).get(str(rung))) is not None]
            limit = cutoff(before, eta, bootstrap=spec.early_stopping.bootstrap)
            finite = value is not None and math.isfinite(value)
            recorded[str(rung)] = value if finite else None
            if value is None or job.status in TERMINAL or job.stop_early:
                continue
            if not finite or (limit is not None and value > limit):
                if _stop(session, job, _why(spec.metric, value, rung, limit, eta, len(before))):
                    stopped.append(job.id)
                break
        trial.rungs = recorded  # a new dict: the JSON column sees the change
    return stopped


def _why(metric: str, value: float, rung: int, limit: float | None, eta: int, count: int) -> str:
    if not math.isfinite(value):
        return f"stopped early by ASHA at the rung of {rung} steps: its {metric} is {value}"
    return (
        f"stopped early by ASHA at the rung of {rung} steps: {metric} {value:.4g} is past the best 1/{eta} "
        f"of the {count} trial(s) before it there (cutoff {limit:.4g})"
    )


def _stop(session: Session, job: Job, reason: str) -> bool:
    """An active job is flagged (the scheduler stops it at a step boundary, with a checkpoint, and it
    ends stopped_early); one that holds no GPU (preempted back to the queue, suspended) ends now."""
    if job.status in ACTIVE:
        return flag_active(session, job, "stop_early", reason)
    if job.status in ("queued", "suspended"):
        return transition(session, job, "stopped_early", reason)
    return False
