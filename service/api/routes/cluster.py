"""GET /v1/cluster: the GPUs jobs are admitted against."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import ClusterDep
from service.schemas.responses import ClusterPublic

router = APIRouter(tags=["cluster"])


@router.get("/cluster", response_model=ClusterPublic)
def cluster(capacity: ClusterDep) -> ClusterPublic:
    return ClusterPublic(
        num_gpus=capacity.num_gpus,
        num_gpus_free=capacity.num_gpus_free,
        gpu_memory_bytes=capacity.gpu_memory_bytes,
        nodes=capacity.nodes,
        simulated=capacity.simulated,
    )
