"""What a job's MLflow run holds: its spec as flattened params, its tags, one metric row's points,
the run status of a job status, the experiment it goes to (its owner's), and the link the API and the
job page show (without the tracking URI's credentials). Plain values only: the MLflow client module
turns them into MLflow's entities."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy.orm import Session

from service.schemas.responses import MlflowRunPublic
from service.settings import Settings
from service.store.tables import Job, Metric, MlflowRun
from service.tracking.uris import public_uri

MAX_PARAM_CHARS = 6000
"""MLflow's bound on a param's value; a longer one is cut, with a mark, rather than refused."""
METRICS = ("loss", "eval_loss", "lr", "tokens_per_s", "step_time_s", "grad_norm", "mem_planned_bytes")
"""The row's columns sent as metrics of the same name, each at the row's step (a null one is left out);
mem_peak_bytes is sent as the largest rank's."""
POINTS_PER_ROW = len(METRICS) + 1
ANONYMOUS = "(anonymous)"
"""The experiment name's owner part for a job without an owner (auth off): no user is named so (a user
name starts with a letter or digit)."""
RUN_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "stopped_early": "KILLED"}
"""A terminal job status and its run's status; the exact status is the zero1.status tag."""


def flat_params(spec: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"optimizer": {"lr": 0.1}, "num_gpus": 2} -> {"optimizer.lr": "0.1", "num_gpus": "2"}; nulls left out,
    lists as JSON-like text."""
    params: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            params.update(flat_params(value, prefix=f"{name}."))
        elif value is not None:
            text = str(value)
            params[name] = text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."
    return params


def experiment_name(owner: str | None, settings: Settings) -> str:
    """The experiment a job's run goes to: one per owner (`zero1/alice`), so that the tracking server's
    permissions (MLflow's per-experiment READ) can keep each owner's runs to those allowed."""
    return f"{settings.mlflow_experiment}/{owner or ANONYMOUS}"


def job_key(job: Job) -> str:
    """The tag that finds a job's run again (after a crash between creating it and recording it):
    job-<id>-<run id>, never repeated, as its checkpoint directory is named."""
    return f"job-{job.id}" if job.run_id is None else f"job-{job.id}-{job.run_id}"


def job_url(job_id: int, settings: Settings) -> str:
    base = settings.public_url or f"http://{settings.host}:{settings.port}"
    return f"{base.rstrip('/')}/jobs/{job_id}"


def run_tags(job: Job, settings: Settings) -> dict[str, str]:
    tags = {
        "zero1.job_id": str(job.id),
        "zero1.job_key": job_key(job),
        "zero1.url": job_url(job.id, settings),
        "zero1.status": job.status,
    }
    if job.owner is not None:
        tags["zero1.owner"] = job.owner
        tags["mlflow.user"] = job.owner  # MLflow's own user column shows the owner, not the service's account
    return tags


def row_points(row: Metric) -> dict[str, float]:
    """One row's metrics by name, the finite ones."""
    points = {name: getattr(row, name) for name in METRICS}
    points["mem_peak_bytes"] = max(row.mem_peak_bytes) if row.mem_peak_bytes else None
    return {name: float(v) for name, v in points.items() if v is not None and math.isfinite(v)}


def run_url(tracking_uri: str, *, experiment_id: str, run_id: str) -> str | None:
    """The run's page on an MLflow server's UI (the URI's credentials left out); None for a tracking URI
    that is not a server's address."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{public_uri(tracking_uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def run_link(session: Session, job: Job, settings: Settings) -> MlflowRunPublic | None:
    """The job's run as the API and the job page show it; None while tracking is off or before its run exists."""
    if settings.mlflow_tracking_uri is None:
        return None
    row = session.get(MlflowRun, job.id)
    if row is None or row.run_id is None:
        return None
    url = run_url(settings.mlflow_tracking_uri, experiment_id=row.experiment_id or "0", run_id=row.run_id)
    return MlflowRunPublic(run_id=row.run_id, experiment_id=row.experiment_id, url=url, exported_step=row.step)
