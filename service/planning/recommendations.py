"""POST /v1/plan/recommend's request against the cluster: service/planning/configurations.py's search over the
workloads POST /v1/plan builds, or a 422 does_not_fit (the shape admission uses) when none fits."""

from __future__ import annotations

from service.errors import ServiceError
from service.planning import configurations, step_costs
from service.planning.capacity import ClusterCapacity
from service.planning.plans import fits_no_number, make_plan, plan_public, workload_for
from service.schemas.model_specs import GPTModelSpec
from service.schemas.plan_requests import MAX_MICRO_BATCH_SIZE, PlanRequest, RecommendRequest
from service.schemas.requests import RUNNABLE_STAGES
from service.schemas.responses import CostModelPublic, RecommendationPublic, RecommendationsPublic
from service.settings import Settings
from workers.memory import fit
from workers.memory import model as memory
from workers.memory.model import GB


def cost_model_of(settings: Settings) -> step_costs.CostModel:
    """The stated hardware of ZERO1_PLAN_GPU_TFLOPS and ZERO1_PLAN_NETWORK_GB_PER_S."""
    return step_costs.CostModel(gpu_tflops=settings.plan_gpu_tflops, network_gb_per_s=settings.plan_network_gb_per_s)


def plan_request(
    request: RecommendRequest,
    *,
    num_gpus: int | None,
    micro_batch_size: int,
    activation_checkpointing: bool,
    stage: int = 1,
) -> PlanRequest:
    """The POST /v1/plan body of one configuration (checkpointing only for a model that has it)."""
    return PlanRequest(
        model=request.model,
        num_gpus=num_gpus,
        gpu_memory_gb=request.gpu_memory_gb,
        precision=request.precision,
        optimizer=request.optimizer,
        stage=stage,
        micro_batch_size=micro_batch_size,
        seq_len=request.seq_len,
        activation_checkpointing=activation_checkpointing if _has_checkpointing(request) else None,
    )


def search_of(request: RecommendRequest, *, cluster: ClusterCapacity) -> configurations.Search:
    """The fixed part: tokens per step, and max_gpus and gpu_memory_gb from the cluster when absent."""
    model = request.model
    seq_len = (request.seq_len or model.block_size) if isinstance(model, GPTModelSpec) else 1
    gpu_memory_bytes = (
        cluster.gpu_memory_bytes
        if request.gpu_memory_gb is None
        else memory.gpu_memory_bytes_from_gb(request.gpu_memory_gb)
    )
    return configurations.Search(
        global_batch_size=request.global_batch_size,
        num_tokens=request.global_batch_size * seq_len,
        max_gpus=request.max_gpus or cluster.num_gpus,
        gpu_memory_bytes=gpu_memory_bytes,
        checkpointing_applies=_has_checkpointing(request),
        max_micro_batch_size=MAX_MICRO_BATCH_SIZE,
        stages=RUNNABLE_STAGES,
    )


def recommend_public(
    request: RecommendRequest, *, cluster: ClusterCapacity, overhead_bytes: int, cost_model: step_costs.CostModel
) -> RecommendationsPublic:
    """The configurations that fit, cheapest first; a 422 does_not_fit when none does within max_gpus."""
    search = search_of(request, cluster=cluster)

    def workload_of(micro_batch_size: int, activation_checkpointing: bool) -> memory.Workload:
        # /v1/plan's own path: whatever workload_for counts (activations, overhead, ...), this counts too
        body = plan_request(
            request, num_gpus=None, micro_batch_size=micro_batch_size, activation_checkpointing=activation_checkpointing
        )
        return workload_for(body, overhead_bytes=overhead_bytes)

    result = configurations.recommend(workload_of, search=search, cost_model=cost_model)
    if not result.items:
        raise _does_not_fit(request, result, search=search, cluster=cluster, overhead_bytes=overhead_bytes)
    workload = workload_of(1, False)
    return RecommendationsPublic(
        recommendations=[_item_public(item) for item in result.items],
        count=len(result.items),
        global_batch_size=search.global_batch_size,
        max_gpus=search.max_gpus,
        gpu_memory_bytes=search.gpu_memory_bytes,
        cost_model=CostModelPublic(
            formula=step_costs.COST_FORMULA,
            unit=step_costs.COST_UNIT,
            gpu_tflops=cost_model.gpu_tflops,
            network_gb_per_s=cost_model.network_gb_per_s,
            num_params=workload.num_params,
            tokens_per_step=search.num_tokens,
            bytes_per_param=memory.bytes_per_param(workload.precision)[0],
        ),
    )


def _item_public(item: configurations.Recommendation) -> RecommendationPublic:
    return RecommendationPublic(
        num_gpus=item.num_gpus,
        micro_batch_size=item.micro_batch_size,
        accumulation_steps=item.accumulation_steps,
        activation_checkpointing=item.activation_checkpointing,
        zero_stage=item.stage,
        total_bytes=item.total_bytes,
        headroom_bytes=item.headroom_bytes,
        cost=item.cost_gpu_s,
        compute_s=item.compute_s,
        comm_s=item.comm_s,
        why=item.why,
    )


def _has_checkpointing(request: RecommendRequest) -> bool:
    return isinstance(request.model, GPTModelSpec)


def _does_not_fit(
    request: RecommendRequest,
    result: configurations.Recommendations,
    *,
    search: configurations.Search,
    cluster: ClusterCapacity,
    overhead_bytes: int,
) -> ServiceError:
    """What admission answers for a job that does not fit, with the plan of the least per-GPU bytes found."""
    body = plan_request(
        request,
        num_gpus=result.least_bytes_num_gpus,
        micro_batch_size=1,
        activation_checkpointing=True,
        stage=search.stages[-1],
    )
    plan = make_plan(body, cluster=cluster, overhead_bytes=overhead_bytes)
    workload = workload_for(body, overhead_bytes=overhead_bytes)
    setting = "micro-batch 1, with activation checkpointing" if search.checkpointing_applies else "micro-batch 1"
    setting += f", ZeRO stage {search.stages[-1]}"
    message = (
        f"nothing fits within max_gpus = {search.max_gpus}: the least per-GPU plan found is "
        f"{result.least_bytes / GB:.2f} GB (N = {result.least_bytes_num_gpus}, {setting}), above the "
        f"{search.gpu_memory_bytes / GB:.2f} GB of each GPU" + _what_would(plan, workload, search=search)
    )
    return ServiceError(message, status_code=422, error="does_not_fit", plan=plan_public(plan).model_dump(mode="json"))


def _what_would(plan: fit.Plan, workload: memory.Workload, *, search: configurations.Search) -> str:
    if plan.min_gpus is None:
        return fits_no_number(plan, workload)
    divides = f"N must also divide global_batch_size ({search.global_batch_size})"
    if plan.min_gpus > search.max_gpus:
        return f"; N >= {plan.min_gpus} would fit ({divides})"
    return f"; N >= {plan.min_gpus} would fit, but {divides} and none up to max_gpus does"
