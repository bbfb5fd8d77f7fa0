"""The REST API: one router per resource, mounted under /v1 by service.main."""

from fastapi import APIRouter

from service.api.routes import health, plan

v1 = APIRouter(prefix="/v1")
v1.include_router(plan.router)

root = APIRouter()
root.include_router(health.router)
