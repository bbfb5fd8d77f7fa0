"""The dashboard: live pages of the cluster, its jobs and the planner, served by the app itself.

May import: service.settings, service.errors, service.auth, service.lockout, service.api,
service.schemas, service.store, service.planning, service.scheduling, service.tracking,
workers.memory.
"""

from service.dashboard.routes import STATIC_DIR, router

__all__ = ["STATIC_DIR", "router"]
