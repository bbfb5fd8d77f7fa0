"""POST /v1/plan: capacity planning with the ZeRO memory model; POST /v1/plan/recommend: what fits, cheapest first."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import AppStateDep, ClusterDep, ReaderDep, SettingsDep, TracerDep
from service.api.offload import in_file_thread, require_code
from service.planning.hf_paths import check_model_path
from service.planning.plans import make_plan, model_shape, plan_public, trace_first
from service.planning.recommendations import cost_model_of, recommend_public
from service.schemas.plan_requests import PlanRequest, RecommendRequest
from service.schemas.responses import ErrorPublic, PlanPublic, RecommendationsPublic
from workers.memory.model import GB

router = APIRouter(tags=["planning"])


@router.post(
    "/plan",
    response_model=PlanPublic,
    responses={status: {"model": ErrorPublic} for status in (403, 422, 429, 503)},
)
async def plan(
    request: PlanRequest,
    cluster: ClusterDep,
    settings: SettingsDep,
    tracer: TracerDep,
    principal: ReaderDep,
    runtime: AppStateDep,
) -> PlanPublic:
    """Per-GPU bytes of a model on N GPUs at a ZeRO stage, whether it fits, and the smallest N that does.
    A model planned by its trace waits for it holding no request thread and no database connection; a
    trace takes one of ZERO1_MAX_TASKS (ZERO1_MAX_TASKS_PER_USER per user) slots, a 429 when none is free."""
    request = await in_file_thread(check_model_path, request, model_roots=settings.model_roots)
    if request.code is not None:  # a python model's trace runs its bundle's code: the caller's to use
        await require_code(runtime, request.code, principal=principal)
    known = await trace_first(request, tracer=tracer, user=principal.user)
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    plan = make_plan(request, cluster=cluster, overhead_bytes=overhead_bytes, tracer=known)
    return plan_public(plan, shape=model_shape(request, tracer=known))


@router.post("/plan/recommend", response_model=RecommendationsPublic, responses={422: {"model": ErrorPublic}})
def recommend(request: RecommendRequest, cluster: ClusterDep, settings: SettingsDep) -> RecommendationsPublic:
    """The ZeRO stage 1 configurations (GPUs, micro-batch, accumulation, checkpointing) of a model and global
    batch that fit, cheapest first by the cost model the response states; 422 does_not_fit when none does."""
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    return recommend_public(request, cluster=cluster, overhead_bytes=overhead_bytes, cost_model=cost_model_of(settings))
