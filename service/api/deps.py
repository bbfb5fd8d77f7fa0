"""Dependencies injected into routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends

from service.cluster import ClusterCapacity, simulated_capacity
from service.config import Settings, get_settings

SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_cluster(settings: SettingsDep) -> ClusterCapacity:
    """The GPUs plans are checked against."""
    return simulated_capacity(settings)


ClusterDep = Annotated[ClusterCapacity, Depends(get_cluster)]
