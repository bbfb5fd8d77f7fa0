"""GPU usage: the GPU-seconds jobs held and the GPU-seconds they spent training, by owner and priority
class over a period. The one definition that GET /v1/usage, the dashboard's /usage, a sweep's
gpu_seconds and the zero1_gpu_seconds_*_total counters (service/scheduling/gauges.py) share.

- **Held**: from the jobs' events. Each event records the GPUs the job holds from it until its next
  (JobEvent.gpus: its attempt's N on a move into starting, running or restarting, 0 on any other), so a
  job holds N GPUs from its start to its end, from a relaunch to the next, at each attempt's own N (an
  elastic job's resize is a relaunch). A job whose last event holds GPUs holds them up to now. Events
  stored before the column existed (null) hold the job's world_size (else num_gpus) in an active status.
  Within a relaunch that fails before it runs, the retry's N counts from the next event only (no event
  marks a restarting job's second relaunch).
- **Training**: from the stored metric rows: each row's step_time_s x its N (world_size). step_time_s
  is measured around the step's forward, backward and optimizer step alone (workers/training/loop.py
  run_step): the checkpoint's stall (checkpoint_blocked_s), the evaluation and the wait for a start are
  outside it, so nothing is subtracted. Superseded rows count (the steps ran; a retry ran them again), and
  so do skipped ones (fp16 overflow). A row counts at the time it was stored (Metric.stored_at, within a
  poll of its step's end); rows stored before that column existed count at their job's start.
- **Priority class**: the job's priority (0-100) as it is now: zero1 names no ranges of priorities.
- **A period** [since, until): a span counts the part of it inside, a row if stored inside.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, false, func, or_, select, true
from sqlalchemy.orm import Session

from service.auth import Principal
from service.errors import ServiceError
from service.scheduling.controls import gpus_by_owner
from service.schemas.fields import ACTIVE
from service.schemas.usage import QuotaUsagePublic, UsagePublic, UsageRowPublic
from service.settings import Settings
from service.store.tables import Job, JobEvent, Metric, utcnow
from workers.records import MetricRow

Key = tuple[str | None, int]
"""(owner, priority class)."""


@dataclass(frozen=True, slots=True)
class JobUsage:
    """One job's GPU-seconds in a period."""

    owner: str | None
    priority: int
    held: float = 0.0
    training: float = 0.0


def month_start(now: datetime) -> datetime:
    """The first instant of `now`'s month, in UTC."""
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def period(since: datetime | None, until: datetime | None, *, now: datetime) -> tuple[datetime, datetime]:
    """[since, until) in UTC (a time without a zone is UTC): by default from the start of the current month
    to now; a 422 naming the parameter for a time UTC cannot hold, or an until not after since."""
    start = month_start(now) if since is None else _utc(since, "since")
    end = now if until is None else _utc(until, "until")
    if end <= start and until is None:
        raise _invalid("since", f"must be before until (now, {end.isoformat()}), got {start.isoformat()}")
    if end <= start:
        raise _invalid("until", f"must be after since ({start.isoformat()}), got {end.isoformat()}")
    return start, end


def _utc(moment: datetime, name: str) -> datetime:
    try:
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (OverflowError, ValueError):  # year 1 at +01:00 is before year 1 in UTC
        raise _invalid(name, f"{moment.isoformat()} is outside the times UTC can hold") from None


def _invalid(name: str, why: str) -> ServiceError:
    detail = [{"field": name, "message": why, "type": "value_error"}]
    return ServiceError(f"{name}: {why}", status_code=422, error="invalid_request", detail=detail)


def _aware(at: datetime) -> datetime:
    """SQLite gives back naive datetimes (stored as UTC)."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


# --------------------------------------------------------------------------- held


def held_spans(
    events: Iterable[tuple[int, str, datetime, int | None]], *, fallback: dict[int, int], now: datetime
) -> Iterator[tuple[int, datetime, datetime, int]]:
    """(job id, from, to, GPUs) of each span a job held GPUs, from (job id, to_status, at, gpus) events in the
    order they happened: from an event that holds GPUs to the job's next event, or to now after its last.
    `fallback`: job id -> the N an active event stored without gpus (null) holds."""
    opened: dict[int, tuple[datetime, int]] = {}
    for job_id, to_status, at, gpus in events:
        at = _aware(at)
        if job_id in opened:
            start, n = opened.pop(job_id)
            yield job_id, start, at, n
        held = gpus if gpus is not None else (fallback.get(job_id, 0) if to_status in ACTIVE else 0)
        if held:
            opened[job_id] = (at, held)
    for job_id, (start, n) in opened.items():
        yield job_id, start, max(start, now), n


def _overlap_s(start: datetime, end: datetime, since: datetime | None, until: datetime | None) -> float:
    """Seconds of [start, end) inside [since, until) (either open when None)."""
    low = start if since is None else max(start, since)
    high = end if until is None else min(end, until)
    return max(0.0, (high - low).total_seconds())


def _held_by_job(
    session: Session,
    ids: Any,
    *,
    fallback: dict[int, int],
    since: datetime | None,
    until: datetime | None,
    now: datetime,
) -> dict[int, float]:
    """Job id -> GPU-seconds held within [since, until) (either open when None), for the jobs `ids` selects;
    `fallback`: each one's N for events stored without gpus."""
    events = session.execute(
        select(JobEvent.job_id, JobEvent.to_status, JobEvent.at, JobEvent.gpus)
        .where(JobEvent.job_id.in_(ids))
        .order_by(JobEvent.id)
    )
    held: dict[int, float] = defaultdict(float)
    for job_id, start, end, n in held_spans(events, fallback=fallback, now=now):
        held[job_id] += n * _overlap_s(start, end, since, until)
    return dict(held)


def held_gpu_seconds(session: Session, jobs: list[Job], *, now: datetime | None = None) -> float:
    """GPUs x seconds the jobs held them, from their events, over all time (an active job's up to now): a
    sweep's gpu_seconds."""
    if not jobs:
        return 0.0
    fallback = {job.id: job.world_size or job.num_gpus for job in jobs}
    ids = select(Job.id).where(Job.id.in_(list(fallback)))
    return sum(_held_by_job(session, ids, fallback=fallback, since=None, until=None, now=now or utcnow()).values())


# --------------------------------------------------------------------------- training


def row_gpu_seconds(row: MetricRow, job: Job) -> float:
    """A step's training GPU-seconds: its step_time_s x its N (the job's, for a row without one)."""
    return row.step_time_s * (row.world_size or job.world_size or job.num_gpus)


def _training_by_job(session: Session, where: list[ColumnElement[bool]], *, since: datetime, until: datetime):
    """Job id -> GPU-seconds of the training steps stored within [since, until), for the jobs `where` picks."""
    n = func.coalesce(Metric.world_size, Job.world_size, Job.num_gpus)
    at = func.coalesce(Metric.stored_at, Job.started_at)
    rows = session.execute(
        select(Metric.job_id, func.sum(Metric.step_time_s * n))
        .join(Job, Job.id == Metric.job_id)
        .where(*where, at >= since, at < until)
        .group_by(Metric.job_id)
    )
    return {job_id: float(total or 0.0) for job_id, total in rows}


# --------------------------------------------------------------------------- a period


def _alive_in(since: datetime, until: datetime) -> list[ColumnElement[bool]]:
    """The jobs that may have held GPUs or trained within [since, until): started before its end, not
    ended before its start."""
    return [
        Job.started_at.is_not(None),
        Job.started_at < until,
        or_(Job.finished_at.is_(None), Job.finished_at > since),
    ]


def _visible(principal: Principal) -> ColumnElement[bool]:
    """The jobs whose usage the caller sees: an admin everyone's, a user their own, a public reader none."""
    if principal.admin:
        return true()
    return Job.owner == principal.user if principal.user is not None else false()


def usage_by_job(
    session: Session,
    *,
    since: datetime,
    until: datetime,
    now: datetime,
    principal: Principal | None = None,
    training: bool = True,
) -> dict[int, JobUsage]:
    """Each job's GPU-seconds held and (unless not `training`) spent training within [since, until), for the
    jobs with any (those the principal may see; all without one)."""
    where = _alive_in(since, until) + ([] if principal is None else [_visible(principal)])
    jobs = session.execute(select(Job.id, Job.owner, Job.priority, Job.world_size, Job.num_gpus).where(*where)).all()
    if not jobs:
        return {}
    fallback = {job_id: world_size or num_gpus for job_id, _, _, world_size, num_gpus in jobs}
    held = _held_by_job(session, select(Job.id).where(*where), fallback=fallback, since=since, until=until, now=now)
    trained = _training_by_job(session, where, since=since, until=until) if training else {}
    found = {}
    for job_id, owner, priority, _, _ in jobs:
        usage = JobUsage(owner=owner, priority=priority, held=held.get(job_id, 0.0), training=trained.get(job_id, 0.0))
        if usage.held > 0 or usage.training > 0:
            found[job_id] = usage
    return found


def by_class(jobs: dict[int, JobUsage]) -> dict[Key, tuple[int, float, float]]:
    """(owner, priority class) -> (jobs, GPU-seconds held, GPU-seconds training)."""
    summed: dict[Key, tuple[int, float, float]] = {}
    for usage in jobs.values():
        count, held, training = summed.get((usage.owner, usage.priority), (0, 0.0, 0.0))
        summed[(usage.owner, usage.priority)] = (count + 1, held + usage.held, training + usage.training)
    return summed


def report(
    session: Session,
    *,
    principal: Principal,
    settings: Settings,
    since: datetime,
    until: datetime,
    now: datetime | None = None,
) -> UsagePublic:
    """GET /v1/usage: the caller's usage (an admin's: everyone's) over [since, until) by owner and priority
    class, and each owner's GPUs and usage against their quota."""
    now = now or utcnow()
    summed = by_class(usage_by_job(session, since=since, until=until, now=now, principal=principal))
    ordered = sorted(summed.items(), key=lambda item: (item[0][0] or "", -item[0][1]))
    data = [
        UsageRowPublic(
            owner=owner, priority_class=priority, jobs=count,
            gpu_seconds_held=round(held, 3), gpu_seconds_training=round(training, 3),
        )
        for (owner, priority), (count, held, training) in ordered
    ]  # fmt: skip
    seconds = max(0.0, (min(until, now) - since).total_seconds())
    return UsagePublic(
        since=since,
        until=until,
        seconds=round(seconds, 3),
        gpu_seconds_held=round(sum(row.gpu_seconds_held for row in data), 3),
        gpu_seconds_training=round(sum(row.gpu_seconds_training for row in data), 3),
        data=data,
        quotas=_quotas(session, data, principal=principal, settings=settings, seconds=seconds),
    )


def _quotas(
    session: Session, data: list[UsageRowPublic], *, principal: Principal, settings: Settings, seconds: float
) -> list[QuotaUsagePublic]:
    """Each owner in `data`, holding or waiting for GPUs now, or named by ZERO1_GPU_QUOTAS (an ordinary
    user: themselves alone, a public reader: none), with their GPUs now and their usage against the quota."""
    now_held = gpus_by_owner(session)
    if principal.admin:
        owners = {row.owner for row in data} | set(now_held) | {name for name in settings.gpu_quotas if name != "*"}
    else:
        owners = {principal.user} if principal.user is not None else set()
    quotas = []
    for owner in sorted(owners, key=lambda name: name or ""):
        gpus, borrowed = now_held.get(owner, (0, 0))
        held = sum(row.gpu_seconds_held for row in data if row.owner == owner)
        training = sum(row.gpu_seconds_training for row in data if row.owner == owner)
        quota = settings.gpu_quota(owner)
        allowed = None if quota is None else round(quota * seconds, 3)
        quotas.append(
            QuotaUsagePublic(
                owner=owner, gpus_in_use=gpus, borrowed_gpus=borrowed, quota=quota,
                gpu_seconds_held=round(held, 3), gpu_seconds_training=round(training, 3),
                quota_gpu_seconds=allowed, quota_used=round(held / allowed, 4) if allowed else None,
            )
        )  # fmt: skip
    return quotas
