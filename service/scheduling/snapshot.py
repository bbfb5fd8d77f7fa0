"""What a tick decides on, read from the database for the queue's policy (service/scheduling/queue_policy.py):
the queued jobs in the queue's order (waiting) and the active ones (holding), with what least-loss
preemption weighs when victims are chosen (with_loss_facts: a step's GPU-seconds, the newest
checkpoint, the last start-up). service/scheduling/dispatch.py carries the decision out."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from service.scheduling import dependencies
from service.scheduling.queue_policy import Holding, Waiting
from service.schemas.fields import ACTIVE
from service.schemas.requests import world_sizes
from service.store.job_repository import job_world_sizes, queue_order
from service.store.tables import Job, JobEvent, Metric

_QUEUE_BATCH = 256
"""Queued jobs read at a time: a tick reads the queue only as far as its policy looks."""


def waiting(session: Session, *, fifo: bool = False, paced: bool = False) -> Iterator[Waiting]:
    """The queued jobs in the queue's order (submission order for `fifo`), read lazily; those whose
    dependencies have not all succeeded left out. `paced`: with the steps each has left and its step's
    GPU-seconds (for estimates; a tick's policy needs neither)."""
    # the numbers of the spec and the latest row needed, read by the database: not every row's whole spec decoded
    micro = Job.spec["micro_batch_size"].as_integer()
    batch = Job.spec["global_batch_size"].as_integer()
    columns = [Job.id, Job.priority, Job.owner, Job.num_gpus, Job.min_gpus, micro, batch]
    if paced:
        columns += [Job.steps, Job.step, Job.latest["step_time_s"].as_float(), Job.latest["world_size"].as_integer()]
    queued = select(*columns).where(Job.status == "queued", dependencies.all_succeeded())
    query = queued.order_by(*queue_order(fifo=fifo))
    for job_id, priority, owner, num_gpus, min_gpus, micro, batch, *pace in session.execute(
        query.execution_options(yield_per=_QUEUE_BATCH)
    ):
        if min_gpus is None or min_gpus == num_gpus:
            sizes = [num_gpus]  # not elastic: no arithmetic
        else:
            micro = micro or 1
            sizes = world_sizes(
                min_gpus=min_gpus, num_gpus=num_gpus, micro_batch_size=micro, batch_size=batch or micro * num_gpus
            )
        job = Waiting(id=job_id, priority=priority, owner=owner, sizes=tuple(sizes))
        if pace:
            steps, step, step_time_s, ran_at = pace
            steps_left = steps - (-1 if step is None else step) - 1
            step_gpu_s = _step_gpu_s(step_time_s, ran_at=ran_at, default_n=num_gpus)
            job = replace(job, steps_left=steps_left, step_gpu_s=step_gpu_s)
        yield job


def _step_gpu_s(step_time_s: float | None, *, ran_at: int | None, default_n: int) -> float | None:
    """A step's GPU-seconds from a row's step time and the N it ran at (rows stored before world_size
    was kept: `default_n`)."""
    return None if step_time_s is None else step_time_s * (ran_at or default_n)


def holding(session: Session, *, age_s: Callable[[int], float]) -> list[Holding]:
    """The active jobs, each with its age (`age_s(job id)`: seconds since its attempt started or resized)."""
    jobs = session.scalars(select(Job).where(Job.status.in_(ACTIVE)).order_by(Job.id))
    return [
        Holding(
            id=job.id,
            priority=job.priority,
            owner=job.owner,
            gpus=job.world_size or job.num_gpus,
            sizes=tuple(job_world_sizes(job)),
            running=job.status == "running" and not (job.cancel_requested or job.suspend_requested),
            age_s=age_s(job.id),
            borrowed=job.borrowed,
            backfilled=job.backfilled,
            step=job.step,
            steps=job.steps,
            step_gpu_s=_step_gpu_s(
                (job.latest or {}).get("step_time_s"),
                ran_at=(job.latest or {}).get("world_size"),
                default_n=job.world_size or job.num_gpus,
            ),
            checkpoint_every=job.spec.get("checkpoint_every") or 0,
            ending=bool(job.cancel_requested or job.suspend_requested or job.stop_early),
        )
        for job in jobs
    ]


def with_loss_facts(session: Session, held: list[Holding]) -> list[Holding]:
    """`held` with what a stop of each would lose (queue_policy.stop_loss_gpu_s), from what the database
    stores: its newest checkpoint's step (the last periodic one by its steps, or the one its attempt
    resumed from, the step before its first row), the seconds its last periodic checkpoint held it up
    (that row's checkpoint_blocked_s) and its last start's (its last starting or restarting event to
    the running one after it). Three queries, read only when victims are to be chosen or starts
    estimated."""
    if not held:
        return held
    ids = [h.id for h in held]
    attempt_first = dict(
        session.execute(
            select(Metric.job_id, func.min(Metric.step))
            .join(Job, (Job.id == Metric.job_id) & (Job.attempt == Metric.attempt))
            .where(Metric.job_id.in_(ids))
            .group_by(Metric.job_id)
        ).all()
    )
    periodic = {h.id: _periodic_step(h) for h in held}
    at_steps = [and_(Metric.job_id == i, Metric.step == step) for i, step in periodic.items() if step is not None]
    blocked = {}
    if at_steps:
        rows = session.execute(
            select(Metric.job_id, Metric.checkpoint_blocked_s).where(or_(*at_steps), Metric.superseded.is_(False))
        )
        blocked = {job_id: seconds for job_id, seconds in rows if seconds is not None}
    starts: dict[int, dict[str, datetime]] = defaultdict(dict)
    for job_id, to_status, at in session.execute(
        select(JobEvent.job_id, JobEvent.to_status, func.max(JobEvent.at))
        .where(JobEvent.job_id.in_(ids), JobEvent.to_status.in_(("starting", "restarting", "running")))
        .group_by(JobEvent.job_id, JobEvent.to_status)
    ):
        starts[job_id][to_status] = at
    return [
        replace(
            h,
            checkpoint_step=_newest_checkpoint(h, periodic=periodic[h.id], first=attempt_first.get(h.id)),
            checkpoint_s=blocked.get(h.id, 0.0),
            restart_s=_restart_s(starts.get(h.id, {})),
        )
        for h in held
    ]


def _periodic_step(h: Holding) -> int | None:
    """The last step through `h.step` after which a periodic checkpoint falls (None: none yet)."""
    if not h.checkpoint_every or h.step is None or h.step + 1 < h.checkpoint_every:
        return None
    return (h.step + 1) // h.checkpoint_every * h.checkpoint_every - 1


def _newest_checkpoint(h: Holding, *, periodic: int | None, first: int | None) -> int | None:
    """The later of its last periodic checkpoint and the one its attempt resumed from (the step before
    the attempt's first row; before that row, its last stored step: a resume keeps the rows up to its
    checkpoint)."""
    resumed = first - 1 if first is not None else h.step
    found = [step for step in (periodic, resumed) if step is not None and step >= 0]
    return max(found, default=None)


def _restart_s(events: dict[str, datetime]) -> float:
    """Seconds from its last start (starting or restarting) to the running after it; 0 when unknown."""
    running = events.get("running")
    began = max((events[k] for k in ("starting", "restarting") if k in events), default=None)
    if running is None or began is None or running < began:
        return 0.0
    return (running - began).total_seconds()
