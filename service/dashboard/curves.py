"""A job's training curves as the pages draw them: the surviving rows of GET /v1/jobs/{id}/metrics (superseded
rows left out), thinned to MAX_POINTS, and the rows that evaluated, never thinned. The job page draws them
as its first paint; the compare and sweep pages hand them to static/charts.js as JSON, one series a job."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from service.api import job_responses
from service.schemas.printable import escape
from service.schemas.responses import MetricPublic
from service.store.tables import Job

MAX_POINTS = 200
"""Points a chart asks the metrics endpoint for (dashboard.js reads it from data-max-points)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Curves:
    metrics: list[MetricPublic]
    """The surviving curve, at most MAX_POINTS of its steps (job_responses.thinned_steps)."""
    evaluated: list[MetricPublic]
    """Every surviving step that evaluated (eval_loss set)."""


def job_curves(session: Session, job: Job, *, max_points: int = MAX_POINTS) -> Curves:
    """The job's curve thinned to `max_points`, and its evaluated steps, as the metrics endpoint pages them."""
    limit = 10 * max_points
    metrics, _ = job_responses.job_metrics(session, job, after_step=None, limit=limit, max_points=max_points)
    evaluated, _ = job_responses.job_metrics(
        session, job, after_step=None, limit=limit, max_points=None, evaluated=True
    )
    return Curves(metrics=metrics, evaluated=evaluated)


def series(job: Job, curves: Curves, *, label: str) -> dict:
    """One job's series for charts.js's overlays: loss and lr by step, eval_loss by the steps that evaluated.
    The label is a user's text (a job's name): escaped here as every page writes it."""
    return {
        "job_id": job.id,
        "label": escape(label),
        "steps": [m.step for m in curves.metrics],
        "loss": [m.loss for m in curves.metrics],
        "lr": [m.lr for m in curves.metrics],
        "eval_steps": [m.step for m in curves.evaluated],
        "eval_loss": [m.eval_loss for m in curves.evaluated],
    }
