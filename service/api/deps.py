"""Dependencies injected into routes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from service.auth import Authenticator, Principal
from service.planning.cluster import ClusterCapacity
from service.planning.traces import Tracer
from service.runtime import Runtime
from service.settings import Settings


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_settings(runtime: RuntimeDep) -> Settings:
    return runtime.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    """The request's session: its one commit point, before the response is sent."""
    with runtime.db.session() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_cluster(runtime: RuntimeDep) -> ClusterCapacity:
    """The GPUs plans and admission are checked against."""
    return runtime.cluster.capacity()


ClusterDep = Annotated[ClusterCapacity, Depends(get_cluster)]


def get_tracer(runtime: RuntimeDep) -> Tracer:
    """Where traced plans are made (a Ray task) and remembered."""
    return runtime.tracer


TracerDep = Annotated[Tracer, Depends(get_tracer)]


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
