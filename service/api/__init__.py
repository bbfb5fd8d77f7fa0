"""The REST API: one router per resource, mounted under /v1 by service.main."""

from fastapi import APIRouter

from service.api.routes import cluster, health, jobs, plan, prometheus

v1 = APIRouter(prefix="/v1")
v1.include_router(plan.router)
v1.include_router(jobs.router)
v1.include_router(cluster.router)

root = APIRouter()
root.include_router(health.router)
root.include_router(prometheus.router)
