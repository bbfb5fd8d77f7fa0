"""A job's metric rows in the database: each attempt's rows stored once, and the rows a relaunch
will redo marked superseded, so the surviving curve has every step once."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.store.tables import Job, Metric, utcnow
from workers.records import STORED_FIELDS, MetricRow


def store_metrics(session: Session, job: Job, rows: list[MetricRow]) -> int:
    """Insert one attempt's rows (a row already stored is skipped), each with the time it was stored (what
    GET /v1/usage counts its training at), note the latest on the job; the number of rows given."""
    if not rows:
        return 0
    now = utcnow()
    values = [{**row.stored(), "job_id": job.id, "attempt": job.attempt, "stored_at": now} for row in rows]
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    statement = dialect.insert(Metric).on_conflict_do_nothing(index_elements=["job_id", "attempt", "step"])
    session.execute(statement, values)
    last = max(rows, key=lambda row: row.step)
    if job.step is None or last.step >= job.step:
        job.step = last.step
        job.latest = last.stored()
    return len(values)


def supersede_after(session: Session, job: Job, *, resume_step: int) -> None:
    """Mark the rows a relaunch will redo (step >= resume_step) superseded; the job's step and
    latest row fall back to the surviving curve's last."""
    session.execute(
        update(Metric)
        .where(Metric.job_id == job.id, Metric.step >= resume_step, Metric.superseded.is_(False))
        .values(superseded=True)
    )
    last = session.scalar(
        select(Metric)
        .where(Metric.job_id == job.id, Metric.superseded.is_(False))
        .order_by(Metric.step.desc())
        .limit(1)
    )
    job.step = None if last is None else last.step
    job.latest = None if last is None else {k: getattr(last, k) for k in STORED_FIELDS}
