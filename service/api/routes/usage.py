"""GET /v1/usage: GPU-seconds held and spent training by owner and priority class over a period, and each
owner's GPUs and usage against their quota. The definitions are service/scheduling/usage.py's."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from service.api.deps import ReaderDep, SessionDep, SettingsDep, errors, json_response
from service.scheduling import usage
from service.schemas.usage import IsoTime, UsagePublic
from service.store.tables import utcnow

router = APIRouter(tags=["usage"])
_ERRORS = errors(401, 422)


@router.get("/usage", response_model=UsagePublic, responses=_ERRORS)
def get_usage(
    session: SessionDep,
    settings: SettingsDep,
    principal: ReaderDep,
    since: Annotated[
        IsoTime | None, Query(description="ISO 8601; without a zone, UTC. Default: the start of this month.")
    ] = None,
    until: Annotated[IsoTime | None, Query(description="ISO 8601; without a zone, UTC. Default: now.")] = None,
) -> Response:
    """Your usage over [since, until) (an admin's: everyone's) by owner and priority class: GPU-seconds held
    and spent training, and each owner's GPUs now and usage against their quota. 422 naming the parameter
    for a time that is not one, or an until not after since."""
    now = utcnow()
    start, end = usage.period(since, until, now=now)
    return json_response(usage.report(session, principal=principal, settings=settings, since=start, until=end, now=now))
