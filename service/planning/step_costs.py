"""The step cost model: what one optimizer step of a ZeRO configuration costs, for the recommendations
(service/planning/configurations.py) to rank the configurations that fit.

Cost, in GPU-seconds per optimizer step (what a step costs on a bill), from Ψ parameters, the
step's tokens, a stated per-GPU throughput and a stated per-GPU bandwidth:

    cost      = N · (compute_s + comm_s)
    compute_s = 6·Ψ·tokens / N / flops_per_gpu          x 4/3 with activation checkpointing
    comm_s    = passes·(N−1)/N · Ψ · p / bytes_per_s_per_gpu
    passes    = 2 at stage 1; accumulation_steps + 1 at stage 2; 3·accumulation_steps at stage 3

6·Ψ FLOPs per token are the forward (2Ψ) and the backward (4Ψ); checkpointing runs each block's
forward again in the backward (+2Ψ, a third more). A pass is one ring collective over the Ψ·p-byte
model, which sends (N−1)/N of it from every GPU. Stage 1 reduces the gradients once per step
(they accumulate locally between micro-batches) and gathers the updated parameters once: 2 passes,
the ZeRO paper's 2Ψ. Stage 2 keeps no full gradient to accumulate into, so every micro-batch's
backward reduces its gradients: accumulation_steps reduces and one gather. Stage 3 gathers the
parameters for each micro-batch's forward and again for its backward, and reduce-scatters its
gradients: 3 passes a micro-batch, the paper's 3Ψ. At stage 1 the micro-batch does not enter the cost
(it changes neither the FLOPs nor the bytes per step, only memory); at stages 2 and 3 a smaller one
means more passes.

Standard library only, like the memory model: the API, the CLI and tests load it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.memory.model import GB

COST_UNIT = "GPU-seconds per optimizer step"
COST_FORMULA = (
    "cost = N * (compute_s + comm_s); compute_s = 6 * num_params * tokens_per_step / N / (gpu_tflops * 1e12), "
    "x 4/3 with activation checkpointing; comm_s = passes * (N - 1) / N * num_params * bytes_per_param "
    "/ (network_gb_per_s * 1e9), passes = 2 at zero_stage 1, accumulation_steps + 1 at zero_stage 2, "
    "3 * accumulation_steps at zero_stage 3"
)
CHECKPOINTING_COMPUTE_FACTOR = 4 / 3
"""Forward 2Ψ + backward 4Ψ FLOPs per token; checkpointing recomputes the forward: 8Ψ / 6Ψ."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """The stated hardware the cost is computed for (ZERO1_PLAN_GPU_TFLOPS, ZERO1_PLAN_NETWORK_GB_PER_S)."""

    gpu_tflops: float
    """Training throughput each GPU sustains, in TFLOP/s (dense, at the model's precision)."""
    network_gb_per_s: float
    """Bandwidth each GPU's reduce-scatter and all-gather achieve, in GB/s (1e9 bytes)."""

    def __post_init__(self) -> None:
        if not (self.gpu_tflops > 0 and self.network_gb_per_s > 0):
            raise ValueError(
                f"gpu_tflops ({self.gpu_tflops}) and network_gb_per_s ({self.network_gb_per_s}) must be > 0"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCost:
    """One configuration's cost: seconds each GPU computes and communicates, and their GPU-seconds."""

    compute_s: float
    comm_s: float
    cost_gpu_s: float


def compute_s(
    *, num_params: int, num_tokens: int, num_gpus: int, activation_checkpointing: bool, gpu_tflops: float
) -> float:
    """Seconds each GPU spends on its share of the step's 6·Ψ·tokens FLOPs (x 4/3 with checkpointing)."""
    flops = 6 * num_params * num_tokens / num_gpus
    if activation_checkpointing:
        flops *= CHECKPOINTING_COMPUTE_FACTOR
    return flops / (gpu_tflops * 1e12)


def comm_passes(*, stage: int, accumulation_steps: int) -> int:
    """Ring collectives over the whole model per step: the gradients' reduces and the parameters' gather."""
    if stage == 1:
        return 2
    if stage == 2:
        return accumulation_steps + 1
    if stage == 3:
        return 3 * accumulation_steps
    raise ValueError(f"the cost is modelled at the stages zero1 trains at (1, 2, 3), got {stage}")


def comm_bytes_per_gpu(
    *, num_params: int, num_gpus: int, bytes_per_param: int, stage: int = 1, accumulation_steps: int = 1
) -> float:
    """Bytes each GPU sends per step: the reduces of the gradients + the all-gather of the parameters."""
    # each ring collective sends (N-1)/N of the Ψ·p-byte flat buffer from every rank; N = 1 sends nothing
    passes = comm_passes(stage=stage, accumulation_steps=accumulation_steps)
    return passes * (num_gpus - 1) * num_params * bytes_per_param / num_gpus


def step_cost(
    *,
    num_params: int,
    num_tokens: int,
    num_gpus: int,
    activation_checkpointing: bool,
    bytes_per_param: int,
    cost_model: CostModel,
    stage: int = 1,
    accumulation_steps: int = 1,
) -> StepCost:
    """GPU-seconds per optimizer step: N x (compute_s + comm_s)."""
    compute = compute_s(
        num_params=num_params,
        num_tokens=num_tokens,
        num_gpus=num_gpus,
        activation_checkpointing=activation_checkpointing,
        gpu_tflops=cost_model.gpu_tflops,
    )
    comm_bytes = comm_bytes_per_gpu(
        num_params=num_params,
        num_gpus=num_gpus,
        bytes_per_param=bytes_per_param,
        stage=stage,
        accumulation_steps=accumulation_steps,
    )
    comm = comm_bytes / (cost_model.network_gb_per_s * GB)
    return StepCost(compute_s=compute, comm_s=comm, cost_gpu_s=num_gpus * (compute + comm))
