"""A job's checkpoints, to download: the complete ones its storage holds now (older ones are
pruned as it trains: ZERO1_CHECKPOINT_KEEP_LAST, ZERO1_CHECKPOINT_KEEP_FINISHED), each rank's shard
and the marker, streamed by the service from a directory or an object store. Its owner's and admins'
only, as its artifacts are."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from fastapi.responses import StreamingResponse

from service.api import downloads
from service.api.deps import JobId, JobStorageDep, ReaderDep, SessionDep, errors, json_response
from service.errors import ServiceError
from service.schemas.responses import CheckpointFilePublic, CheckpointPublic, CheckpointsPublic
from service.store import job_repository
from service.store.checkpoint_files import open_checkpoint_file, stored_checkpoints, stream_file

router = APIRouter(prefix="/jobs", tags=["jobs"])

ERRORS = errors(401, 403, 404, 422, 429, 503)
MAX_STEP = 10**9 - 1
"""A step directory's name has 9 digits."""


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic, responses=ERRORS)
def job_checkpoints(job_id: JobId, session: SessionDep, principal: ReaderDep, storage: JobStorageDep) -> Response:
    """The job's complete checkpoints on its storage now, oldest first, each with its files and their
    bytes (a pruned one is gone; a running job's newest may not be complete yet)."""
    job = job_repository.get_visible_job(session, job_id, principal=principal)
    store = storage.job_store(job)
    data = [
        CheckpointPublic(step=step, files=[CheckpointFilePublic(name=name, bytes=size) for name, size in files])
        for step, files in stored_checkpoints(store)
    ]
    return json_response(CheckpointsPublic(data=data, count=len(data)))


@router.get(
    "/{job_id}/checkpoints/{step}/{name}",
    response_class=StreamingResponse,
    responses={**ERRORS, **downloads.RESPONSES},
)
def job_checkpoint_file(
    job_id: JobId,
    step: Annotated[int, Path(ge=0, le=MAX_STEP)],
    name: downloads.FileName,
    session: SessionDep,
    principal: ReaderDep,
    storage: JobStorageDep,
    range_header: downloads.RangeHeader = None,
) -> Response:
    """One file of a complete checkpoint, as the listing names it: a rank's shard or `complete.json`
    (any other name is a 404, a path included). `Range: bytes=a-b` answers 206 with those bytes."""
    job = job_repository.get_visible_job(session, job_id, principal=principal)
    file, size = open_checkpoint_file(storage.job_store(job), job.id, step, name)
    try:
        return downloads.download(
            lambda first, last: stream_file(file, first=first, last=last),
            filename=f"step-{step}-{name}",
            size=size,
            range_header=range_header,
        )
    except ServiceError:  # a 416: the file is not streamed
        file.close()
        raise
