"""A job's place in the queue, as its owner steers it: the priority it may ask (ZERO1_PRIORITY_LIMITS),
the GPUs its owner may hold (ZERO1_GPU_QUOTAS), a priority changed later, suspend and resume, and the
queue as everyone sees it (GET /v1/queue). The scheduler decides who runs; this only records what was
asked. Functions take the request's session and only flush; the caller commits."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from urllib.parse import urlsplit

from sqlalchemy import and_, case, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from service.auth import Principal
from service.errors import ServiceError
from service.scheduling.dispatch import Reasons
from service.scheduling.job_states import flag_active, transition
from service.schemas.fields import ACTIVE
from service.schemas.requests import JobSpec
from service.schemas.responses import OwnerUsagePublic, QueueEntryPublic, QueuePublic
from service.settings import Settings
from service.store.job_repository import get_job, queue_order
from service.store.tables import Job

STEERABLE = ("queued", *ACTIVE, "suspended")
"""The statuses whose priority may change: every one but the ends."""


def _who(owner: str | None) -> str:
    return "the anonymous user (auth is off)" if owner is None else f"user {owner}"


def check_ceiling(priority: int, *, settings: Settings, principal: Principal) -> int:
    """`priority`, if `principal` may ask it (a 403 `forbidden_priority` naming both numbers otherwise)."""
    ceiling = settings.priority_limit(principal.user, admin=principal.admin)
    if priority > ceiling:
        raise ServiceError(
            f"priority {priority} is above {_who(principal.user)}'s ceiling of {ceiling} (ZERO1_PRIORITY_LIMITS)",
            status_code=403,
            error="forbidden_priority",
            priority=priority,
            limit=ceiling,
        )
    return priority


def check_priority(spec: JobSpec, *, settings: Settings, principal: Principal) -> int:
    """The priority to store for a submitted job: its spec's, else ZERO1_DEFAULT_PRIORITY, within the
    submitter's ceiling."""
    asked = settings.default_priority if spec.priority is None else spec.priority
    return check_ceiling(asked, settings=settings, principal=principal)


def check_quota(spec: JobSpec, *, settings: Settings, owner: str | None) -> None:
    """A job whose fewest GPUs exceed its owner's quota could never run within it: a 422 `over_quota`."""
    quota = settings.gpu_quota(owner)
    fewest = spec.world_sizes()[0]
    if quota is not None and fewest > quota:
        raise ServiceError(
            f"the job needs at least {fewest} GPUs and {_who(owner)}'s quota is {quota} (ZERO1_GPU_QUOTAS)",
            status_code=422,
            error="over_quota",
            gpus=fewest,
            quota=quota,
        )


def check_notify(spec: JobSpec, *, settings: Settings) -> None:
    """A job's `notify` URL names one of ZERO1_WEBHOOK_NOTIFY_HOSTS (its host, or host:port where the
    entry has a port), and no user or password: a 422 naming the field and the hosts allowed."""
    if spec.notify is None:
        return
    url = urlsplit(spec.notify)
    allowed = settings.webhook_notify_hosts
    host = (url.hostname or "").lower()
    where = f"[{host}]" if ":" in host else host
    try:
        port = url.port
    except ValueError:
        port = None
        why = "its port is not a number from 0 to 65535"
    else:
        named = {where} if port is None else {where, f"{where}:{port}"}
        if url.username is not None or url.password is not None:
            why = "a notify URL carries no user or password (sign with ZERO1_WEBHOOK_SECRET)"
        elif not allowed:
            why = "this service sends no job's own notifications (ZERO1_WEBHOOK_NOTIFY_HOSTS is unset)"
        elif not named & set(allowed):
            why = f"{url.netloc} is not one of the hosts allowed (ZERO1_WEBHOOK_NOTIFY_HOSTS: {', '.join(allowed)})"
        else:
            return
    detail = [{"field": "notify", "message": why, "type": "value_error"}]
    raise ServiceError(f"notify: {why}", status_code=422, error="invalid_request", detail=detail)


def _conflict(job: Job, what: str) -> ServiceError:
    return ServiceError(f"job {job.id} is {job.status}: {what}", status_code=409, error="conflict")


def set_priority(session: Session, job: Job, priority: int, *, settings: Settings, principal: Principal) -> Job:
    """The job's new priority, within the caller's ceiling; a compare-and-set on its status, as a job
    that ended meanwhile keeps the priority it ended with (a 409)."""
    check_ceiling(priority, settings=settings, principal=principal)
    changed = session.execute(
        update(Job).where(Job.id == job.id, Job.status.in_(STEERABLE)).values(priority=priority),
        execution_options={"synchronize_session": False},
    )
    if changed.rowcount != 1:
        session.refresh(job)
        raise _conflict(job, "only a queued, running or suspended job's priority can change")
    set_committed_value(job, "priority", priority)
    return job


def suspend_job(session: Session, job_id: int) -> Job:
    """A queued job is suspended at once; an active one is flagged, and the scheduler stops it at a step
    boundary with a checkpoint, then moves it to suspended. Races the scheduler as cancel_job does."""
    job = get_job(session, job_id)
    if job.status == "queued" and transition(session, job, "suspended", "suspended by request while queued"):
        return job
    if job.status in ACTIVE and flag_active(session, job, "suspend_requested"):
        return job
    raise _conflict(job, "only a queued or running job can be suspended")


def resume_job(session: Session, job_id: int) -> Job:
    """A suspended job goes back to the queue, in its place by priority and submission."""
    job = get_job(session, job_id)
    reason = f"resumed by request: back in the queue at priority {job.priority}"
    if job.status != "suspended" or not transition(session, job, "queued", reason):
        raise _conflict(job, "only a suspended job can be resumed")
    job.suspend_requested = False
    session.flush()
    return job


def queue_view(
    session: Session,
    *,
    reasons: Reasons,
    settings: Settings,
    limit: int = 500,
    starts: Mapping[int, datetime | None] | None = None,
) -> QueuePublic:
    """The first `limit` queued jobs in the order the scheduler takes them (by submission only under
    ZERO1_QUEUE_POLICY=fifo), each with why it waits (`reasons`, the scheduler's, by job id) and when it
    is estimated to start (`starts`, the scheduler's, by job id: Scheduler.estimated_starts), and each
    owner's GPUs against their quota."""
    starts = starts or {}
    order = queue_order(fifo=settings.queue_policy == "fifo")
    queued = session.scalars(select(Job).where(Job.status == "queued").order_by(*order).limit(limit))
    data = [
        QueueEntryPublic(
            position=position,
            id=job.id,
            name=job.name,
            owner=job.owner,
            priority=job.priority,
            num_gpus=job.num_gpus,
            min_gpus=job.min_gpus or job.num_gpus,
            created_at=job.created_at,
            reason=reasons.of(job.id),
            estimated_start=starts.get(job.id),
        )
        for position, job in enumerate(queued, start=1)
    ]
    count = session.scalar(select(func.count()).where(Job.status == "queued"))
    return QueuePublic(data=data, count=count, owners=owner_usage(session, settings=settings))


def owner_usage(session: Session, *, settings: Settings) -> list[OwnerUsagePublic]:
    """Each owner with a job that holds GPUs or waits for them, with their quota; most GPUs first."""
    usage = [
        OwnerUsagePublic(owner=owner, gpus_in_use=gpus, borrowed_gpus=borrowed, quota=settings.gpu_quota(owner))
        for owner, (gpus, borrowed) in gpus_by_owner(session).items()
    ]
    return sorted(usage, key=lambda u: (-u.gpus_in_use, u.owner or ""))


def gpus_by_owner(session: Session) -> dict[str | None, tuple[int, int]]:
    """Owner -> (GPUs their active jobs hold, each its current N; how many of those are borrowed), for
    each owner with a job that holds GPUs or waits for them (queued or suspended: (0, 0))."""
    active = Job.status.in_(ACTIVE)
    held = func.coalesce(Job.world_size, Job.num_gpus)
    rows = session.execute(
        select(
            Job.owner,
            func.coalesce(func.sum(case((active, held), else_=0)), 0),
            func.coalesce(func.sum(case((and_(active, Job.borrowed), held), else_=0)), 0),
        )
        .where(Job.status.in_((*ACTIVE, "queued", "suspended")))
        .group_by(Job.owner)
    ).all()
    return {owner: (int(gpus), int(borrowed)) for owner, gpus, borrowed in rows}
