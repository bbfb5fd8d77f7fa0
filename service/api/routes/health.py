"""GET /healthz: liveness."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter

from service.schemas import HealthPublic

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthPublic)
def healthz() -> HealthPublic:
    return HealthPublic(status="ok", version=version("zero1"))
