"""Storing a submitted job: queued with its first event, under its owner's limit of queued jobs, and
idempotent by its Idempotency-Key (the same key and body return the job stored first; another body, or
another user's key, a 409). Admission (service/intake/admission.py) checks the job before.

Functions take the request's session and only flush; the caller commits.
"""

from __future__ import annotations

import hashlib
import json

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.errors import ServiceError
from service.scheduling import dependencies
from service.schemas.requests import JobSpec
from service.schemas.responses import PlanPublic
from service.store.tables import Job, JobDependency, JobEvent, JobTag
from workers.memory.model import GB


def request_hash(spec: JobSpec) -> str:
    """The body's digest, canonical JSON: a reused Idempotency-Key must come with the same one."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def submitted_reason(spec: JobSpec, plan: PlanPublic) -> str:
    """A job's first event: "submitted", and for zero_stage auto the stage it picked and why."""
    if spec.zero_stage != "auto":
        return "submitted"
    skipped = [
        f"stage {stage} needs {plan.stages[str(stage)] / GB:.2f} GB per GPU at N = {plan.num_gpus}, above the "
        f"{plan.gpu_memory_bytes / GB:.2f} GB of each GPU"
        for stage in spec.stages()
        if stage < plan.stage
    ]
    why = "; ".join(skipped) if skipped else "the first stage that fits: it sends the least"
    return f"submitted; zero_stage auto: stage {plan.stage} ({why})"


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
    dependencies.check(session, spec.depends_on)
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
        notes=spec.notes,
        tag_rows=[JobTag(tag=tag) for tag in spec.tags],
        needs_rows=[JobDependency(needs_id=needed) for needed in spec.depends_on],
    )
    try:
        # the job and its first event in one savepoint: on SQLite, whose driver opens no
        # transaction before a SAVEPOINT, releasing it commits, and the scheduler could see
        # (and start) a job whose "queued" event was not yet written
        with session.begin_nested():
            session.add(job)
            session.flush()
            session.add(
                JobEvent(
                    job_id=job.id, from_status=None, to_status="queued", reason=submitted_reason(spec, plan), gpus=0
                )
            )
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
    """The job stored first under `key`, if this is the same user's same body (a 409 otherwise)."""
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
