"""The queue and a job's place in it: GET /v1/queue (the queued jobs in the order they start, why each
waits, and each owner's GPUs against their quota), a job's priority, tags and notes (PATCH /v1/jobs/{id}), suspend and
resume. The rules are service/scheduling/controls.py's."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from service.api import job_responses
from service.api.deps import AppStateDep, JobId, PrincipalDep, ReaderDep, SessionDep, SettingsDep, errors, json_response
from service.auth import check_can_steer
from service.scheduling import controls, dependencies
from service.schemas.requests import JobPatch
from service.schemas.responses import JobPublic, QueuePublic
from service.store import job_repository

router = APIRouter(tags=["queue"])
_ERRORS = errors(401, 403, 404, 409, 422)


@router.get("/queue", response_model=QueuePublic, responses=_ERRORS)
def queue(
    session: SessionDep,
    settings: SettingsDep,
    runtime: AppStateDep,
    _: ReaderDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
) -> Response:
    """The first `limit` queued jobs by priority, then submission, each with the reason it waits as of the
    scheduler's last tick and when it is estimated to start, and each owner's GPUs in use against their
    quota. Everyone's: names, owners, priorities and GPUs, never a spec (as GET /v1/jobs shows them)."""
    reasons = runtime.scheduler.queue_reasons()
    starts = runtime.scheduler.estimated_starts(session, limit=limit)
    return json_response(controls.queue_view(session, reasons=reasons, settings=settings, limit=limit, starts=starts))


@router.patch("/jobs/{job_id}", response_model=JobPublic, responses=_ERRORS)
def patch_job(
    job_id: JobId, body: JobPatch, session: SessionDep, settings: SettingsDep, principal: PrincipalDep
) -> Response:
    """A new priority for a queued, running or suspended job, up to the caller's ceiling (a 403
    forbidden_priority above it; 409 once the job has ended); new tags (the whole set) or notes at any
    time; a new depends_on (all of it) before it starts (409 after). Its owner or an admin only."""
    job = job_repository.get_job(session, job_id)
    what = "change the priority of" if body.priority is not None else "change the tags or notes of"
    check_can_steer(principal, job_id=job.id, owner=job.owner, action=what)
    if body.priority is not None:
        controls.set_priority(session, job, body.priority, settings=settings, principal=principal)
    if body.tags is not None or body.notes is not None:
        job_repository.set_labels(session, job, tags=body.tags, notes=body.notes)
    if body.depends_on is not None:
        dependencies.set_needs(session, job, body.depends_on)
    return json_response(
        job_responses.job_public(
            job,
            position=job_repository.queue_position(session, job, fifo=settings.queue_policy == "fifo"),
            principal=principal,
        )
    )


@router.post("/jobs/{job_id}/suspend", status_code=202, response_model=JobPublic, responses=_ERRORS)
def suspend_job(job_id: JobId, session: SessionDep, principal: PrincipalDep) -> Response:
    """A queued job is suspended at once; an active one stops at its next step boundary with a checkpoint
    (within ZERO1_PREEMPT_GRACE_S) and waits, holding no GPU, until resumed. Its owner or an admin only."""
    check_can_steer(principal, job_id=job_id, owner=job_repository.get_job(session, job_id).owner, action="suspend")
    job = controls.suspend_job(session, job_id)
    return json_response(job_responses.job_public(job, position=None, principal=principal), status_code=202)


@router.post("/jobs/{job_id}/resume", status_code=202, response_model=JobPublic, responses=_ERRORS)
def resume_job(job_id: JobId, session: SessionDep, principal: PrincipalDep, settings: SettingsDep) -> Response:
    """A suspended job goes back to the queue, in its place by priority and submission. Its owner or an admin only."""
    check_can_steer(principal, job_id=job_id, owner=job_repository.get_job(session, job_id).owner, action="resume")
    job = controls.resume_job(session, job_id)
    return json_response(
        job_responses.job_public(
            job,
            position=job_repository.queue_position(session, job, fifo=settings.queue_policy == "fifo"),
            principal=principal,
        ),
        status_code=202,
    )
