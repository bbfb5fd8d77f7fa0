"""The dashboard: live pages of the cluster, its jobs and the planner, served by the app itself."""

from service.dashboard.routes import STATIC_DIR, router

__all__ = ["STATIC_DIR", "router"]
