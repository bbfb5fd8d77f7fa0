"""POST /v1/plan: capacity planning with the ZeRO memory model; POST /v1/plan/recommend: what fits, cheapest first."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import ClusterDep, ReaderDep, RuntimeDep, SessionDep, SettingsDep, TracerDep
from service.bundles import require_bundle
from service.hf import check_model_path
from service.planning import make_plan, model_shape, plan_public
from service.recommendations import cost_model_of, recommend_public
from service.responses import ErrorPublic, PlanPublic, RecommendationsPublic
from service.schemas import PlanRequest, RecommendRequest
from workers.memory import GB

router = APIRouter(tags=["planning"])


@router.post("/plan", response_model=PlanPublic, responses={422: {"model": ErrorPublic}})
def plan(
    request: PlanRequest,
    cluster: ClusterDep,
    settings: SettingsDep,
    tracer: TracerDep,
    session: SessionDep,
    principal: ReaderDep,
    runtime: RuntimeDep,
) -> PlanPublic:
    """Per-GPU bytes of a model on N GPUs at a ZeRO stage, whether it fits, and the smallest N that does."""
    request = check_model_path(request, model_roots=settings.model_roots)
    if request.code is not None:  # a python model's trace runs its bundle's code: the caller's to use
        require_bundle(session, request.code, principal=principal, store=runtime.code)
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    plan = make_plan(request, cluster=cluster, overhead_bytes=overhead_bytes, tracer=tracer)
    return plan_public(plan, shape=model_shape(request, tracer=tracer))


@router.post("/plan/recommend", response_model=RecommendationsPublic, responses={422: {"model": ErrorPublic}})
def recommend(request: RecommendRequest, cluster: ClusterDep, settings: SettingsDep) -> RecommendationsPublic:
    """The ZeRO stage 1 configurations (GPUs, micro-batch, accumulation, checkpointing) of a model and global
    batch that fit, cheapest first by the cost model the response states; 422 does_not_fit when none does."""
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    return recommend_public(request, cluster=cluster, overhead_bytes=overhead_bytes, cost_model=cost_model_of(settings))
