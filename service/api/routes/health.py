"""GET /healthz: liveness, and whether the scheduler is still ticking."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter, Response

from service.api.deps import AppStateDep
from service.schemas.responses import HealthPublic

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthPublic, responses={503: {"model": HealthPublic}})
def healthz(runtime: AppStateDep) -> Response:
    """200 while the scheduler completes ticks; 503 "degraded" when it has not for ZERO1_SCHEDULER_STALE_S
    (a database it cannot reach, a tick stuck): the API answers, but no job moves."""
    age_s = runtime.scheduler.tick_age_s()
    stale = age_s is not None and age_s > runtime.settings.scheduler_stale_s
    body = HealthPublic(status="degraded" if stale else "ok", version=version("zero1"), scheduler_tick_age_s=age_s)
    return Response(body.model_dump_json(), status_code=503 if stale else 200, media_type="application/json")
