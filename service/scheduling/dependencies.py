"""A job's depends_on: the jobs that must succeed before it starts.

At submit, and by PATCH /v1/jobs/{id} while it is queued or suspended, each job named must exist and
must not have failed or been cancelled, and no cycle may form (a 422 naming depends_on). At each
admission the scheduler leaves the queued jobs whose dependencies have not all succeeded out of the
queue's policy (they keep their place, and their queue reason names the first they wait for), and
cancels those with one that failed or was cancelled, naming it: a chain of them ends a link a tick.
"""

from __future__ import annotations

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql.elements import ColumnElement

from service.errors import ServiceError
from service.scheduling.job_states import transition
from service.store.tables import Job, JobDependency

FIELD = "depends_on"
NEVER_STARTS = ("failed", "cancelled", "stopped_early")
"""A dependency that ended so: the job that needs it can never start."""
CHANGEABLE = ("queued", "suspended")
"""The statuses in which a job's depends_on may change: it has not started yet."""


def invalid(why: str) -> ServiceError:
    """A 422 for depends_on, naming it in its message and its detail."""
    detail = [{"field": FIELD, "message": why, "type": "value_error"}]
    return ServiceError(f"{FIELD}: {why}", status_code=422, error="invalid_request", detail=detail)


def check(session: Session, needs: list[int], *, job_id: int | None = None) -> None:
    """The 422 for `needs` as the depends_on of job `job_id` (None: a job not yet stored, which no
    stored job can need): a job that does not exist, one that failed or was cancelled, a cycle."""
    if not needs:
        return
    found = dict(session.execute(select(Job.id, Job.status).where(Job.id.in_(needs))).all())
    for needed in needs:
        if needed not in found:
            raise invalid(f"no job with id {needed}")
        if found[needed] in NEVER_STARTS:
            raise invalid(f"job {needed} ended {found[needed]}: a job that depends on it could never start")
    if job_id is not None and (path := cycle(session, job_id, needs)):
        raise invalid(" → ".join(f"job {node}" for node in path) + " would be a cycle (each needs the next to succeed)")


def cycle(session: Session, job_id: int, needs: list[int]) -> list[int] | None:
    """The path job_id → … → job_id through the stored dependencies that job_id's needing `needs` would
    close, breadth first (the shortest); None if it closes none."""
    if job_id in needs:
        return [job_id, job_id]
    needed_by = dict.fromkeys(needs, job_id)  # each job reached -> the one that needs it, back toward job_id
    frontier = list(needs)
    while frontier:
        edges = session.execute(
            select(JobDependency.job_id, JobDependency.needs_id).where(JobDependency.job_id.in_(frontier))
        )
        frontier = []
        for source, needed in edges:
            if needed == job_id:
                path = [source]
                while path[-1] != job_id:
                    path.append(needed_by[path[-1]])
                return [*reversed(path), job_id]
            if needed not in needed_by:
                needed_by[needed] = source
                frontier.append(needed)
    return None


def set_needs(session: Session, job: Job, needs: list[int]) -> None:
    """Replace the depends_on of a job that has not started (409 otherwise), checked as at submit; the
    rows are deleted and written again under the job's row lock."""
    session.execute(select(Job.id).where(Job.id == job.id).with_for_update())
    session.refresh(job, ["status"])
    if job.status not in CHANGEABLE:
        raise ServiceError(
            f"job {job.id} is {job.status}: only a queued or suspended job's depends_on can change",
            status_code=409,
            error="conflict",
        )
    check(session, needs, job_id=job.id)
    session.execute(delete(JobDependency).where(JobDependency.job_id == job.id))
    if needs:
        session.execute(
            insert(JobDependency), [{"job_id": job.id, "needs_id": needed} for needed in sorted(set(needs))]
        )
    session.expire(job, ["needs_rows"])


def all_succeeded() -> ColumnElement[bool]:
    """The condition, on a Job of the query, that each job it depends on has succeeded (none: true)."""
    needed = aliased(Job)
    unmet = (
        select(JobDependency.job_id)
        .join(needed, needed.id == JobDependency.needs_id)
        .where(JobDependency.job_id == Job.id, needed.status != "succeeded")
    )
    return ~unmet.exists()


def cancel_unreachable(session: Session) -> list[int]:
    """Cancel each queued job one of whose dependencies failed or was cancelled, naming the first; their ids."""
    needed = aliased(Job)
    rows = session.execute(
        select(Job, needed.id, needed.status)
        .join(JobDependency, JobDependency.job_id == Job.id)
        .join(needed, needed.id == JobDependency.needs_id)
        .where(Job.status == "queued", needed.status.in_(NEVER_STARTS))
        .order_by(Job.id, needed.id)
    )
    cancelled: list[int] = []
    for job, needed_id, status in rows:
        if job.id not in cancelled and transition(
            session, job, "cancelled", f"job {needed_id}, which it depends on, ended {status}"
        ):
            cancelled.append(job.id)
    return cancelled


def waiting_reasons(session: Session) -> dict[int, str]:
    """Each queued job with a dependency that has not succeeded -> why it waits: the first such."""
    needed = aliased(Job)
    rows = session.execute(
        select(JobDependency.job_id, needed.id, needed.status)
        .join(Job, Job.id == JobDependency.job_id)
        .join(needed, needed.id == JobDependency.needs_id)
        .where(Job.status == "queued", needed.status != "succeeded")
        .order_by(JobDependency.job_id, needed.id)
    )
    reasons: dict[int, str] = {}
    for job_id, needed_id, status in rows:
        reasons.setdefault(job_id, f"waiting for job {needed_id} to succeed (it is {status})")
    return reasons
