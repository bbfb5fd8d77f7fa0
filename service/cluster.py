"""What the cluster offers: the GPUs that plans and admission are checked against."""

from __future__ import annotations

from dataclasses import dataclass

from service.config import Settings
from workers.memory import gpu_memory_bytes_from_gb


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterCapacity:
    num_gpus: int
    gpu_memory_bytes: int
    simulated: bool
    """True where the GPUs are logical (a machine without CUDA)."""


def simulated_capacity(settings: Settings) -> ClusterCapacity:
    """The logical GPUs of ZERO1_SIMULATED_GPUS x ZERO1_SIMULATED_GPU_MEMORY_GB."""
    return ClusterCapacity(
        num_gpus=settings.simulated_gpus,
        gpu_memory_bytes=gpu_memory_bytes_from_gb(settings.simulated_gpu_memory_gb),
        simulated=True,
    )
