"""Reads of the jobs table: one job (or a 404), the job a principal may see, pages of jobs, the
queue's order and a job's place in it, the GPUs the active jobs hold, a job's events, its metric rows,
and what a poll says is stored. No writes: the state machine (service/scheduling/job_states.py) and
submission (service/intake/submission.py) change rows.
"""

from __future__ import annotations

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session, selectinload

from service.auth import Principal
from service.errors import ServiceError
from service.schemas.fields import ACTIVE
from service.schemas.requests import world_sizes
from service.schemas.responses import EventPublic
from service.store.log_lines import log_acks
from service.store.tables import Job, JobEvent, JobTag, Metric


def get_job(session: Session, job_id: int) -> Job:
    """The job, or a 404."""
    job = session.get(Job, job_id)
    if job is None:
        raise no_job(job_id)
    return job


def no_job(job_id: int) -> ServiceError:
    """The 404 of a job that does not exist, or that the asker may not see."""
    return ServiceError(f"no job with id {job_id}", status_code=404, error="not_found")


def can_see(principal: Principal, job: Job) -> bool:
    """Whether `principal` sees the job's details (spec, last metrics row, error, metrics, events): its owner
    and admins do; everyone sees the rest, so that all know who holds the GPUs."""
    return principal.admin or (principal.user is not None and principal.user == job.owner)


def get_visible_job(session: Session, job_id: int, *, principal: Principal) -> Job:
    """The job whose details `principal` may read; another's is a 404 as if it did not exist."""
    job = get_job(session, job_id)
    if not can_see(principal, job):
        raise no_job(job_id)
    return job


def newest_jobs(
    session: Session, *, statuses: list[str] | None, limit: int, cursor: int | None, tags: list[str] | None = None
) -> tuple[list[Job], bool]:
    """A page of jobs, newest first, below id `cursor`, each with every one of `tags`; (jobs, whether
    more follow). Their tags are read in one more query."""
    query = (
        select(Job)
        .options(selectinload(Job.tag_rows), selectinload(Job.needs_rows))
        .order_by(Job.id.desc())
        .limit(limit + 1)
    )
    if statuses:
        query = query.where(Job.status.in_(statuses))
    for tag in set(tags or ()):
        query = query.where(Job.id.in_(select(JobTag.job_id).where(JobTag.tag == tag)))
    if cursor is not None:
        query = query.where(Job.id < cursor)
    jobs = list(session.scalars(query))
    return jobs[:limit], len(jobs) > limit


def set_labels(session: Session, job: Job, *, tags: list[str] | None, notes: str | None) -> None:
    """Replace the job's tags (when given) and its notes (when given; "" clears them). The tags are
    deleted and written again under the job's row lock: two requests at once leave one's set whole."""
    if tags is not None:
        session.execute(select(Job.id).where(Job.id == job.id).with_for_update())
        session.execute(delete(JobTag).where(JobTag.job_id == job.id))
        if tags:
            session.execute(insert(JobTag), [{"job_id": job.id, "tag": tag} for tag in sorted(set(tags))])
        session.expire(job, ["tag_rows"])
    if notes is not None:
        job.notes = notes or None


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


def queue_positions(session: Session, *, fifo: bool = False) -> dict[int, int]:
    """Every queued job's queue_position, in one query for the whole queue (not one per job)."""
    queue = session.scalars(select(Job.id).where(Job.status == "queued").order_by(*queue_order(fifo=fifo)))
    return {job_id: i + 1 for i, job_id in enumerate(queue)}


def any_queued(session: Session) -> bool:
    """Whether a job waits in the queue."""
    return session.scalar(select(Job.id).where(Job.status == "queued").limit(1)) is not None


def gpus_in_use(session: Session, *, besides: int | None = None) -> int:
    """GPUs the active jobs hold (each its current world size), not counting job `besides`."""
    held = func.coalesce(Job.world_size, Job.num_gpus)
    query = select(func.coalesce(func.sum(held), 0)).where(Job.status.in_(ACTIVE))
    if besides is not None:
        query = query.where(Job.id != besides)
    return session.scalar(query)


def job_world_sizes(job: Job) -> list[int]:
    """The N the stored job may run at (schemas.world_sizes), read off its stored spec."""
    micro = job.spec.get("micro_batch_size") or 1
    return world_sizes(
        min_gpus=job.min_gpus or job.num_gpus,
        num_gpus=job.num_gpus,
        micro_batch_size=micro,
        batch_size=job.spec.get("global_batch_size") or micro * job.num_gpus,
    )


def job_events(session: Session, job: Job) -> list[EventPublic]:
    """The job's status changes, in the order they happened."""
    events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id))
    return [EventPublic.model_validate(e, from_attributes=True) for e in events]


def surviving_metrics(
    session: Session,
    job: Job,
    *,
    after_step: int | None,
    limit: int,
    steps: list[int] | None = None,
    evaluated: bool = False,
    checkpointed: bool = False,
) -> list[Metric]:
    """Up to `limit` of the job's rows not superseded, by step, past `after_step`: only `steps` when given
    (looked up by (job_id, step), no scan of the whole curve), only those that evaluated (eval_loss set)
    or checkpointed (checkpoint_blocked_s set) when asked."""
    query = select(Metric).where(Metric.job_id == job.id, Metric.superseded.is_(False))
    if after_step is not None:
        query = query.where(Metric.step > after_step)
    if steps is not None:
        query = query.where(Metric.step.in_(steps))
    if evaluated:
        query = query.where(Metric.eval_loss.is_not(None))
    if checkpointed:
        query = query.where(Metric.checkpoint_blocked_s.is_not(None))
    return list(session.scalars(query.order_by(Metric.step).limit(limit)))


def poll_acks(job: Job) -> tuple[int, int, int, dict[int, int]]:
    """What a poll says is stored: (job, attempt, its last stored step, its ranks' last log lines)."""
    return job.id, job.attempt, stored_step(job), log_acks(job)


def stored_step(job: Job) -> int:
    """The step through which its rows are stored (-1: none)."""
    return -1 if job.step is None else job.step
