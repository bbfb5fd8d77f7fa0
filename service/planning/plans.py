"""Capacity planning: a PlanRequest against the cluster, through the memory model.

The planning functions are synchronous and quick; a model planned by its trace is traced first,
awaited by the route (`trace_first`), and the functions are handed the trace it made.
"""

from __future__ import annotations

from dataclasses import asdict

from service.errors import ServiceError
from service.planning.capacity import ClusterCapacity
from service.planning.traces import KnownTrace, Tracer, TraceRequest, Traces
from service.schemas.model_specs import PythonModelSpec, TracedModelSpec
from service.schemas.plan_requests import PlanRequest
from service.schemas.responses import PlanPublic
from workers.memory import fit
from workers.memory import model as memory
from workers.memory.model import GB


def workload_for(request: PlanRequest, *, overhead_bytes: int, tracer: Traces | None = None) -> memory.Workload:
    """The memory model's view of a request: the formula, a model's closed forms, or its traced step."""
    if request.model is None:
        return memory.Workload.from_num_params(
            request.num_params,
            precision=request.precision,
            optimizer=request.optimizer,
            bucket_cap_mb=request.bucket_cap_mb,
        )
    if request.method == "traced":
        assert tracer is not None, "a traced plan needs a Tracer"
        return _traced_workload(request, overhead_bytes=overhead_bytes, tracer=tracer)
    return memory.Workload.from_model(
        request.model.to_spec(),
        precision=request.precision,
        optimizer=request.optimizer,
        micro_batch_size=request.micro_batch_size or 1,
        seq_len=request.seq_len,
        activation_checkpointing=bool(request.activation_checkpointing),
        overhead_bytes=overhead_bytes,
        bucket_cap_mb=request.bucket_cap_mb,
    )


def trace_request(request: PlanRequest) -> TraceRequest:
    """What the trace of a model plan depends on: a python model's code bundle with its spec."""
    model = request.model.model_dump()
    if isinstance(request.model, PythonModelSpec):
        model["code"] = request.code
    return TraceRequest(
        model=model,
        precision=request.precision,
        micro_batch_size=request.micro_batch_size or 1,
        seq_len=request.seq_len,
        activation_checkpointing=bool(request.activation_checkpointing),
        bucket_cap_mb=request.bucket_cap_mb,
    )


async def trace_first(request: PlanRequest, *, tracer: Tracer, user: str | None) -> Traces:
    """What the planning functions trace `request` with: the trace awaited now (in one of `user`'s
    slots, without a thread) when the request is planned by its trace, else `tracer` (never asked)."""
    if request.model is None or request.method != "traced":
        return tracer
    step = await tracer.trace_async(trace_request(request), user=user)
    return KnownTrace(trace_request(request), step)


def model_shape(request: PlanRequest, *, tracer: Traces | None) -> tuple[int, int] | None:
    """(vocab_size, block_size) of an hf or python model as its trace resolved them (from the trace cache);
    None otherwise."""
    if not isinstance(request.model, TracedModelSpec):
        return None
    assert tracer is not None, "a traced model's plan needs a Tracer"
    traced = tracer.trace(trace_request(request))
    return traced.vocab_size, traced.max_position_embeddings


def _traced_workload(request: PlanRequest, *, overhead_bytes: int, tracer: Traces) -> memory.Workload:
    traced = tracer.trace(trace_request(request))
    num_params = sum(traced.group_numels) + traced.frozen_numel
    if num_params > memory.MAX_NUM_PARAMS:
        raise ServiceError(
            f"model has {num_params:,} parameters, above the limit of {memory.MAX_NUM_PARAMS:,}",
            status_code=422,
            error="invalid_model",
        )
    return traced.workload(precision=request.precision, optimizer=request.optimizer, overhead_bytes=overhead_bytes)


def make_plan(
    request: PlanRequest, *, cluster: ClusterCapacity, overhead_bytes: int, tracer: Traces | None = None
) -> fit.Plan:
    """Plan `request`, filling num_gpus and gpu_memory_gb from the cluster when absent."""
    gpu_memory_bytes = (
        cluster.gpu_memory_bytes
        if request.gpu_memory_gb is None
        else memory.gpu_memory_bytes_from_gb(request.gpu_memory_gb)
    )
    return fit.plan(
        workload_for(request, overhead_bytes=overhead_bytes, tracer=tracer),
        num_gpus=request.num_gpus or cluster.num_gpus,
        stage=request.stage,
        gpu_memory_bytes=gpu_memory_bytes,
    )


def plan_public(plan: fit.Plan, *, shape: tuple[int, int] | None = None) -> PlanPublic:
    """The API's JSON shape of a plan (stage keys are strings, as JSON needs), with an hf model's
    (vocab_size, block_size) when given."""
    vocab_size, block_size = shape or (None, None)
    return PlanPublic(
        num_params=plan.num_params,
        method=plan.method,
        num_gpus=plan.num_gpus,
        stage=plan.stage,
        precision=plan.precision,
        optimizer=plan.optimizer,
        per_gpu={**asdict(plan.per_gpu), "total_bytes": plan.per_gpu.total_bytes},
        gpu_memory_bytes=plan.gpu_memory_bytes,
        fits=plan.fits,
        headroom_bytes=plan.headroom_bytes,
        min_gpus=plan.min_gpus,
        stages={str(stage): total for stage, total in plan.stages.items()},
        sweep=[asdict(point) for point in plan.sweep],
        vocab_size=vocab_size,
        block_size=block_size,
    )


def fits_no_number(plan: fit.Plan, workload: memory.Workload) -> str:
    """The clause of a 422 for a stage at which no number of GPUs fits, with the bytes no N shards away."""
    if plan.stage >= 3:
        floor = memory.floor_bytes(workload, stage=plan.stage)
        return (
            f"; ZeRO stage {plan.stage} fits on no number of GPUs: the units it gathers, its step and the "
            f"overhead alone are {floor / GB:.2f} GB"
        )
    p, g = memory.bytes_per_param(plan.precision)
    replicated, what = (p + g, "weights and gradients") if plan.stage < 2 else (p, "weights")
    return (
        f"; ZeRO stage {plan.stage} fits on no number of GPUs: the replicated {plan.precision} {what} "
        f"alone are {replicated * plan.num_params / GB:.2f} GB"
    )
