"""The jobs API: submit (admitted by the memory model), list, get, cancel, metrics, logs, events, artifacts
(a job's priority, suspend and resume, and the queue: service/api/routes/queue.py)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api import downloads, job_responses, offload
from service.api.deps import (
    MAX_ID,
    AppStateDep,
    ClusterDep,
    JobId,
    JobStorageDep,
    PrincipalDep,
    ReaderDep,
    SessionDep,
    SettingsDep,
    errors,
    json_response,
)
from service.auth import Principal, check_can_steer
from service.intake import admission, submission
from service.intake.init_from import resolve_init_from
from service.planning.hf_paths import check_model_path
from service.scheduling import controls, job_states
from service.schemas.fields import MAX_TAGS, TERMINAL, JobStatus, Tag
from service.schemas.requests import JobSpec
from service.schemas.responses import (
    ArtifactPublic,
    ArtifactsPublic,
    DryRunPublic,
    ErrorPublic,
    EventsPublic,
    JobPublic,
    JobsPublic,
    LogLinePublic,
    LogsPublic,
    MetricsPublic,
    PlanPublic,
)
from service.store import job_repository
from service.store.artifacts import stream_artifact
from service.store.db import Database
from service.store.log_lines import read_logs
from service.store.tables import Job
from service.tracking.runs import run_link
from workers.memory.model import GB

router = APIRouter(prefix="/jobs", tags=["jobs"])
ERRORS = errors(401, 403, 404, 409, 413, 422, 429)
_SUBMITTED = {
    200: {
        "model": JobPublic | DryRunPublic,
        "description": "A dry run's plan, or the job this Idempotency-Key created before",
    }
}
_MAX_STEP = 2**31 - 1  # steps are 32-bit in the database: a larger one is a 422 here, not a 500


@router.post(
    "",
    status_code=201,
    response_model=JobPublic | DryRunPublic,
    responses={**_SUBMITTED, **ERRORS, 503: {"model": ErrorPublic}},
)
async def submit_job(
    spec: JobSpec,
    cluster: ClusterDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    runtime: AppStateDep,
    dry_run: bool = False,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Response:
    """Plan the job with the ZeRO-1 memory model against the cluster; queue it if it fits. Its trace and
    its dataset's tokenizing are awaited holding no request thread and no database connection, each in
    one of ZERO1_MAX_TASKS slots (ZERO1_MAX_TASKS_PER_USER per user; a 429 when none is free). The priority
    and the owner's GPU quota are checked first, before any of it."""
    priority = controls.check_priority(spec, settings=settings, principal=principal)
    controls.check_quota(spec, settings=settings, owner=principal.user)
    controls.check_notify(spec, settings=settings)
    spec = await run_in_threadpool(resolve_init_from, runtime.db, spec, principal=principal, storage=runtime.storage)
    spec = await offload.in_file_thread(check_model_path, spec, model_roots=settings.model_roots)
    if spec.code is not None:  # before its trace runs the bundle's code
        await offload.require_code(runtime, spec.code, principal=principal)
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    plan = await admission.admit_async(
        spec, cluster=cluster, overhead_bytes=overhead_bytes, tracer=runtime.tracer, user=principal.user
    )
    spec = await offload.in_file_thread(admission.check_data, spec, data_roots=settings.data_roots)
    admission.check_storage(await run_in_threadpool(runtime.storage.storage_problems), uri=settings.checkpoint_uri)
    summary = await admission.check_dataset(
        spec,
        model=spec.model_spec(plan=plan, model_roots=settings.model_roots),
        checker=runtime.datasets,
        data_roots=settings.data_roots,
        cache_dir=str(runtime.storage.dataset_cache_dir),
        user=principal.user,
    )
    spec = admission.with_token_uri(spec, summary)  # data on an object store: the token file the ranks fetch
    if dry_run:
        return json_response(DryRunPublic(dry_run=True, admitted=True, plan=plan))
    store = functools.partial(_store_job, runtime.db, spec=spec, plan=plan, principal=principal, priority=priority)
    fifo = settings.queue_policy == "fifo"
    return await run_in_threadpool(store, key=idempotency_key, max_queued=settings.max_queued_jobs_per_user, fifo=fifo)


def _store_job(
    db: Database,
    *,
    spec: JobSpec,
    plan: PlanPublic,
    principal: Principal,
    priority: int,
    key: str | None,
    max_queued: int,
    fifo: bool = False,
) -> Response:
    """The admitted job stored (or the one this Idempotency-Key created before) in one session of its
    own: the request's one commit point, opened only now that every check is done."""
    with db.session() as session:
        job, created = submission.submit_job(
            session,
            spec=spec,
            plan=plan,
            idempotency_key=key,
            owner=principal.user,
            max_queued=max_queued,
            priority=priority,
        )
        public = job_responses.job_public(
            job, position=job_repository.queue_position(session, job, fifo=fifo), principal=principal
        )
    return json_response(public, status_code=201 if created else 200)  # 200: the job this key and body created before


@router.get("", response_model=JobsPublic, responses=ERRORS)
def list_jobs(
    session: SessionDep,
    principal: ReaderDep,
    settings: SettingsDep,
    status: Annotated[list[JobStatus] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[int | None, Query(ge=0, le=MAX_ID, description="next_cursor of the previous page")] = None,
    tag: Annotated[
        list[Tag] | None, Query(max_length=MAX_TAGS, description="Only jobs with this tag (repeat: all of them)")
    ] = None,
) -> Response:
    """Newest first, optionally only some statuses (repeat ?status=) and only jobs with every ?tag= given;
    others' jobs without their details."""
    data, next_cursor = job_responses.list_jobs(
        session,
        statuses=status,
        limit=limit,
        cursor=cursor,
        principal=principal,
        fifo=settings.queue_policy == "fifo",
        tags=tag,
    )
    return json_response(JobsPublic(data=data, next_cursor=next_cursor))


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
def get_job(job_id: JobId, session: SessionDep, principal: ReaderDep, settings: SettingsDep) -> Response:
    """Anyone's job; spec, latest, error and its MLflow run only to its owner and admins."""
    job = job_repository.get_job(session, job_id)
    public = job_responses.job_public(
        job,
        position=job_repository.queue_position(session, job, fifo=settings.queue_policy == "fifo"),
        principal=principal,
    )
    if public.spec is not None:  # the caller may see its details
        public.mlflow = run_link(session, job, settings)
    return json_response(public)


@router.post("/{job_id}/cancel", status_code=202, response_model=JobPublic, responses=ERRORS)
def cancel_job(job_id: JobId, session: SessionDep, principal: PrincipalDep) -> Response:
    """A queued job is cancelled at once; a running one within a scheduler tick. Its owner or an admin only."""
    check_can_steer(principal, job_id=job_id, owner=job_repository.get_job(session, job_id).owner)
    job = job_states.cancel_job(session, job_id)
    return json_response(job_responses.job_public(job, position=None, principal=principal), status_code=202)


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=ERRORS)
def job_metrics(
    job_id: JobId,
    session: SessionDep,
    principal: ReaderDep,
    after_step: Annotated[int | None, Query(ge=-1, le=_MAX_STEP)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    max_points: Annotated[int | None, Query(ge=2, le=10_000)] = None,
    evaluated: Annotated[bool, Query(description="Only the steps that evaluated (eval_loss set), unthinned.")] = False,
    checkpointed: Annotated[
        bool, Query(description="Only the checkpoint steps (checkpoint_blocked_s set), unthinned.")
    ] = False,
) -> Response:
    """Per-step metrics of the surviving attempt, oldest first; max_points thins them evenly. Its owner's and
    admins' only: to others a 404, as if there were no such job."""
    job = job_repository.get_visible_job(session, job_id, principal=principal)
    data, next_after = job_responses.job_metrics(
        session,
        job,
        after_step=after_step,
        limit=limit,
        max_points=max_points,
        evaluated=evaluated,
        checkpointed=checkpointed,
    )
    return json_response(MetricsPublic(data=data, next_after_step=next_after))


@router.get(
    "/{job_id}/logs",
    response_model=LogsPublic,
    responses={
        **ERRORS,
        200: {
            "model": LogsPublic,
            "description": "A page of lines; with follow=true, a text/event-stream of them (one `data:` line "
            "each, `id:` its seq) that ends with `event: end` once the job has ended",
            "content": {"text/event-stream": {}},
        },
    },
)
def job_logs(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    principal: ReaderDep,
    runtime: AppStateDep,
    rank: Annotated[int | None, Query(ge=0, le=_MAX_STEP, description="Only this rank's lines")] = None,
    attempt: Annotated[int | None, Query(ge=0, le=_MAX_STEP, description="Only this attempt's lines")] = None,
    after: Annotated[int, Query(ge=0, le=MAX_ID, description="`next` of the previous page, or a line's seq")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    follow: Annotated[bool, Query(description="Stream the lines as they come, until the job ends")] = False,
) -> Response:
    """Every rank's stdout, stderr and logging, oldest first (the job's newest ZERO1_LOG_MAX_BYTES; a
    marker line says how many older lines were dropped). Its owner's and admins' only (a 404 to others)."""
    job = job_repository.get_visible_job(session, job_id, principal=principal)
    selection = {"rank": rank, "attempt": attempt, "limit": limit}
    if not follow:
        data, cursor = read_logs(session, job, after=after, **selection)
        return json_response(LogsPublic(data=data, next=cursor))
    runtime.log_followers.acquire(principal.user)  # a 429 past ZERO1_MAX_LOG_FOLLOWERS(_PER_USER)
    return _FollowerStream(
        _follow(request, runtime.db, job_id, after=after, **selection),
        release=functools.partial(runtime.log_followers.release, principal.user),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _FollowerStream(StreamingResponse):
    """A log stream that gives its follower slot back when it ends, however it ends (the job ended,
    the client went, the server stops): in __call__, which runs even when the stream never starts."""

    def __init__(self, content, *, release, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


_FOLLOW_POLL_S = 0.5
_KEEPALIVE_S = 15.0


async def _follow(request: Request, db: Database, job_id: int, *, after: int, **selection: Any) -> AsyncIterator[str]:
    """Server-sent events: each stored line after `after` as it comes, then `end` once the job has
    ended and its last line is sent; a comment every 15 s of quiet keeps proxies from closing it.
    Ends when the client goes."""
    cursor = after
    quiet_since = time.monotonic()
    while not await request.is_disconnected():
        status, data = await run_in_threadpool(_logs_after, db, job_id, cursor, selection)
        for line in data:
            yield f"id: {line['seq']}\ndata: {LogLinePublic(**line).model_dump_json()}\n\n"
        if data:
            cursor = data[-1]["seq"]
            quiet_since = time.monotonic()
            if len(data) == selection["limit"]:
                continue  # more are stored: no wait
        if status in TERMINAL:  # read before the lines: the last ones were stored with the status
            yield f'event: end\ndata: {{"status": "{status}"}}\n\n'
            return
        if time.monotonic() - quiet_since >= _KEEPALIVE_S:
            yield ": keep-alive\n\n"
            quiet_since = time.monotonic()
        await asyncio.sleep(_FOLLOW_POLL_S)


def _logs_after(db: Database, job_id: int, after: int, selection: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The job's status, then its lines after `after`, in one session."""
    with db.session() as session:
        job = session.get(Job, job_id)
        status = job.status
        data, _ = read_logs(session, job, after=after, **selection)
        return status, data


@router.get("/{job_id}/events", response_model=EventsPublic, responses=ERRORS)
def job_events(job_id: JobId, session: SessionDep, principal: ReaderDep) -> Response:
    """The job's state changes and why; its owner's and admins' only (a 404 to others, as for metrics)."""
    job = job_repository.get_visible_job(session, job_id, principal=principal)
    return json_response(EventsPublic(data=job_repository.job_events(session, job)))


@router.get("/{job_id}/artifacts", response_model=ArtifactsPublic, responses=ERRORS)
def job_artifacts(job_id: JobId, session: SessionDep, principal: ReaderDep, storage: JobStorageDep) -> Response:
    """The files of a succeeded job's final model as the service recorded them when it succeeded (their
    bytes and the sha256 it computed); 409 while it has not succeeded. Its owner's and admins' only (a
    404 to others, as for metrics)."""
    job = job_repository.get_visible_job(session, job_id, principal=principal)
    _, files = job_responses.job_artifacts(session, job, storage=storage)
    data = [ArtifactPublic(name=f.name, bytes=f.bytes, sha256=f.sha256) for f in files]
    return json_response(ArtifactsPublic(data=data, count=len(data)))


@router.get(
    "/{job_id}/artifacts/{name}",
    response_class=StreamingResponse,
    responses={**ERRORS, **downloads.RESPONSES},
)
def job_artifact(
    job_id: JobId,
    name: downloads.FileName,
    session: SessionDep,
    principal: ReaderDep,
    storage: JobStorageDep,
    range_header: downloads.RangeHeader = None,
) -> Response:
    """One recorded artifact's bytes, streamed and hashed as they go: a file changed since it was recorded
    is cut off before its end (409 when its size already differs). `Range: bytes=a-b` answers 206 with
    those bytes (416 past the end). Only a name the listing gives; the job's owner's and admins' only."""
    job = job_repository.get_visible_job(session, job_id, principal=principal)
    job_dir, artifact = job_responses.artifact_file(session, job, name, storage=storage)
    return downloads.download(
        lambda first, last: stream_artifact(job.id, job_dir, artifact, first=first, last=last),
        filename=name,
        size=artifact.bytes,
        range_header=range_header,
    )
