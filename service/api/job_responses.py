"""What the job routes (and the dashboard) answer: a job as its asker sees it, a page of jobs with
their places in the queue, a job's curve thinned for a chart, and a succeeded job's artifacts.
"""

from __future__ import annotations

import math
from pathlib import Path

from sqlalchemy.orm import Session

from service.auth import Principal
from service.errors import ServiceError
from service.schemas.responses import JobPublic, MetricPublic
from service.store.artifacts import FinalFile, check_artifact, recorded_artifacts
from service.store.job_repository import can_see, newest_jobs, queue_positions, surviving_metrics
from service.store.job_storage import JobStorage
from service.store.tables import Job
from workers.records import finite_or_none


def job_public(job: Job, *, position: int | None, principal: Principal) -> JobPublic:
    """The job as `principal` sees it (its details null unless can_see); `position` is its queue_position."""
    mine = can_see(principal, job)
    return JobPublic(
        id=job.id,
        name=job.name,
        status=job.status,
        spec=job.spec if mine else None,
        plan=job.plan,
        num_gpus=job.num_gpus,
        min_gpus=job.min_gpus or job.num_gpus,
        world_size=job.world_size,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        step=job.step,
        steps=job.steps,
        latest=_finite(job.latest) if mine else None,
        error=job.error if mine else None,
        attempt=job.attempt,
        num_retries=job.num_retries,
        num_rollbacks=len(job.rollbacks or ()),
        queue_position=position,
        owner=job.owner,
        priority=job.priority,
        borrowed=job.borrowed,
        tags=job.tags,
        depends_on=job.depends_on,
        notes=job.notes if mine else None,
    )


def _finite(row: dict | None) -> dict | None:
    """A row stored before non-finite values were nulled on the way in (JSON has no inf or nan)."""
    return None if row is None else {k: finite_or_none(v) for k, v in row.items()}


def list_jobs(
    session: Session,
    *,
    statuses: list[str] | None,
    limit: int,
    cursor: int | None,
    principal: Principal,
    fifo: bool = False,
    tags: list[str] | None = None,
) -> tuple[list[JobPublic], str | None]:
    """Newest first, as `principal` sees them, only those with every one of `tags`; the cursor is the id
    the next page starts below."""
    jobs, more = newest_jobs(session, statuses=statuses, limit=limit, cursor=cursor, tags=tags)
    positions: dict[int, int] = {}
    if any(j.status == "queued" for j in jobs):
        positions = queue_positions(session, fifo=fifo)
    data = [job_public(j, position=positions.get(j.id), principal=principal) for j in jobs]
    return data, (str(jobs[-1].id) if more else None)


def job_metrics(
    session: Session,
    job: Job,
    *,
    after_step: int | None,
    limit: int,
    max_points: int | None,
    evaluated: bool = False,
    checkpointed: bool = False,
) -> tuple[list[MetricPublic], int | None]:
    """The surviving curve (superseded rows left out), optionally thinned to max_points by stride;
    `evaluated` / `checkpointed`: only the steps that evaluated (eval_loss set) / checkpointed
    (checkpoint_blocked_s set), never thinned (a stride would miss every k-th step)."""
    first = 0 if after_step is None else after_step + 1
    thin = not (evaluated or checkpointed) and max_points is not None
    steps = None
    if thin and job.step is not None and job.step - first + 1 > max_points:
        steps = thinned_steps(first, job.step, max_points=max_points)
    rows = surviving_metrics(
        session,
        job,
        after_step=after_step,
        limit=limit + 1,
        steps=steps,
        evaluated=evaluated,
        checkpointed=checkpointed,
    )
    more = len(rows) > limit
    rows = rows[:limit]
    data = [MetricPublic.model_validate(row, from_attributes=True) for row in rows]
    return data, (rows[-1].step if more else None)


def thinned_steps(first: int, last: int, *, max_points: int) -> list[int]:
    """At most max_points of the steps first..last: the multiples of the smallest stride that
    fits, and the last. Multiples of the stride, not offsets from `first`, so that the points a
    chart already has stay points as it pages on."""
    stride = max(1, math.ceil((last - first + 1) / max_points))
    while True:
        wanted = sorted({*range(-(-first // stride) * stride, last + 1, stride), last})
        if len(wanted) <= max_points:
            return wanted
        stride += 1


def job_artifacts(session: Session, job: Job, *, storage: JobStorage) -> tuple[Path, list[FinalFile]]:
    """The job's directory and the artifacts the service recorded of a succeeded job (none when it
    wrote none, or its storage lost them); 409 for any other status."""
    if job.status != "succeeded":
        raise ServiceError(
            f"job {job.id} is {job.status}: its artifacts are written when it succeeds",
            status_code=409,
            error="conflict",
        )
    job_dir = storage.checkpoint_dir(job)
    return job_dir, recorded_artifacts(session, job, job_dir=job_dir)


def artifact_file(session: Session, job: Job, name: str, *, storage: JobStorage) -> tuple[Path, FinalFile]:
    """The job's directory and one recorded artifact, still a regular file of its recorded size (a
    409 otherwise); any name not recorded (a path with a separator or .. included) is a 404."""
    job_dir, files = job_artifacts(session, job, storage=storage)
    found = next((entry for entry in files if entry.name == name), None)
    if found is None:
        raise ServiceError(f"job {job.id} has no artifact {name!r}", status_code=404, error="not_found")
    check_artifact(job, job_dir, found)
    return job_dir, found
