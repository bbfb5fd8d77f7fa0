"""GET /metrics: Prometheus text exposition of jobs, GPUs and training speed."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from sqlalchemy import func, select

from service.api.deps import ClusterDep, SessionDep
from service.jobs import gpus_in_use
from service.models import Job
from service.schemas import JobStatus

router = APIRouter(tags=["health"])
_STATUSES = JobStatus.__args__


@router.get("/metrics", response_class=PlainTextResponse)
def prometheus(session: SessionDep, cluster: ClusterDep) -> PlainTextResponse:
    counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
    running = session.scalars(select(Job.latest).where(Job.status == "running")).all()
    steps_per_s = sum(1 / row["step_time_s"] for row in running if row and row.get("step_time_s"))
    lines = ["# HELP zero1_jobs Jobs by status.", "# TYPE zero1_jobs gauge"]
    lines += [f'zero1_jobs{{status="{status}"}} {counts.get(status, 0)}' for status in _STATUSES]
    lines += [
        "# HELP zero1_gpus_in_use GPUs held by starting, running and restarting jobs.",
        "# TYPE zero1_gpus_in_use gauge",
        f"zero1_gpus_in_use {gpus_in_use(session)}",
        "# HELP zero1_gpus_total GPUs in the cluster.",
        "# TYPE zero1_gpus_total gauge",
        f"zero1_gpus_total {cluster.num_gpus}",
        "# HELP zero1_steps_per_second Training steps per second, summed over running jobs.",
        "# TYPE zero1_steps_per_second gauge",
        f"zero1_steps_per_second {steps_per_s:.6g}",
    ]
    # a Response, not a str: FastAPI would validate a str in a second trip to the threadpool
    # before the session closes, which can deadlock under load (see routes.jobs._json)
    return PlainTextResponse("\n".join(lines) + "\n")
