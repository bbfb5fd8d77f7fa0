"""Fitting a workload to GPUs: the full capacity plan of a workload at N (its breakdown, whether it fits,
the headroom, every stage's total), the fewest GPUs it fits on (min_gpus) and the sweep over N.

The per-GPU bytes are the memory model's (workers/memory/model.py); this module asks it at each N.
Standard library only, like it: the planner, the API and the CLI load it without torch or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.memory.model import (
    STAGES,
    Breakdown,
    Workload,
    breakdown,
    bytes_per_param,
    check_stage,
    floor_bytes,
    optimizer_bytes_per_param,
    total_bytes,
)

SWEEP_NUM_GPUS = tuple(2**i for i in range(11))  # 1, 2, 4, ... 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepPoint:
    num_gpus: int
    total_bytes: int
    fits: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    num_params: int
    method: str
    """How the workload was counted: "formula", "model" or "traced" (Workload.method)."""
    num_gpus: int
    stage: int
    precision: str
    optimizer: str
    per_gpu: Breakdown
    gpu_memory_bytes: int
    fits: bool
    headroom_bytes: int
    min_gpus: int | None
    """Smallest N that fits at this stage; None when none does."""
    stages: dict[int, int]
    """Total per-GPU bytes of each stage at this N."""
    sweep: tuple[SweepPoint, ...]


def min_gpus(workload: Workload, *, stage: int, gpu_memory_bytes: int) -> int | None:
    """Smallest N whose per-GPU plan fits in `gpu_memory_bytes`, or None.

    Without padding the total is fixed + B·⌈Ψ/N⌉ (B: bytes per element of the
    sharded terms), which fits iff ⌈Ψ/N⌉ <= m = ⌊(memory - fixed)/B⌋, i.e. iff
    N >= ⌈Ψ/m⌉. Padding only adds bytes, so no smaller N fits a padded layout
    either; from there the first N that fits is found by walking up.
    """
    check_stage(stage)
    if stage == 0:
        fits = total_bytes(workload, num_gpus=1, stage=0) <= gpu_memory_bytes
        return 1 if fits else None
    p, g = bytes_per_param(workload.precision)
    k = optimizer_bytes_per_param(workload.precision, workload.optimizer)
    sharded = k + (g if stage >= 2 else 0) + (p if stage >= 3 else 0)
    # frozen weights are replicated below stage 3; sharded at stage 3 they only add, so the
    # bound below stays a lower bound and the walk finds the first N that fits
    fixed = floor_bytes(workload, stage=stage)
    if sharded == 0:  # fp32 plain SGD at stage 1: no state to shard, N does not matter
        if fixed > gpu_memory_bytes:
            return None
        lower = 1
    else:
        max_shard = (gpu_memory_bytes - fixed) // sharded
        if max_shard < 1:
            return None
        lower = -(-workload.num_trainable // max_shard)
    if workload.alignment_numel is None:
        return lower
    # Padding grows with N (at most N·alignment elements per buffer), so a
    # padded layout that misses at `lower` may still fit a little further up.
    for num_gpus in range(lower, lower + _MAX_PADDING_WALK):
        if total_bytes(workload, num_gpus=num_gpus, stage=stage) <= gpu_memory_bytes:
            return num_gpus
    return None


_MAX_PADDING_WALK = 1024


def plan(workload: Workload, *, num_gpus: int, stage: int = 1, gpu_memory_bytes: int) -> Plan:
    """The full capacity plan: breakdown, fit, min_gpus, stages at N, sweep over N."""
    if gpu_memory_bytes < 0:
        raise ValueError(f"gpu_memory_bytes must be >= 0, got {gpu_memory_bytes}")
    per_gpu = breakdown(workload, num_gpus=num_gpus, stage=stage)
    total = per_gpu.total_bytes
    return Plan(
        num_params=workload.num_params,
        method=workload.method,
        num_gpus=num_gpus,
        stage=stage,
        precision=workload.precision,
        optimizer=workload.optimizer,
        per_gpu=per_gpu,
        gpu_memory_bytes=gpu_memory_bytes,
        fits=total <= gpu_memory_bytes,
        headroom_bytes=gpu_memory_bytes - total,
        min_gpus=min_gpus(workload, stage=stage, gpu_memory_bytes=gpu_memory_bytes),
        stages={s: total_bytes(workload, num_gpus=num_gpus, stage=s) for s in STAGES},
        sweep=tuple(_sweep_point(workload, n, stage, gpu_memory_bytes) for n in SWEEP_NUM_GPUS),
    )


def _sweep_point(workload: Workload, num_gpus: int, stage: int, gpu_memory_bytes: int) -> SweepPoint:
    total = total_bytes(workload, num_gpus=num_gpus, stage=stage)
    return SweepPoint(num_gpus=num_gpus, total_bytes=total, fits=total <= gpu_memory_bytes)
