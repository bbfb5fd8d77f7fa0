"""The dashboard: live pages of the cluster, its jobs and the planner, served by the app itself; jobs side by
side and the sweeps (experiments.py); the GPU usage by owner and priority class (usage.py).

May import: service.settings, service.errors, service.auth, service.lockout, service.api,
service.schemas, service.store, service.planning, service.scheduling, service.experiments,
service.tracking, workers.memory.
"""

from fastapi import APIRouter

from service.dashboard import experiments, routes, usage

STATIC_DIR = routes.STATIC_DIR
router = APIRouter(include_in_schema=False)
router.include_router(routes.router)
router.include_router(experiments.router)
router.include_router(usage.router)

__all__ = ["STATIC_DIR", "router"]
