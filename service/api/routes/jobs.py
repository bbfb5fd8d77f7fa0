"""The jobs API: submit (admitted by the memory model), list, get, cancel, metrics, events, artifacts."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel

from service import admission, jobs
from service.api.deps import ClusterDep, PrincipalDep, ReaderDep, RuntimeDep, SessionDep, SettingsDep
from service.auth import check_can_cancel
from service.bundles import require_bundle
from service.hf import check_model_path
from service.launcher import dataset_cache_dir
from service.responses import (
    ArtifactsPublic,
    DryRunPublic,
    ErrorPublic,
    EventsPublic,
    JobPublic,
    JobsPublic,
    MetricsPublic,
)
from service.schemas import JobSpec, JobStatus
from workers.memory import GB

router = APIRouter(prefix="/jobs", tags=["jobs"])
_ERRORS = {status: {"model": ErrorPublic} for status in (401, 403, 404, 409, 413, 422, 429)}
_SUBMITTED = {
    200: {
        "model": JobPublic | DryRunPublic,
        "description": "A dry run's plan, or the job this Idempotency-Key created before",
    }
}
# ids are 64-bit in the database, steps 32-bit: a larger number is a 422 here, not a 500 from its driver
_MAX_ID, _MAX_STEP = 2**63 - 1, 2**31 - 1
JobId = Annotated[int, Path(ge=1, le=_MAX_ID)]


def _json(body: BaseModel, *, status_code: int = 200) -> Response:
    """The body as JSON, made in the endpoint's own worker thread.

    A returned model is validated again by FastAPI in a second trip to the threadpool, and the
    request's session commits (freeing SQLite's write lock and its pooled connection) only after
    that trip. Under load every worker thread can be waiting on that lock or the pool, and the
    trip never comes: a deadlock that 30 s timeouts end in 500s (tests/test_load.py). A Response
    is sent as it is, and the session's commit needs no worker of the shared pool.
    """
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json")


@router.post(
    "",
    status_code=201,
    response_model=JobPublic | DryRunPublic,
    responses={**_SUBMITTED, **_ERRORS, 503: {"model": ErrorPublic}},
)
def submit_job(
    spec: JobSpec,
    session: SessionDep,
    cluster: ClusterDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    runtime: RuntimeDep,
    dry_run: bool = False,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Response:
    """Plan the job with the ZeRO-1 memory model against the cluster; queue it if it fits."""
    spec = check_model_path(spec, model_roots=settings.model_roots)
    if spec.code is not None:  # before its trace runs the bundle's code
        require_bundle(session, spec.code, principal=principal, store=runtime.code)
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    plan = admission.admit(spec, cluster=cluster, overhead_bytes=overhead_bytes, tracer=runtime.tracer)
    spec = admission.check_data(spec, data_roots=settings.data_roots)
    admission.check_storage(runtime.launcher.storage_problems(), uri=settings.checkpoint_uri)
    admission.check_dataset(
        spec,
        model=spec.model_spec(plan=plan, model_roots=settings.model_roots),
        checker=runtime.datasets,
        data_roots=settings.data_roots,
        cache_dir=str(dataset_cache_dir(settings.checkpoint_uri)),
    )
    if dry_run:
        return _json(DryRunPublic(dry_run=True, admitted=True, plan=plan))
    job, created = jobs.submit_job(
        session,
        spec=spec,
        plan=plan,
        idempotency_key=idempotency_key,
        owner=principal.user,
        max_queued=settings.max_queued_jobs_per_user,
    )
    public = jobs.job_public(job, position=jobs.queue_position(session, job), principal=principal)
    return _json(public, status_code=201 if created else 200)  # 200: the job this key and body created before


@router.get("", response_model=JobsPublic, responses=_ERRORS)
def list_jobs(
    session: SessionDep,
    principal: ReaderDep,
    status: Annotated[list[JobStatus] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[int | None, Query(ge=0, le=_MAX_ID, description="next_cursor of the previous page")] = None,
) -> Response:
    """Newest first, optionally only some statuses (repeat ?status=); others' jobs without their details."""
    data, next_cursor = jobs.list_jobs(session, statuses=status, limit=limit, cursor=cursor, principal=principal)
    return _json(JobsPublic(data=data, next_cursor=next_cursor))


@router.get("/{job_id}", response_model=JobPublic, responses=_ERRORS)
def get_job(job_id: JobId, session: SessionDep, principal: ReaderDep) -> Response:
    """Anyone's job; spec, latest and error only to its owner and admins."""
    job = jobs.get_job(session, job_id)
    return _json(jobs.job_public(job, position=jobs.queue_position(session, job), principal=principal))


@router.post("/{job_id}/cancel", status_code=202, response_model=JobPublic, responses=_ERRORS)
def cancel_job(job_id: JobId, session: SessionDep, principal: PrincipalDep) -> Response:
    """A queued job is cancelled at once; a running one within a scheduler tick. Its owner or an admin only."""
    check_can_cancel(principal, job_id=job_id, owner=jobs.get_job(session, job_id).owner)
    job = jobs.cancel_job(session, job_id)
    return _json(jobs.job_public(job, position=None, principal=principal), status_code=202)


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=_ERRORS)
def job_metrics(
    job_id: JobId,
    session: SessionDep,
    principal: ReaderDep,
    after_step: Annotated[int | None, Query(ge=-1, le=_MAX_STEP)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    max_points: Annotated[int | None, Query(ge=2, le=10_000)] = None,
    evaluated: Annotated[bool, Query(description="Only the steps that evaluated (eval_loss set), unthinned.")] = False,
) -> Response:
    """Per-step metrics of the surviving attempt, oldest first; max_points thins them evenly. Its owner's and
    admins' only: to others a 404, as if there were no such job."""
    job = jobs.get_visible_job(session, job_id, principal=principal)
    data, next_after = jobs.job_metrics(
        session, job, after_step=after_step, limit=limit, max_points=max_points, evaluated=evaluated
    )
    return _json(MetricsPublic(data=data, next_after_step=next_after))


@router.get("/{job_id}/events", response_model=EventsPublic, responses=_ERRORS)
def job_events(job_id: JobId, session: SessionDep, principal: ReaderDep) -> Response:
    """The job's state changes and why; its owner's and admins' only (a 404 to others, as for metrics)."""
    job = jobs.get_visible_job(session, job_id, principal=principal)
    return _json(EventsPublic(data=jobs.job_events(session, job)))


@router.get("/{job_id}/artifacts", response_model=ArtifactsPublic, responses=_ERRORS)
def job_artifacts(job_id: JobId, session: SessionDep, principal: ReaderDep, runtime: RuntimeDep) -> Response:
    """The files of a succeeded job's final model, with their bytes and sha256; 409 while it has not
    succeeded. Its owner's and admins' only (a 404 to others, as for metrics)."""
    job = jobs.get_visible_job(session, job_id, principal=principal)
    _, files = jobs.job_artifacts(job, launcher=runtime.launcher)
    return _json(ArtifactsPublic(data=files, count=len(files)))


@router.get(
    "/{job_id}/artifacts/{name}",
    response_class=FileResponse,
    responses={**_ERRORS, 206: {"description": "The bytes a Range header asked for"}, 416: {}},
)
def job_artifact(
    job_id: JobId,
    name: Annotated[str, Path(min_length=1, max_length=255)],
    session: SessionDep,
    principal: ReaderDep,
    runtime: RuntimeDep,
) -> FileResponse:
    """One artifact's bytes, streamed; `Range: bytes=a-b` answers 206 with those bytes (416 past the
    end). Only a name the listing gives; the job's owner's and admins' only."""
    job = jobs.get_visible_job(session, job_id, principal=principal)
    path = jobs.artifact_file(job, name, launcher=runtime.launcher)
    return FileResponse(path, media_type="application/octet-stream", filename=name)
