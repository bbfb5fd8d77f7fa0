"""GET /v1/cluster: the GPUs jobs are admitted against."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import ClusterDep, SettingsDep
from service.schemas.fields import resolved_roots
from service.schemas.responses import ClusterPublic

router = APIRouter(tags=["cluster"])


@router.get("/cluster", response_model=ClusterPublic)
def cluster(capacity: ClusterDep, settings: SettingsDep) -> ClusterPublic:
    return ClusterPublic(
        num_gpus=capacity.num_gpus,
        num_gpus_free=capacity.num_gpus_free,
        gpu_memory_bytes=capacity.gpu_memory_bytes,
        nodes=capacity.nodes,
        simulated=capacity.simulated,
        data_roots=list(resolved_roots(settings.data_roots)),
        model_roots=list(resolved_roots(settings.model_roots)),
    )
