"""A job's checkpoints, downloaded through the API (GET /v1/jobs/{id}/checkpoints and its files): a
real 2-rank job that keeps its two newest checkpoints lists exactly those, each rank's shard comes
back byte for byte (whole and by Range) and loads as the safetensors file the ranks wrote; a pruned
step, a name the listing does not give, a path and a link planted where a shard would be are 404s;
another user gets a 404 for the job itself. The Python client and `zero1 download --checkpoint`
fetch one, each file's size checked.

Packages: service.api, service.store, service.client, service.cli, workers.training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load

from service import cli
from service.cli import jobs as cli_jobs
from zero1 import Client

from conftest import make_settings, serve
from helpers import TERMINAL, job_body, wait_job

STEPS = 40
EVERY = 10
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef012"


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory):
    """A succeeded job of alice's that kept its 2 newest checkpoints (steps 29 and 39), and its directory."""
    tmp = tmp_path_factory.mktemp("checkpoint-downloads")
    settings = make_settings(tmp, api_tokens=f"alice:{ALICE},bob:{BOB}", checkpoint_keep_finished=2)
    with serve(settings) as client:
        client.headers["Authorization"] = f"Bearer {ALICE}"
        r = client.post("/v1/jobs", json=job_body(steps=STEPS, checkpoint_every=EVERY))
        assert r.status_code == 201, r.text
        job = wait_job(client, r.json()["id"], lambda j: j["status"] in TERMINAL)
        assert job["status"] == "succeeded", job["error"]
        (directory,) = Path(settings.checkpoint_uri).glob(f"job-{job['id']}-*")
        yield client, job["id"], directory


def test_the_listing_names_the_stored_checkpoints_and_their_files(trained):
    client, job_id, directory = trained
    r = client.get(f"/v1/jobs/{job_id}/checkpoints")
    assert r.status_code == 200, r.text
    listing = r.json()
    shards = ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert [c["step"] for c in listing["data"]] == [29, 39] and listing["count"] == 2
    for checkpoint in listing["data"]:
        step_dir = directory / f"step-{checkpoint['step']:09d}"
        assert checkpoint["files"] == [
            {"name": name, "bytes": (step_dir / name).stat().st_size} for name in ["complete.json", *shards]
        ]


def test_each_file_downloads_byte_for_byte_and_loads(trained):
    client, job_id, directory = trained
    for name in ("rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "complete.json"):
        on_disk = (directory / "step-000000039" / name).read_bytes()
        r = client.get(f"/v1/jobs/{job_id}/checkpoints/39/{name}")
        assert r.status_code == 200 and r.content == on_disk, name
        assert r.headers["content-disposition"] == f'attachment; filename="step-39-{name}"'
        assert r.headers["content-length"] == str(len(on_disk))
    shard = load(client.get(f"/v1/jobs/{job_id}/checkpoints/39/rank-00001-of-00002.safetensors").content)
    assert shard and all(tensor.numel() > 0 for tensor in shard.values())
    marker = client.get(f"/v1/jobs/{job_id}/checkpoints/39/complete.json").json()
    assert marker["step"] == 39 and marker["world_size"] == 2
    part = client.get(f"/v1/jobs/{job_id}/checkpoints/29/complete.json", headers={"Range": "bytes=2-9"})
    assert (
        part.status_code == 206 and part.content == (directory / "step-000000029" / "complete.json").read_bytes()[2:10]
    )
    past = client.get(f"/v1/jobs/{job_id}/checkpoints/29/complete.json", headers={"Range": "bytes=100000-"})
    assert past.status_code == 416 and past.json()["error"] == "range_not_satisfiable"


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("9/rank-00000-of-00002.safetensors", "pruned: step 9 kept its rows only"),
        ("39/rank-00000-of-00002.metrics.json", "the rows file: not a file the listing gives"),
        ("39/manifest.json", "not a checkpoint's file"),
        ("39/..%2F..%2Fzero1.db", "a path"),
        ("1000000000/complete.json", "a step no directory can have"),
    ],
)
def test_what_the_listing_does_not_give_is_a_404(trained, path, why):
    client, job_id, _ = trained
    r = client.get(f"/v1/jobs/{job_id}/checkpoints/{path}")
    assert r.status_code == (422 if path.startswith("1000000000/") else 404), (why, r.text)
    assert r.json()["error"] in ("not_found", "invalid_request"), why
    assert b"SQLite" not in r.content


def test_a_link_planted_where_a_shard_would_be_is_neither_listed_nor_served(trained):
    client, job_id, directory = trained
    step_dir = directory / "step-000000039"
    planted = step_dir / "rank-00002-of-00002.safetensors"
    database = Path(client.app.state.runtime.settings.database_url.removeprefix("sqlite:///"))
    os.symlink(database, planted)  # as a job's code under the service's uid could
    try:
        listed = {f["name"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"] for f in c["files"]}
        assert planted.name not in listed
        r = client.get(f"/v1/jobs/{job_id}/checkpoints/39/{planted.name}")
        assert r.status_code == 404 and b"SQLite" not in r.content
    finally:
        planted.unlink()


def test_another_user_sees_no_checkpoints_of_the_job(trained):
    client, job_id, _ = trained
    bob = {"Authorization": f"Bearer {BOB}"}
    for path in ("checkpoints", "checkpoints/39/complete.json"):
        r = client.get(f"/v1/jobs/{job_id}/{path}", headers=bob)
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    assert json.loads(client.get(f"/v1/jobs/{job_id}/checkpoints").content)["count"] == 2  # alice still does


def test_the_client_and_the_cli_download_a_stored_checkpoint(trained, tmp_path, monkeypatch, capsys):
    client, job_id, directory = trained
    job = Client(http=client).job(job_id)
    assert [c.step for c in job.checkpoints()] == [29, 39]
    paths = job.download(tmp_path / "py", checkpoint=29)
    stored = sorted(p.name for p in (directory / "step-000000029").iterdir() if not p.name.endswith(".metrics.json"))
    assert sorted(p.name for p in paths) == stored
    for path in paths:
        assert path.read_bytes() == (directory / "step-000000029" / path.name).read_bytes()

    monkeypatch.setattr(cli_jobs, "_client", lambda args, **_: Client(http=client))
    assert cli.main(["download", str(job_id), str(tmp_path / "cli"), "--checkpoint", "39"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.endswith("bytes  size ok") for line in lines), lines
    assert (tmp_path / "cli" / "rank-00001-of-00002.safetensors").read_bytes() == (
        directory / "step-000000039" / "rank-00001-of-00002.safetensors"
    ).read_bytes()
    assert cli.main(["download", str(job_id), str(tmp_path / "gone"), "--checkpoint", "9"]) == 1
    assert f"job {job_id} stores no checkpoint at step 9 (stored: [29, 39])" in capsys.readouterr().err
    assert not (tmp_path / "gone").exists()
