"""Jobs: the state machine, storing a submitted job, and the queries the API makes (admission is
service/scheduling/admission.py's).

Functions take the request's session and only flush; the caller commits.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from service.auth import Principal
from service.errors import ServiceError
from service.schemas.fields import ACTIVE, TERMINAL
from service.schemas.requests import JobSpec, world_sizes
from service.schemas.responses import EventPublic, JobPublic, MetricPublic, PlanPublic
from service.store.artifacts import FinalFile, check_artifact, recorded_artifacts
from service.store.log_lines import log_acks
from service.store.tables import Job, JobEvent, Metric, utcnow
from workers.records import finite_or_none

if TYPE_CHECKING:
    from service.store.job_storage import JobStorage

_TRANSITIONS = {
    "queued": {"starting", "cancelled", "suspended"},
    "starting": {"running", "failed", "cancelled", "restarting", "queued", "suspended"},  # a lost attempt
    "running": {"succeeded", "failed", "cancelled", "restarting", "queued", "suspended"},  # queued: preempted
    "restarting": {"running", "failed", "cancelled", "queued", "suspended"},
    "suspended": {"queued", "cancelled"},
}


def transition(session: Session, job: Job, to_status: str, reason: str) -> bool:
    """Move `job` to `to_status` if it is still in the status this session read, recording the event.

    A compare-and-set: one UPDATE ... WHERE status = <the status read>. The API (cancelling a
    queued job) and the scheduler (starting it) race for the same row; the loser's UPDATE
    matches no row, and it gets False with `job` refreshed to what the winner wrote. Terminal
    states are final."""
    from_status = job.status
    assert to_status in _TRANSITIONS.get(from_status, ()), f"job {job.id}: {from_status} -> {to_status}"
    values: dict = {"status": to_status}
    if to_status == "starting" and job.started_at is None:
        values["started_at"] = utcnow()
    if to_status in TERMINAL:
        values["finished_at"] = utcnow()
    session.flush()  # a job added in this session gets its id and row first
    result = session.execute(
        update(Job).where(Job.id == job.id, Job.status == from_status).values(**values),
        execution_options={"synchronize_session": False},
    )
    if result.rowcount != 1:
        session.refresh(job)
        return False
    for key, value in values.items():
        set_committed_value(job, key, value)
    session.add(JobEvent(job_id=job.id, from_status=from_status, to_status=to_status, reason=reason))
    return True


def still_active(session: Session, job: Job) -> Job | None:
    """The job as stored now, if it is still in the attempt and an active status it was read in."""
    fresh = session.get(Job, job.id, populate_existing=True)
    if fresh is None or fresh.attempt != job.attempt or fresh.status not in ACTIVE:
        return None
    return fresh


def running_reason(job: Job, *, nodes: int) -> str:
    """The reason of a start's (or a relaunch's) transition to running."""
    if job.status == "restarting":
        return f"attempt {job.attempt}: {job.world_size or job.num_gpus} ranks placed on {nodes} node(s), resumed"
    return f"{job.world_size or job.num_gpus} ranks placed on {nodes} node(s) and training"


def request_hash(spec: JobSpec) -> str:
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def submit_job(
    session: Session,
    *,
    spec: JobSpec,
    plan: PlanPublic,
    idempotency_key: str | None,
    owner: str | None = None,
    max_queued: int | None = None,
    priority: int = 50,
) -> tuple[Job, bool]:
    """Store a queued job of `owner`; (job, created). A reused Idempotency-Key returns its job or a 409;
    a 429 if `owner` already has `max_queued` jobs queued."""
    digest = request_hash(spec)
    if idempotency_key is not None:
        existing = session.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
        if existing is not None:
            return _replay(existing, digest, idempotency_key, owner=owner), False
    if max_queued is not None:
        _check_queue_limit(session, owner=owner, max_queued=max_queued)
    job = Job(
        name=spec.name,
        status="queued",
        spec=spec.model_dump(mode="json"),
        plan=plan.model_dump(mode="json"),
        num_gpus=spec.num_gpus,
        min_gpus=spec.min_gpus,
        steps=spec.steps,
        idempotency_key=idempotency_key,
        request_hash=digest,
        owner=owner,
        priority=priority,
    )
    try:
        # the job and its first event in one savepoint: on SQLite, whose driver opens no
        # transaction before a SAVEPOINT, releasing it commits, and the scheduler could see
        # (and start) a job whose "queued" event was not yet written
        with session.begin_nested():
            session.add(job)
            session.flush()
            session.add(JobEvent(job_id=job.id, from_status=None, to_status="queued", reason="submitted"))
            session.flush()
    except IntegrityError:  # a concurrent request with the same key won the race
        existing = session.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
        return _replay(existing, digest, idempotency_key, owner=owner), False
    return job, True


def _check_queue_limit(session: Session, *, owner: str | None, max_queued: int) -> None:
    """Checked before the insert: concurrent submits of one user may pass the limit by those in flight."""
    mine = Job.owner.is_(None) if owner is None else Job.owner == owner
    queued = session.scalar(select(func.count()).where(Job.status == "queued", mine))
    if queued >= max_queued:
        who = "the anonymous user (auth is off)" if owner is None else f"user {owner}"
        raise ServiceError(
            f"{who} has {queued} queued jobs, the limit is {max_queued} (ZERO1_MAX_QUEUED_JOBS_PER_USER); "
            "submit again when some have started, or cancel some",
            status_code=429,
            error="too_many_queued_jobs",
            queued=queued,
            limit=max_queued,
        )


def _replay(job: Job, digest: str, key: str, *, owner: str | None) -> Job:
    if job.owner != owner:  # another user's key: say nothing of their job
        raise ServiceError(
            f"Idempotency-Key {key!r} is in use by another user", status_code=409, error="idempotency_conflict"
        )
    if job.request_hash != digest:
        raise ServiceError(
            f"Idempotency-Key {key!r} was used for job {job.id} with a different body",
            status_code=409,
            error="idempotency_conflict",
        )
    return job


# --------------------------------------------------------------------------- queries


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise _no_job(job_id)
    return job


def _no_job(job_id: int) -> ServiceError:
    return ServiceError(f"no job with id {job_id}", status_code=404, error="not_found")


def can_see(principal: Principal, job: Job) -> bool:
    """Whether `principal` sees the job's details (spec, last metrics row, error, metrics, events): its owner
    and admins do; everyone sees the rest, so that all know who holds the GPUs."""
    return principal.admin or (principal.user is not None and principal.user == job.owner)


def get_visible_job(session: Session, job_id: int, *, principal: Principal) -> Job:
    """The job whose details `principal` may read; another's is a 404 as if it did not exist."""
    job = get_job(session, job_id)
    if not can_see(principal, job):
        raise _no_job(job_id)
    return job


QUEUE_ORDER = (Job.priority.desc(), Job.id)
"""The queue's order: the highest priority first, then the earliest submitted."""


def queue_order(*, fifo: bool = False) -> tuple:
    """The order the scheduler takes queued jobs in: QUEUE_ORDER, or by submission alone under
    ZERO1_QUEUE_POLICY=fifo."""
    return (Job.id,) if fifo else QUEUE_ORDER


def queue_position(session: Session, job: Job, *, fifo: bool = False) -> int | None:
    """1 for the next job to start (queue_order); None unless queued."""
    if job.status != "queued":
        return None
    ahead = Job.id < job.id
    if not fifo:
        ahead = (Job.priority > job.priority) | ((Job.priority == job.priority) & ahead)
    return session.scalar(select(func.count()).where(Job.status == "queued", ahead)) + 1


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
        queue_position=position,
        owner=job.owner,
        priority=job.priority,
        borrowed=job.borrowed,
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
) -> tuple[list[JobPublic], str | None]:
    """Newest first, as `principal` sees them; the cursor is the id the next page starts below."""
    query = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if statuses:
        query = query.where(Job.status.in_(statuses))
    if cursor is not None:
        query = query.where(Job.id < cursor)
    jobs = list(session.scalars(query))
    more = len(jobs) > limit
    jobs = jobs[:limit]
    positions: dict[int, int] = {}
    if any(j.status == "queued" for j in jobs):  # one query for the whole queue, not one per job
        queue = session.scalars(select(Job.id).where(Job.status == "queued").order_by(*queue_order(fifo=fifo)))
        positions = {job_id: i + 1 for i, job_id in enumerate(queue)}
    data = [job_public(j, position=positions.get(j.id), principal=principal) for j in jobs]
    return data, (str(jobs[-1].id) if more else None)


def cancel_job(session: Session, job_id: int) -> Job:
    """A queued job ends now; an active one is stopped by the scheduler within a tick.

    The scheduler may start the job between this read and the write: the compare-and-set
    then fails, and the job, now active, is flagged for the scheduler to stop instead."""
    job = get_job(session, job_id)
    if job.status in ("queued", "suspended") and transition(
        session, job, "cancelled", f"cancelled by request while {job.status}"
    ):
        return job
    if job.status in ACTIVE and flag_active(session, job, "cancel_requested"):
        return job
    raise ServiceError(f"job {job_id} is already {job.status}", status_code=409, error="conflict")


def flag_active(session: Session, job: Job, flag: str) -> bool:
    """Set `flag` (cancel_requested, suspend_requested) if the job is still active: a compare-and-set,
    as it may have ended since it was read (then `job` is refreshed). Whether it was set."""
    query = update(Job).where(Job.id == job.id, Job.status.in_(ACTIVE)).values({flag: True})
    if session.execute(query, execution_options={"synchronize_session": False}).rowcount != 1:
        session.refresh(job)
        return False
    set_committed_value(job, flag, True)
    return True


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
    base = select(Metric).where(Metric.job_id == job.id, Metric.superseded.is_(False))
    if after_step is not None:
        base = base.where(Metric.step > after_step)
    if evaluated:
        base = base.where(Metric.eval_loss.is_not(None))
    if checkpointed:
        base = base.where(Metric.checkpoint_blocked_s.is_not(None))
    first = 0 if after_step is None else after_step + 1
    thin = not (evaluated or checkpointed) and max_points is not None
    if thin and job.step is not None and job.step - first + 1 > max_points:
        # looked up by (job_id, step): no scan of the whole curve
        base = base.where(Metric.step.in_(thinned_steps(first, job.step, max_points=max_points)))
    rows = list(session.scalars(base.order_by(Metric.step).limit(limit + 1)))
    more = len(rows) > limit
    rows = rows[:limit]
    data = [MetricPublic.model_validate(row, from_attributes=True) for row in rows]
    return data, (rows[-1].step if more else None)


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


def job_events(session: Session, job: Job) -> list[EventPublic]:
    events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id))
    return [EventPublic.model_validate(e, from_attributes=True) for e in events]


def job_world_sizes(job: Job) -> list[int]:
    """The N the stored job may run at (schemas.world_sizes), read off its stored spec."""
    micro = job.spec.get("micro_batch_size") or 1
    return world_sizes(
        min_gpus=job.min_gpus or job.num_gpus,
        num_gpus=job.num_gpus,
        micro_batch_size=micro,
        batch_size=job.spec.get("global_batch_size") or micro * job.num_gpus,
    )


def gpus_in_use(session: Session, *, besides: int | None = None) -> int:
    """GPUs the active jobs hold (each its current world size), not counting job `besides`."""
    held = func.coalesce(Job.world_size, Job.num_gpus)
    query = select(func.coalesce(func.sum(held), 0)).where(Job.status.in_(ACTIVE))
    if besides is not None:
        query = query.where(Job.id != besides)
    return session.scalar(query)


def poll_acks(job: Job) -> tuple[int, int, int, dict[int, int]]:
    """What a poll says is stored: (job, attempt, its last stored step, its ranks' last log lines)."""
    return job.id, job.attempt, stored_step(job), log_acks(job)


def stored_step(job: Job) -> int:
    """The step through which its rows are stored (-1: none)."""
    return -1 if job.step is None else job.step
