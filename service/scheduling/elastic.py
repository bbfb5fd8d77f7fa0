"""Elastic jobs: the N a job runs at, chosen at each start, retry and growth (docs/api.md, "Elastic jobs").

A job with min_gpus < num_gpus runs at any allowed N (schemas.world_sizes): the scheduler starts
it at the largest that is free once its fewest are; a retry after a failure resumes at the largest
free, leaving the head of the queue what it needs; and while GPUs sit free with no job queued it
grows at its next checkpoint. Each attempt reshards the optimizer state it resumes from
(workers/zero/sharded_state.py, load_resharded_state); the global batch and the sample order do not
depend on N, so the loss curve does not either, up to the order of floating-point sums.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.scheduling.queue_policy import Quota, allowed_sizes, quota_room
from service.schemas.fields import ACTIVE
from service.schemas.requests import JobSpec
from service.store.job_repository import QUEUE_ORDER, any_queued, gpus_in_use, job_world_sizes
from service.store.tables import Job


def relaunch_size(
    session: Session,
    job: Job,
    *,
    total: int,
    ray_free: Callable[[], int | None],
    quota: Quota = lambda owner: None,
) -> int | None:
    """The N a relaunch (a retry, a recovery after a restart, a growth) runs at: the largest of the
    job's sizes that is free and within its owner's quota (queue.allowed_sizes, as a start's), leaving
    the head of the queue what it needs to start where that still leaves the job one of its sizes
    (else the job, admitted first, takes what is free; its fewest if none is). A borrowed job keeps
    at most the N it had (it never grows). None when its owner's quota no longer holds even its
    fewest (the quota changed, or its other jobs took the room): it goes back to the queue.
    Free is the database's count (GPUs less those other jobs hold), and no more than Ray's
    (ray_free(): what a lost node or another workload leaves; None when Ray does not say)."""
    sizes = job_world_sizes(job)
    room = quota_room(job.owner, quota=quota, held=held_by_owner(session, besides=job.id))
    if job.borrowed:
        room = job.world_size or job.num_gpus
    if room is not None and sizes[0] > room:
        return None
    if len(sizes) == 1:
        return sizes[0]
    free = total - gpus_in_use(session, besides=job.id)
    if (in_ray := ray_free()) is not None:
        free = min(free, in_ray)
    head = session.scalar(select(Job).where(Job.status == "queued").order_by(*QUEUE_ORDER).limit(1))
    if head is not None and (fits := allowed_sizes(sizes, free=free - job_world_sizes(head)[0], room=room)):
        return fits[-1]
    fits = allowed_sizes(sizes, free=free, room=room)
    return fits[-1] if fits else sizes[0]


def held_by_owner(session: Session, *, besides: int | None = None) -> dict[str | None, int]:
    """Owner -> the GPUs its active jobs hold (each its current N), not counting job `besides`."""
    query = select(Job.owner, func.sum(func.coalesce(Job.world_size, Job.num_gpus))).where(Job.status.in_(ACTIVE))
    if besides is not None:
        query = query.where(Job.id != besides)
    return {owner: int(gpus) for owner, gpus in session.execute(query.group_by(Job.owner)).all()}


def growable(session: Session, *, total: int, quota: Quota = lambda owner: None) -> list[tuple[Job, int]]:
    """(job, the N it would grow to) for each running elastic job below its most GPUs that saves
    checkpoints, while GPUs are free and no job is queued (the queue comes first: free GPUs are the
    head's to wait for), oldest first, each taking what the ones before it leave and its owner's
    quota allows (a borrowed job does not grow)."""
    if any_queued(session):
        return []
    free = total - gpus_in_use(session)
    running = session.scalars(select(Job).where(Job.status == "running", Job.min_gpus < Job.num_gpus).order_by(Job.id))
    out = []
    held = held_by_owner(session)
    for job in running:
        current = job.world_size or job.num_gpus
        room = quota_room(job.owner, quota=quota, held=held)
        larger = allowed_sizes(
            [n for n in job_world_sizes(job) if n > current],
            free=current + free,
            room=None if room is None else current + room,
        )
        if larger and not job.borrowed and JobSpec.model_validate(job.spec).checkpoint_every:
            out.append((job, larger[-1]))
            free -= larger[-1] - current
            held[job.owner] = held.get(job.owner, 0) + larger[-1] - current
    return out
