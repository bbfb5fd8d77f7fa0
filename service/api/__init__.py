"""The REST API: one router per resource, mounted under /v1 by service.main, and what the job routes
answer (job_responses: a job as its asker sees it, pages, curves thinned for a chart, artifacts).

Every /v1 route and /metrics is a read that needs a token while auth is on (unless
ZERO1_PUBLIC_READ); the routes that change something ask for a writer too. /healthz stays open.

May import: service.settings, service.errors, service.auth, service.telemetry, service.app_state,
service.schemas, service.store, service.planning, service.intake, service.scheduling, service.experiments,
service.tracking, workers.memory, workers.records.
"""

from fastapi import APIRouter, Depends

from service.api.deps import require_reader
from service.api.routes import checkpoints, cluster, code, health, jobs, plan, prometheus, queue, sweeps, usage

v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_reader)])
v1.include_router(plan.router)
v1.include_router(jobs.router)
v1.include_router(checkpoints.router)
v1.include_router(queue.router)
v1.include_router(cluster.router)
v1.include_router(code.router)
v1.include_router(sweeps.router)
v1.include_router(usage.router)

root = APIRouter()
root.include_router(health.router)
root.include_router(prometheus.router, dependencies=[Depends(require_reader)])
