"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile

# Ray reads this when it is first imported: nodes, GCS and actors then bind 127.0.0.1
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from service.config import get_settings  # noqa: E402
from service.main import create_app  # noqa: E402


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


@pytest.fixture(scope="session")
def ray_cluster():
    """Two Ray nodes on this machine, 2 logical GPUs each, on loopback; shut down after the session.

    Logical CPUs are 4 per node (more than the cores) so that 4 ranks of 0.5
    CPU each plus their supervisors fit; each rank runs torch on one thread.
    Ray's files (sockets, logs, the cluster address) go to a directory of our own.
    """
    import ray
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="zero1-ray-")  # short: Ray's socket paths must fit 107 bytes
    os.environ["RAY_TMPDIR"] = temp_dir
    node = {"num_cpus": 4, "num_gpus": 2, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    try:
        cluster.add_node(num_cpus=4, num_gpus=2)
        ray.init(address=cluster.address, namespace="zero1-tests", log_to_driver=False)
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
