"""GET /metrics: the Prometheus exposition of the app's Telemetry (service/telemetry.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.telemetry import Telemetry

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=PlainTextResponse)
def prometheus(request: Request) -> Response:
    """Jobs by status, GPUs, training speed, request latency and the scheduler's work, as Prometheus text."""
    telemetry: Telemetry = request.app.state.telemetry
    # a def, run in the threadpool: rendering reads the database. A Response, not a str: FastAPI
    # would validate a str in a second trip to that pool, which can deadlock under load (service.api.deps.json_response)
    return Response(telemetry.render(), media_type=CONTENT_TYPE_LATEST)
