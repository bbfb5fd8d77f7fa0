"""The storage a job's bytes live on: a directory or an S3 prefix (the session's S3 server on
loopback, tests/s3.py), behind workers/training/storage.py; the checkpoints' readers on both; a
URI that is neither never taken for a path.

Packages: workers.training, service.settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.settings import Settings
from workers.records import MetricRow
from workers.training.checkpoints import (
    checkpointed_metrics,
    discard_stored_metrics,
    latest_checkpoint,
    prune_checkpoints,
)
from workers.training.storage import DirectoryStore, ObjectStore, Store, open_store
from workers.uris import is_remote, join_uri, parse_uri


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/some/prefix/", ("s3", "bucket/some/prefix")),
        ("S3://bucket", ("s3", "bucket")),
        ("file:///srv/zero1", ("file", "/srv/zero1")),
        ("/srv/zero1/../ckpt", ("file", "/srv/ckpt")),
    ],
)
def test_a_uri_is_a_directory_or_an_s3_prefix(uri, expected):
    assert parse_uri(uri) == expected


@pytest.mark.parametrize(
    ("uri", "named"),
    [
        ("gs://bucket/prefix", "scheme 'gs' is not supported"),
        ("http://minio:9000/bucket", "scheme 'http' is not supported"),
        ("s3://", "names a bucket"),
        ("s3://bucket/a/../b", "names a bucket"),
        ("file://relative/path", "absolute path"),
        ("", "empty"),
    ],
)
def test_a_uri_that_is_neither_is_refused_naming_it(uri, named):
    with pytest.raises(ValueError, match=named):
        parse_uri(uri)


def test_the_service_refuses_to_start_on_a_storage_it_cannot_use(monkeypatch):
    """Before, `s3:/...` became a local directory of that name under the working directory; now s3 is
    storage, and any other scheme stops the service at start with the variable named."""
    with pytest.raises(ValidationError, match="ZERO1_CHECKPOINT_URI: 'gs://b/ckpt': storage scheme 'gs'"):
        Settings(checkpoint_uri="gs://b/ckpt")
    settings = Settings(checkpoint_uri="s3://zbars/ckpt", local_dir="/srv/zero1")
    assert is_remote(settings.checkpoint_uri)
    assert settings.shared_dir == "/srv/zero1"  # code bundles and token caches: not a directory named s3:
    assert join_uri(settings.checkpoint_uri, "job-1-abc") == "s3://zbars/ckpt/job-1-abc"
    assert Settings(checkpoint_uri="/srv/ckpt").shared_dir == "/srv/ckpt"


@pytest.fixture(params=["directory", "s3"])
def store(request, tmp_path) -> Store:
    """A job's root on a directory, and on the session's S3 server."""
    if request.param == "directory":
        return open_store(str(tmp_path / "job-1-abc"))
    return open_store(request.getfixturevalue("s3_uri") + "/job-1-abc")


def _row(step: int, rank: int) -> dict:
    return MetricRow(
        step=step,
        rank=rank,
        loss=1.0 / (step + 1),
        grad_norm=0.5,
        loss_scale=1.0,
        skipped=False,
        step_time_s=0.01,
        tokens_per_s=100.0,
        mem_peak_bytes=(1000 + rank,),
        mem_planned_bytes=2000,
    ).to_json()


def _checkpoint(store: Store, step: int, *, world_size: int = 2, complete: bool = True) -> None:
    """What the ranks leave for a checkpoint of `step`: shards, rows files, then the marker."""
    directory = f"step-{step:09d}"
    for rank in range(world_size):
        store.write(f"{directory}/rank-{rank:05d}-of-{world_size:05d}.safetensors", b"shard" * 10)
        store.write(
            f"{directory}/rank-{rank:05d}-of-{world_size:05d}.metrics.json", json.dumps([_row(step, rank)]).encode()
        )
    if complete:
        store.write(f"{directory}/complete.json", json.dumps({"step": step, "world_size": world_size}).encode())


def test_the_newest_complete_checkpoint_is_the_one_resumed_from(store):
    assert latest_checkpoint(store) is None
    _checkpoint(store, 9)
    _checkpoint(store, 19, world_size=4)
    _checkpoint(store, 29, complete=False)  # shards and rows, no manifest: interrupted
    assert latest_checkpoint(store) == (19, 4)
    store.write("step-000000039/complete.json", b'{"step": 39, "wor')  # torn: never counts
    assert latest_checkpoint(store) == (19, 4)


def test_pruning_keeps_the_newest_and_their_rows_until_stored(store):
    for step in (9, 19, 29):
        _checkpoint(store, step)
    _checkpoint(store, 39, complete=False)  # being written now: kept
    assert prune_checkpoints(store, keep_last=1) == [9, 19]
    assert latest_checkpoint(store) == (29, 2)
    assert store.list("step-000000009") == [
        "pruned.json",
        "rank-00000-of-00002.metrics.json",
        "rank-00001-of-00002.metrics.json",
    ]
    assert [row.step for row in checkpointed_metrics(store, after_step=-1)] == [9, 19, 29]
    assert [row.mem_peak_bytes for row in checkpointed_metrics(store, after_step=9)] == [(1000, 1001)] * 2
    assert discard_stored_metrics(store, through_step=19) == [9, 19]
    assert [name for name in store.list() if name.startswith("step-")] == ["step-000000029", "step-000000039"]
    assert prune_checkpoints(store, keep_last=1, keep_newest_unfinished=False) == [39]
    assert [name for name in store.list() if name.startswith("step-")] == ["step-000000029"]


def test_a_ranged_read_reads_that_range(store, tmp_path):
    local = tmp_path / "shard.bin"
    local.write_bytes(bytes(range(256)) * 4096)
    store.put_file(local, "step-000000001/rank-00000-of-00001.safetensors")
    assert store.size("step-000000001/rank-00000-of-00001.safetensors") == 1 << 20
    assert store.read_range("step-000000001/rank-00000-of-00001.safetensors", 300, 304) == bytes([44, 45, 46, 47])


def test_a_directory_store_follows_no_link_a_job_planted(tmp_path):
    secret = tmp_path / "zero1.db"
    secret.write_text('{"step": 99, "world_size": 1}')
    store = DirectoryStore(tmp_path / "job-1-abc")
    (store.root / "step-000000099").mkdir(parents=True)
    (store.root / "step-000000099" / "complete.json").symlink_to(secret)
    (store.root / "step-000000100").symlink_to(tmp_path)
    assert latest_checkpoint(store) is None
    with pytest.raises(OSError):
        store.read("step-000000099/complete.json")


def test_the_s3_store_reaches_the_server_through_the_standard_aws_variables_alone(s3_server, s3_uri):
    store = open_store(s3_uri)
    assert isinstance(store, ObjectStore)
    store.write("a/b.json", b"{}")
    mark = s3_server.mark()
    assert store.read("a/b.json") == b"{}"
    assert "GET" in [entry.method for entry in s3_server.requests(mark) if entry.path.endswith("a/b.json")]
    assert not Path(s3_uri.replace("s3://", "s3:/")).exists()  # nothing under a local look-alike
