"""A job's checkpoints, to download: the complete ones its storage holds now (older ones are
pruned as it trains: ZERO1_CHECKPOINT_KEEP_LAST, ZERO1_CHECKPOINT_KEEP_FINISHED), each rank's shard
and the marker, streamed by the service from a directory or an object store. Its owner's and admins'
only, as its artifacts are."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Response
from fastapi.responses import StreamingResponse

from service.api.deps import JobId, ReaderDep, RuntimeDep, SessionDep, errors, json_response
from service.api.downloads import attachment, byte_range
from service.errors import ServiceError
from service.scheduling import jobs
from service.schemas.responses import CheckpointFilePublic, CheckpointPublic, CheckpointsPublic
from service.store.checkpoint_files import open_checkpoint_file, stored_checkpoints, stream_file

router = APIRouter(prefix="/jobs", tags=["jobs"])

ERRORS = errors(401, 403, 404, 422, 429, 503)
MAX_STEP = 10**9 - 1
"""A step directory's name has 9 digits."""


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic, responses=ERRORS)
def job_checkpoints(job_id: JobId, session: SessionDep, principal: ReaderDep, runtime: RuntimeDep) -> Response:
    """The job's complete checkpoints on its storage now, oldest first, each with its files and their
    bytes (a pruned one is gone; a running job's newest may not be complete yet)."""
    job = jobs.get_visible_job(session, job_id, principal=principal)
    store = runtime.launcher.job_store(job)
    data = [
        CheckpointPublic(step=step, files=[CheckpointFilePublic(name=name, bytes=size) for name, size in files])
        for step, files in stored_checkpoints(store)
    ]
    return json_response(CheckpointsPublic(data=data, count=len(data)))


@router.get(
    "/{job_id}/checkpoints/{step}/{name}",
    response_class=StreamingResponse,
    responses={
        **ERRORS,
        200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes"},
        206: {"description": "The bytes a Range header asked for"},
        416: {"description": "A Range that starts past the end"},
    },
)
def job_checkpoint_file(
    job_id: JobId,
    step: Annotated[int, Path(ge=0, le=MAX_STEP)],
    name: Annotated[str, Path(min_length=1, max_length=255)],
    session: SessionDep,
    principal: ReaderDep,
    runtime: RuntimeDep,
    range_header: Annotated[str | None, Header(alias="range", max_length=200)] = None,
) -> Response:
    """One file of a complete checkpoint, as the listing names it: a rank's shard or `complete.json`
    (any other name is a 404, a path included). `Range: bytes=a-b` answers 206 with those bytes."""
    job = jobs.get_visible_job(session, job_id, principal=principal)
    file, size = open_checkpoint_file(runtime.launcher.job_store(job), job.id, step, name)
    try:
        span = byte_range(range_header, size=size)
    except ServiceError:  # 416
        file.close()
        raise
    first, last = span or (0, size - 1)
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Length": str(max(last + 1 - first, 0)),
        "Content-Disposition": attachment(f"step-{step}-{name}"),
    }
    if span is not None:
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"
    return StreamingResponse(
        stream_file(file, first=first, last=last),
        status_code=206 if span is not None else 200,
        media_type="application/octet-stream",
        headers=headers,
    )
