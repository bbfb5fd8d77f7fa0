"""Dependencies injected into routes, and what every route answers with: a JSON Response made in its own
thread, the error responses it documents, a job id in a path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request, Response
from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.app_state import AppState
from service.auth import Authenticator, Principal
from service.planning.capacity import ClusterCapacity
from service.planning.traces import Tracer
from service.schemas.responses import ErrorPublic
from service.settings import Settings
from service.store.job_storage import JobStorage


def get_app_state(request: Request) -> AppState:
    return request.app.state.runtime


AppStateDep = Annotated[AppState, Depends(get_app_state)]


def get_settings(runtime: AppStateDep) -> Settings:
    return runtime.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(runtime: AppStateDep) -> Iterator[Session]:
    """The request's session: its one commit point, before the response is sent."""
    with runtime.db.session() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_cluster(runtime: AppStateDep) -> ClusterCapacity:
    """The GPUs plans and admission are checked against."""
    return runtime.cluster.capacity()


ClusterDep = Annotated[ClusterCapacity, Depends(get_cluster)]


def get_tracer(runtime: AppStateDep) -> Tracer:
    """Where traced plans are made (a Ray task) and remembered."""
    return runtime.tracer


TracerDep = Annotated[Tracer, Depends(get_tracer)]


def get_storage(runtime: AppStateDep) -> JobStorage:
    """Where each job's files live: its checkpoints, its final model, the dataset token cache."""
    return runtime.storage


JobStorageDep = Annotated[JobStorage, Depends(get_storage)]


def get_authenticator(request: Request) -> Authenticator:
    return request.app.state.authenticator


AuthenticatorDep = Annotated[Authenticator, Depends(get_authenticator)]


def require_reader(request: Request, authenticator: AuthenticatorDep) -> Principal:
    """Reads need a token unless auth is off or ZERO1_PUBLIC_READ is set (a 401 otherwise)."""
    return authenticator.reader(request)


def require_writer(request: Request, authenticator: AuthenticatorDep) -> Principal:
    """Submitting and cancelling need a token while auth is on (a 401), and the CSRF header by cookie (a 403)."""
    return authenticator.writer(request)


ReaderDep = Annotated[Principal, Depends(require_reader)]
"""Who reads: it decides which jobs' details (spec, metrics, events) the reader sees (jobs.can_see)."""
PrincipalDep = Annotated[Principal, Depends(require_writer)]


def errors(*statuses: int) -> dict[int, dict]:
    """The error responses a route documents, each the one error body."""
    return {status: {"model": ErrorPublic} for status in statuses}


MAX_ID = 2**63 - 1
"""Ids are 64-bit in the database: a larger one is a 422 here, not a 500 from its driver."""
JobId = Annotated[int, Path(ge=1, le=MAX_ID)]


def json_response(body: BaseModel, *, status_code: int = 200) -> Response:
    """The body as JSON, made in the endpoint's own worker thread.

    A returned model is validated again by FastAPI in a second trip to the threadpool, and the
    request's session commits (freeing SQLite's write lock and its pooled connection) only after
    that trip. Under load every worker thread can be waiting on that lock or the pool, and the
    trip never comes: a deadlock that 30 s timeouts end in 500s (tests/test_load.py). A Response
    is sent as it is, and the session's commit needs no worker of the shared pool.
    """
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json")
