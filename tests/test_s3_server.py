"""The tests' S3 API (tests/s3.py, the s3_server fixture): what workers.training's object store
relies on, through fsspec's s3fs configured by the standard AWS_* variables alone, and a request
log that counts the bytes each read cost.

Packages: workers.training.
"""

from __future__ import annotations

import os

import fsspec
import pytest


@pytest.fixture
def fs(s3_server):
    """A fresh s3fs filesystem (not fsspec's cached instance): configured by os.environ as it is now."""
    return fsspec.filesystem("s3", skip_instance_cache=True)


def test_the_aws_variables_point_at_the_loopback_server(s3_server):
    assert s3_server.endpoint.startswith("http://127.0.0.1:")
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint and os.environ["AWS_REGION"] == "us-east-1"
    assert "AWS_PROFILE" not in os.environ
    assert s3_server.uri("a/b/") == "s3://zero1-test/a/b" and s3_server.uri() == "s3://zero1-test"


def test_s3fs_writes_lists_and_reads_an_object(fs, s3_uri):
    data = os.urandom(1 << 20)
    path = s3_uri.removeprefix("s3://") + "/step-000000001/rank-00000-of-00002.bin"
    fs.pipe_file(path, data)
    assert fs.cat_file(path) == data
    assert fs.size(path) == len(data)
    assert fs.ls(s3_uri + "/step-000000001", detail=False) == [path]


def test_a_ranged_read_returns_and_costs_exactly_its_bytes(fs, s3_server, s3_uri):
    data = os.urandom(3 << 20)
    key = s3_uri.removeprefix(f"s3://{s3_server.bucket}/") + "/shard.bin"
    fs.pipe_file(f"{s3_server.bucket}/{key}", data)

    for start, end in [(0, 1), (1_000_003, 2_500_000), (len(data) - 17, len(data))]:
        mark = s3_server.mark()
        assert fs.cat_file(f"{s3_server.bucket}/{key}", start=start, end=end) == data[start:end]
        gets = s3_server.requests(mark, key_prefix=key, method="GET")
        assert [g.range for g in gets] == [f"bytes={start}-{end - 1}"], gets
        assert gets[0].status == 206
        assert s3_server.bytes_served(key, since=mark) == end - start

    mark = s3_server.mark()
    assert fs.cat_file(f"{s3_server.bucket}/{key}") == data
    assert s3_server.bytes_served(s3_server.uri(key), since=mark) == len(data)  # an s3:// URI is a prefix too


def test_an_upload_is_logged_with_its_bytes(fs, s3_server, s3_uri):
    mark = s3_server.mark()
    fs.pipe_file(s3_uri.removeprefix("s3://") + "/complete.json", b'{"step": 1}')
    (put,) = s3_server.requests(mark, key_prefix=s3_uri + "/complete.json", method="PUT")
    assert (put.status, put.received_bytes, put.sent_bytes) == (200, 11, 0)


def test_the_session_ray_cluster_reaches_it_on_every_node(ray_cluster, fs, s3_uri):
    """A rank's actor inherits its node's environment: the nodes started after s3_server hold the AWS_* variables."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    path = s3_uri.removeprefix("s3://") + "/from-the-driver"
    fs.pipe_file(path, b"written by the test")

    @ray.remote(num_cpus=0)
    def read(path: str) -> tuple[str, bytes]:
        return os.environ["AWS_ENDPOINT_URL"], fsspec.filesystem("s3", skip_instance_cache=True).cat_file(path)

    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    strategies = [NodeAffinitySchedulingStrategy(node, soft=False) for node in nodes]
    found = ray.get([read.options(scheduling_strategy=s).remote(path) for s in strategies], timeout=120)
    assert len(nodes) == 2 and found == [(os.environ["AWS_ENDPOINT_URL"], b"written by the test")] * 2
