"""POST /v1/plan: capacity planning with the ZeRO memory model."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import ClusterDep, SettingsDep, TracerDep
from service.planning import make_plan, plan_public
from service.responses import ErrorPublic, PlanPublic
from service.schemas import PlanRequest
from workers.memory import GB

router = APIRouter(tags=["planning"])


@router.post("/plan", response_model=PlanPublic, responses={422: {"model": ErrorPublic}})
def plan(request: PlanRequest, cluster: ClusterDep, settings: SettingsDep, tracer: TracerDep) -> PlanPublic:
    """Per-GPU bytes of a model on N GPUs at a ZeRO stage, whether it fits, and the smallest N that does."""
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    return plan_public(make_plan(request, cluster=cluster, overhead_bytes=overhead_bytes, tracer=tracer))
