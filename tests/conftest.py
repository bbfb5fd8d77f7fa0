"""Shared fixtures."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.config import get_settings
from service.main import create_app


@pytest.fixture
def client(monkeypatch) -> TestClient:
    """The app with a known simulated cluster: 4 GPUs of 80 GB, 1 GB overhead."""
    monkeypatch.setenv("ZERO1_SIMULATED_GPUS", "4")
    monkeypatch.setenv("ZERO1_SIMULATED_GPU_MEMORY_GB", "80")
    monkeypatch.setenv("ZERO1_GPU_OVERHEAD_GB", "1")
    get_settings.cache_clear()
    with TestClient(create_app(), raise_server_exceptions=False) as test_client:
        yield test_client
    get_settings.cache_clear()
