"""A sweep as an MLflow parent run with its trials' runs nested under it (MLflow nests a run whose
`mlflow.parentRunId` tag names another run of its experiment).

The parent holds the sweep's name, its search space and settings as params (flattened: `space.optimizer.lr`)
and, once the sweep has ended, its status (FINISHED, FAILED, KILLED for cancelled), the best trial's
metric (`best_eval_loss` or `best_loss`) and its job (the `zero1.best_job_id` tag). It is made once, when
its first trial's run is, in that trial's experiment (the sweep's owner's), and found again by its
`zero1.sweep_key` tag after a crash between making it and recording it in its cursor
(service.store.tables.MlflowSweepRun); it is ended once the sweep has and every trial's run is, by the
exporter's pass (exporter.py), never by the scheduler. The best trial is the one the API names
(service.experiments.sweeps.public): one rule for both.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import exists, or_, select

from service.experiments import sweeps
from service.store.db import Database
from service.store.tables import Job, MlflowRun, MlflowSweepRun, Sweep, SweepTrial
from service.tracking import runs
from service.tracking.mlflow_client import Mlflow

SWEEP_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
"""An ended sweep's status and its parent run's; the exact status is the zero1.status tag."""
KEY_TAG = "zero1.sweep_key"
"""The parent's tag alone (a trial's run has zero1.sweep_id too): what finds the parent again."""
SWEEPS_PER_PASS = 100


def _ms(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp() * 1000)


def sweep_key(sweep: Sweep) -> str:
    """sweep-<id>-<created at, to the microsecond>: a sweep id handed out again after a database restore
    does not find an older sweep's parent."""
    return f"sweep-{sweep.id}-{sweep.created_at:%Y%m%dT%H%M%S%f}"


def parent_params(spec: dict[str, Any]) -> dict[str, str]:
    """The sweep's request but its name and base (each trial's run holds its whole spec), flattened:
    {"space": {"optimizer.lr": [0.1, 0.3]}, "metric": "loss"} -> {"space.optimizer.lr": "[0.1, 0.3]",
    "metric": "loss"}."""
    return runs.flat_params({key: value for key, value in spec.items() if key not in ("name", "base")})


def parent_tags(sweep: Sweep) -> dict[str, str]:
    tags = {"zero1.sweep_id": str(sweep.id), KEY_TAG: sweep_key(sweep), "zero1.status": sweep.status}
    if sweep.owner is not None:
        tags["zero1.owner"] = sweep.owner
        tags["mlflow.user"] = sweep.owner
    return tags


def trial_tags(trial: SweepTrial, *, parent_run_id: str) -> dict[str, str]:
    """What nests a trial's run under its sweep's and names its searched values (`zero1.trial.optimizer.lr`;
    its params hold them too, as the whole spec)."""
    tags = {
        "mlflow.parentRunId": parent_run_id,
        "zero1.sweep_id": str(trial.sweep_id),
        "zero1.trial_index": str(trial.index),
    }
    for path, value in trial.values.items():
        tags[f"zero1.trial.{path}"] = str(value)
    return tags


class SweepRuns:
    """The parents of the exporter's runs: made for a trial's run, ended after the sweep."""

    def __init__(self, *, db: Database, mlflow: Mlflow) -> None:
        self.db = db
        self.mlflow = mlflow

    def tags_for(self, job: Job, *, experiment_id: str) -> dict[str, str]:
        """The tags that nest the job's run under its sweep's parent run (made first if need be); none for
        a job that is no sweep's trial."""
        with self.db.session() as session:
            found = session.execute(
                select(SweepTrial, Sweep)
                .join(Sweep, Sweep.id == SweepTrial.sweep_id)
                .where(SweepTrial.job_id == job.id)
            ).first()
        if found is None:
            return {}
        trial = found[0]
        sweep = found[1]
        return trial_tags(trial, parent_run_id=self._parent(sweep, experiment_id=experiment_id))

    def _parent(self, sweep: Sweep, *, experiment_id: str) -> str:
        """The sweep's parent run id: its cursor's, else the run found by its key, else a new run."""
        with self.db.session() as session:
            cursor = session.get(MlflowSweepRun, sweep.id)
            if cursor is None:
                cursor = MlflowSweepRun(sweep_id=sweep.id, done=False)
                session.add(cursor)
            run_id = cursor.run_id
        if run_id is not None:
            return run_id
        run_id = self.mlflow.find_or_create_run(
            experiment_id,
            key=sweep_key(sweep),
            key_tag=KEY_TAG,
            name=sweep.name,
            start_time_ms=_ms(sweep.created_at),
            tags=parent_tags(sweep),
            params=parent_params(sweep.spec),
        )
        self.save(sweep.id, experiment_id=experiment_id, run_id=run_id)
        return run_id

    def ending(self) -> list[int]:
        """The sweeps whose parent can end: the sweep has ended, and so has every trial's run (none left to
        nest under a running parent)."""
        unfinished_trial = (
            select(SweepTrial.index)
            .outerjoin(MlflowRun, MlflowRun.job_id == SweepTrial.job_id)
            .where(
                SweepTrial.sweep_id == MlflowSweepRun.sweep_id,
                SweepTrial.job_id.is_not(None),
                or_(MlflowRun.done.is_(None), MlflowRun.done.is_(False)),
            )
        )
        with self.db.session() as session:
            return list(
                session.scalars(
                    select(MlflowSweepRun.sweep_id)
                    .join(Sweep, Sweep.id == MlflowSweepRun.sweep_id)
                    .where(
                        MlflowSweepRun.done.is_(False),
                        MlflowSweepRun.run_id.is_not(None),
                        Sweep.status.in_(tuple(SWEEP_STATUS)),
                        ~exists(unfinished_trial),
                    )
                    .order_by(MlflowSweepRun.sweep_id)
                    .limit(SWEEPS_PER_PASS)
                )
            )

    def end(self, sweep_id: int) -> bool:
        """The ended sweep's parent: its best trial's metric and job, its status; then nothing more to send.
        Sent again after a crash, it is the same: the metric's timestamp is the sweep's end."""
        with self.db.session() as session:
            sweep = session.get(Sweep, sweep_id)
            run_id = session.get(MlflowSweepRun, sweep_id).run_id
            shown = sweeps.public(session, sweep)
        end_ms = _ms(shown.finished_at)
        tags = {"zero1.status": shown.status}
        best = shown.best
        if best is not None:
            self.mlflow.log_points(run_id, [(f"best_{shown.metric}", best.metric, 0)], timestamp_ms=end_ms or 0)
            tags["zero1.best_job_id"] = str(best.job_id)
            tags["zero1.best_trial_index"] = str(best.index)
        self.mlflow.set_tags(run_id, tags)
        self.mlflow.terminate(run_id, status=SWEEP_STATUS[shown.status], end_time_ms=end_ms)
        self.save(sweep_id, done=True, last_error=None)
        return False

    def save(self, sweep_id: int, **values: object) -> None:
        with self.db.session() as session:
            row = session.get(MlflowSweepRun, sweep_id)
            for name, value in values.items():
                setattr(row, name, value)
