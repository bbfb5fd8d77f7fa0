"""GET /v1/cluster: the GPUs jobs are admitted against."""

from __future__ import annotations

import os

from fastapi import APIRouter

from service.api.deps import ClusterDep, SettingsDep
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
        data_roots=_resolved(settings.data_roots),
        model_roots=_resolved(settings.model_roots),
    )


def _resolved(roots: list[str]) -> list[str]:
    """As a job's path is checked against them (service/schemas: to_spec): real directories, URIs as they are."""
    return [root if "://" in root else os.path.realpath(root) for root in roots]
