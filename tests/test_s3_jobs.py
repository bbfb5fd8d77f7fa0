"""Jobs whose checkpoints and final model live on S3: the session's S3 server on loopback
(tests/s3.py), reached by each rank's trusted parent through its spool (workers/runtime/spool.py),
never by the child that trains.

Packages: workers.runtime, workers.training, service.scheduling, service.store.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import ray

from workers.runtime.spool import Spool, SpoolError
from workers.training.checkpoints import latest_checkpoint, shard_header
from workers.training.storage import ObjectStore, open_store

from conftest import make_settings, serve
from helpers import TERMINAL, job_body, wait_job
from helpers import wait_for as wait_for_value
from test_artifacts import LLAMA
from test_python_jobs import EXAMPLE_DIR, example, upload
from test_workers import config, finished, start_job, wait_for


def shards(store: ObjectStore, step: int) -> dict[str, bytes]:
    directory = f"step-{step:09d}"
    return {name: store.read(f"{directory}/{name}") for name in store.list(directory) if name.endswith(".safetensors")}


def _data_start(store: ObjectStore, name: str) -> int:
    """Where a stored shard's tensors begin: past its safetensors header."""
    return shard_header(lambda start, end: store.read_range(name, start, end))[0]


def test_a_killed_rank_resumes_from_the_last_complete_s3_checkpoint_bit_for_bit(ray_cluster, s3_uri):
    steps = 90
    reference = config(steps=steps, checkpoint_every=10, checkpoint_dir=f"{s3_uri}/reference")
    killed = config(steps=steps, checkpoint_every=10, checkpoint_dir=f"{s3_uri}/killed")
    # the uninterrupted run trains beside the one that is killed: 2 of the session cluster's 4 GPUs each
    uninterrupted = start_job(reference, num_workers=2, job_id="reference")
    supervisor = start_job(killed, num_workers=2, job_id="killed")
    wait_for(supervisor, until=lambda state, rows: any(r.step >= 35 for r in rows))
    ray.kill(ray.get(supervisor.worker.remote(1)))
    state, _ = wait_for(supervisor, until=finished, timeout_s=30)
    assert state.status == "failed"
    state, _ = wait_for(uninterrupted, until=finished)
    assert state.status == "succeeded", state.error
    store = open_store(killed.checkpoint_dir)
    resumed_from = latest_checkpoint(store)[0] + 1
    assert 30 <= resumed_from < steps

    state, rows = wait_for(start_job(killed, num_workers=2, job_id="retry"), until=finished)
    assert state.status == "succeeded", state.error
    assert min(r.step for r in rows) == resumed_from
    resumed = shards(store, steps - 1)
    uninterrupted = shards(open_store(reference.checkpoint_dir), steps - 1)
    assert sorted(resumed) == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert resumed == uninterrupted  # bit for bit: parameters, moments and step counts
    assert latest_checkpoint(store) == (steps - 1, 2)
    manifest = json.loads(store.read("final/manifest.json"))
    assert {f["name"] for f in manifest["files"]} == {"model.safetensors", "spec.json"}
    for entry in manifest["files"]:
        assert hashlib.sha256(store.read(f"final/{entry['name']}")).hexdigest() == entry["sha256"]


def test_a_resize_from_2_to_4_ranks_reads_only_the_byte_ranges_each_rank_owns(ray_cluster, s3_server, s3_uri):
    uri = f"{s3_uri}/elastic"
    first = config(steps=20, checkpoint_every=10, micro_batch_size=4, checkpoint_dir=uri)
    state, _ = wait_for(start_job(first, num_workers=2, job_id="at-2"), until=finished)
    assert state.status == "succeeded", state.error
    store = open_store(uri)
    saved = {name: store.size(f"step-000000019/{name}") for name in shards(store, 19)}
    data_start = {
        name: shard_header(lambda a, b, n=name: store.read_range(f"step-000000019/{n}", a, b))[0] for name in saved
    }
    state_bytes = sum(saved[name] - data_start[name] for name in saved)

    mark = s3_server.mark()
    second = config(steps=30, checkpoint_every=10, micro_batch_size=4, checkpoint_dir=uri)
    supervisor = start_job(second, num_workers=4, job_id="at-4")
    state, rows = wait_for(supervisor, until=finished)
    assert state.status == "succeeded", state.error
    assert min(r.step for r in rows) == 20

    # every GET of a saved shard is a range; past the headers, the ranges the 4 ranks asked are
    # disjoint and together the state once: no rank read a byte it does not own
    gets = s3_server.requests(mark, key_prefix=f"{uri}/step-000000019/rank-", method="GET")
    assert gets and all(e.range for e in gets)
    data: dict[str, list[tuple[int, int]]] = {}
    for entry in gets:
        name = entry.path.rsplit("/", 1)[1]
        start, end = (int(x) for x in re.fullmatch(r"bytes=(\d+)-(\d+)", entry.range).groups())
        assert entry.sent_bytes == end + 1 - start
        if start >= data_start[name]:
            data.setdefault(name, []).append((start, end + 1))
    for name, ranges in data.items():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False)), f"{name}: a byte read twice"
    assert sum(b - a for ranges in data.values() for a, b in ranges) == state_bytes

    # and each rank says what it read: at most its shard and the headers
    logs = ray.get(supervisor.poll.remote()).logs
    reads = [line.line for line in logs if "resumed from step 19" in line.line]
    assert len(reads) == 4, reads
    for line in reads:
        read, shard = (
            int(x.replace(",", "")) for x in re.search(r"read ([\d,]+) bytes.*shard is ([\d,]+) bytes", line).groups()
        )
        assert read <= shard + sum(data_start.values()), line


def test_a_checkpoint_whose_peers_never_stored_their_files_gets_no_manifest(s3_uri, tmp_path, monkeypatch):
    """Rank 0's parent stores the manifest only once every rank's files are stored: one that never
    comes leaves the checkpoint without one, and the one before stays the newest."""
    store = open_store(f"{s3_uri}/job")
    for rank in range(2):
        store.write(f"step-000000009/rank-{rank:05d}-of-00002.safetensors", b"x")
        store.write(f"step-000000009/rank-{rank:05d}-of-00002.metrics.json", b"[]")
    store.write("step-000000009/complete.json", json.dumps({"step": 9, "world_size": 2}).encode())
    monkeypatch.setattr("workers.runtime.spool.PEER_TIMEOUT_S", 0.5)
    spool = Spool(store, home=str(tmp_path), rank=0, world_size=2, keep_last=2, run_as=None)
    names = ["rank-00000-of-00002.safetensors", "rank-00000-of-00002.metrics.json", "complete.json"]
    (spool.dir / "step-000000019").mkdir(parents=True)
    for name in names:
        (spool.dir / "step-000000019" / name).write_text(json.dumps({"step": 19, "world_size": 2}))
    spool.saved(19, [f"step-000000019/{name}" for name in names])
    with pytest.raises(SpoolError, match="1 rank\\(s\\) did not store their files"):
        spool.drain(timeout_s=30)
    assert store.list("step-000000019") == names[:2][::-1]  # its shard and rows, no manifest
    assert latest_checkpoint(store) == (9, 2)
    with pytest.raises(SpoolError, match="may not save"):
        spool.saved(29, ["step-000000029/rank-00001-of-00002.safetensors"])  # another rank's file
    spool.close()


def test_a_planted_link_in_the_spool_is_never_stored(s3_uri, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("the service's")
    spool = Spool(
        open_store(f"{s3_uri}/job"), home=str(tmp_path / "home"), rank=1, world_size=2, keep_last=1, run_as=None
    )
    (spool.dir / "step-000000009").mkdir(parents=True)
    (spool.dir / "step-000000009" / "rank-00001-of-00002.safetensors").symlink_to(secret)
    spool.saved(9, ["step-000000009/rank-00001-of-00002.safetensors"])
    with pytest.raises(SpoolError, match="storing rank 1's checkpoint failed"):
        spool.drain(timeout_s=30)
    assert spool.store.list() == []
    spool.close()


@pytest.fixture
def s3_app(ray_cluster, s3_uri, tmp_path):
    settings = make_settings(tmp_path, checkpoint_uri=s3_uri, local_dir=str(tmp_path / "local"))
    with serve(settings) as client:
        yield client, settings


def test_a_job_on_s3_checkpoints_there_and_its_artifacts_download_through_the_api(s3_app, tmp_path):
    client, settings = s3_app
    s3_uri = settings.checkpoint_uri
    job = client.post("/v1/jobs", json=job_body(steps=30, checkpoint_every=10)).json()
    job = wait_job(client, job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    rows = client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 100}).json()["data"]
    assert [row["step"] for row in rows] == list(range(30))

    artifacts = client.get(f"/v1/jobs/{job['id']}/artifacts").json()["data"]
    assert {a["name"] for a in artifacts} == {"model.safetensors", "spec.json"}
    for artifact in artifacts:
        got = client.get(f"/v1/jobs/{job['id']}/artifacts/{artifact['name']}")
        assert got.status_code == 200
        assert hashlib.sha256(got.content).hexdigest() == artifact["sha256"]
    ranged = client.get(f"/v1/jobs/{job['id']}/artifacts/spec.json", headers={"Range": "bytes=0-9"})
    assert ranged.status_code == 206 and len(ranged.content) == 10

    store = open_store(s3_uri)
    (job_prefix,) = store.list()
    # once its rows are stored, the job keeps ZERO1_CHECKPOINT_KEEP_FINISHED=1 checkpoint and its model
    wait_for_value(lambda: store.list(job_prefix), lambda kept: kept == ["final", "step-000000029"], what="retired")
    assert not (tmp_path / "checkpoints").exists()  # nothing on local disk under any checkpoint path
    assert not Path("s3:").exists()
    from safetensors.torch import load

    weights = load(store.read(f"{job_prefix}/final/model.safetensors"))
    assert weights and all(t.dtype.is_floating_point for t in weights.values())


def test_a_code_bundle_is_stored_in_the_bucket_and_the_ranks_run_it_from_there(ray_cluster, s3_uri, tmp_path):
    examples = Path(__file__).resolve().parents[1] / "examples"
    settings = make_settings(
        tmp_path, checkpoint_uri=s3_uri, local_dir=str(tmp_path / "local"), data_roots=[str(examples / "data")]
    )
    with serve(settings) as client:
        code = upload(client, EXAMPLE_DIR)
        assert open_store(s3_uri).list("code") == [f"{code.removeprefix('sha256:')}.zip"]
        assert not (tmp_path / "local" / "code").exists()
        job = client.post("/v1/jobs", json=example(code, steps=6, checkpoint_every=3))
        assert job.status_code == 201, job.text
        job = wait_job(client, job.json()["id"], lambda j: j["status"] in TERMINAL)
        assert job["status"] == "succeeded", job["error"]
        spec = client.get(f"/v1/jobs/{job['id']}/artifacts/spec.json").json()
        assert spec["code"] == code


def test_an_hf_models_final_directory_on_s3_loads_with_from_pretrained(ray_cluster, s3_uri, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from workers.config import HFSpec

    model = HFSpec(config=LLAMA, vocab_size=64, block_size=32)
    # planned_bytes: what the service's trace of an hf model would give (no closed form for one)
    job = config(model=model, steps=4, planned_bytes=1 << 30, checkpoint_dir=f"{s3_uri}/hf")
    state, _ = wait_for(start_job(job, num_workers=2, job_id="hf"), until=finished)
    assert state.status == "succeeded", state.error
    store = open_store(job.checkpoint_dir)
    manifest = json.loads(store.read("final/manifest.json"))
    local = tmp_path / "final"
    local.mkdir()
    for entry in manifest["files"]:
        data = store.read(f"final/{entry['name']}")
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        (local / entry["name"]).write_bytes(data)
    loaded = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    shards = {name: store.size(f"step-000000003/{name}") for name in store.list("step-000000003")}
    assert loaded.config.num_hidden_layers == 2 and len(shards) == 5  # 2 shards, 2 rows files, the manifest
    ids = torch.arange(16).view(1, 16)
    assert torch.isfinite(loaded(ids).logits).all()
