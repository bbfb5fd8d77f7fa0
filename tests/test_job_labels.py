"""Tags and notes on jobs, as a user sets and finds them: at submit and by PATCH /v1/jobs/{id}, GET
/v1/jobs?tag= (every tag given), the CLI and the client; who sees the notes, who may change them, and
what a bad tag gets; on SQLite and PostgreSQL (the app on stand-ins for Ray, its scheduler stopped).

Packages: service.api, service.store, service.schemas, service.cli, service.client.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from service.cli import main
from service.store.tables import JobTag

import helpers
from conftest import client_on, make_settings, serve_on_fakes
from helpers import bearer

ALICE, BOB, ROOT = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "bob", "root"))
TOKENS = f"alice:{ALICE},bob:{BOB},root:{ROOT}:admin"


@pytest.fixture
def api(tmp_path, database_url) -> Iterator[TestClient]:
    settings = make_settings(tmp_path, database_url=database_url, api_tokens=TOKENS)
    with serve_on_fakes(settings) as client:
        client.app.state.runtime.scheduler.stop()
        yield client


def submit(client: TestClient, token: str, **fields) -> dict:
    response = client.post("/v1/jobs", json=helpers.job_body(steps=1_000_000, **fields), headers=bearer(token))
    assert response.status_code == 201, response.text
    return response.json()


def listed(client: TestClient, token: str, *tags: str, **params) -> list[int]:
    response = client.get("/v1/jobs", params={"tag": list(tags), **params}, headers=bearer(token))
    assert response.status_code == 200, response.text
    return [job["id"] for job in response.json()["data"]]


def test_tags_set_at_submit_and_by_patch_find_the_jobs_that_carry_every_tag_asked(api):
    a = submit(api, ALICE, name="a", tags=["lr=3e-4", "baseline", "baseline"], notes="first try\n\twarmup 10")
    b = submit(api, ALICE, name="b", tags=["baseline"])
    c = submit(api, BOB, name="c")
    assert a["tags"] == ["baseline", "lr=3e-4"]  # a set, in alphabetical order
    assert a["notes"] == "first try\n\twarmup 10"
    assert (b["tags"], c["tags"], c["notes"]) == (["baseline"], [], None)

    assert listed(api, ALICE, "baseline") == [b["id"], a["id"]]  # newest first
    assert listed(api, ALICE, "baseline", "lr=3e-4") == [a["id"]]  # every tag given
    assert listed(api, ALICE, "nowhere") == []
    assert listed(api, ALICE) == [c["id"], b["id"], a["id"]]
    assert listed(api, ALICE, "baseline", limit=1) == [b["id"]]

    patched = api.patch(f"/v1/jobs/{c['id']}", json={"tags": ["baseline", "bob"]}, headers=bearer(BOB))
    assert patched.status_code == 200, patched.text
    assert patched.json()["tags"] == ["baseline", "bob"] and patched.json()["priority"] == 50
    assert listed(api, BOB, "baseline") == [c["id"], b["id"], a["id"]]
    replaced = api.patch(f"/v1/jobs/{a['id']}", json={"tags": ["other"]}, headers=bearer(ALICE)).json()
    assert replaced["tags"] == ["other"] and replaced["notes"] == "first try\n\twarmup 10"  # notes left as they were
    assert listed(api, ALICE, "baseline") == [c["id"], b["id"]]
    assert api.get(f"/v1/jobs/{a['id']}", headers=bearer(ALICE)).json()["tags"] == ["other"]
    cleared = api.patch(f"/v1/jobs/{a['id']}", json={"tags": [], "notes": ""}, headers=bearer(ALICE)).json()
    assert (cleared["tags"], cleared["notes"]) == ([], None)
    with api.app.state.runtime.db.session() as session:
        assert session.scalars(select(JobTag.tag).where(JobTag.job_id == a["id"])).all() == []


def test_everyone_sees_the_tags_only_the_owner_and_admins_the_notes_and_only_they_change_either(api):
    job = submit(api, ALICE, tags=["mine"], notes="private")
    seen_by_bob = api.get(f"/v1/jobs/{job['id']}", headers=bearer(BOB)).json()
    assert (seen_by_bob["tags"], seen_by_bob["notes"]) == (["mine"], None)
    assert api.get(f"/v1/jobs/{job['id']}", headers=bearer(ROOT)).json()["notes"] == "private"
    assert [j["notes"] for j in api.get("/v1/jobs", params={"tag": "mine"}, headers=bearer(BOB)).json()["data"]] == [
        None
    ]

    refused = api.patch(f"/v1/jobs/{job['id']}", json={"notes": "bob was here"}, headers=bearer(BOB))
    assert refused.status_code == 403, refused.text
    assert "only alice or an admin may change the tags or notes of it" in refused.json()["message"], refused.text
    by_admin = api.patch(f"/v1/jobs/{job['id']}", json={"notes": "checked"}, headers=bearer(ROOT))
    assert by_admin.status_code == 200 and by_admin.json()["notes"] == "checked"


def test_a_finished_jobs_tags_change_though_its_priority_cannot(api):
    job = submit(api, ALICE)
    assert api.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(ALICE)).status_code == 202
    tagged = api.patch(f"/v1/jobs/{job['id']}", json={"tags": ["kept"]}, headers=bearer(ALICE))
    assert tagged.status_code == 200 and tagged.json()["tags"] == ["kept"], tagged.text
    both = api.patch(f"/v1/jobs/{job['id']}", json={"priority": 60, "tags": ["changed"]}, headers=bearer(ALICE))
    assert both.status_code == 409, both.text  # one request, one answer: nothing of it is kept
    assert api.get(f"/v1/jobs/{job['id']}", headers=bearer(ALICE)).json()["tags"] == ["kept"]


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"tags": ["-leading"]}, "tags.0", "String should match pattern"),
        ({"tags": ["has space"]}, "tags.0", "String should match pattern"),
        ({"tags": ["x" * 65]}, "tags.0", "String should match pattern"),
        ({"tags": [f"t{i}" for i in range(33)]}, "tags", "at most 32 items"),
        ({"notes": "a\n\x1bb"}, "notes", "must not contain a control or format character (\\x1b at 2)"),
        ({"notes": "x" * 20_001}, "notes", "at most 20000 characters"),
        ({}, "priority", "give at least one of priority, tags, notes and depends_on"),
    ],
)
def test_a_bad_tag_or_note_is_a_422_naming_the_field(api, body, field, says):
    job = submit(api, ALICE)
    response = api.patch(f"/v1/jobs/{job['id']}", json=body, headers=bearer(ALICE))
    assert response.status_code == 422, response.text
    assert [problem["field"] for problem in response.json()["detail"]] == [field], response.text
    assert says in response.json()["message"], response.text
    if body:
        submitted = api.post("/v1/jobs", json=helpers.job_body(**body), headers=bearer(ALICE))
        assert submitted.status_code == 422 and says in submitted.json()["message"], submitted.text
    bad = api.get("/v1/jobs", params={"tag": "not a tag"}, headers=bearer(ALICE))
    assert bad.status_code == 422 and "tag" in bad.text, bad.text


def test_the_cli_submits_with_tags_lists_by_tag_and_adds_and_removes_them(cli_as, api, tmp_path, capsys):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(helpers.job_body(name="cli-job", steps=1_000_000, tags=["from-spec"])))
    cli_as(ALICE)
    assert main(["submit", str(spec), "--tag", "lr=1e-3", "--tag", "sweep:1", "--notes", "try 1"]) == 0
    job_id = int(re.search(r"job (\d+) queued", capsys.readouterr().out)[1])
    other = submit(api, ALICE, name="untagged")
    job = api.get(f"/v1/jobs/{job_id}", headers=bearer(ALICE)).json()
    assert (job["tags"], job["notes"]) == (["from-spec", "lr=1e-3", "sweep:1"], "try 1")

    assert main(["jobs", "--tag", "sweep:1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].split()[0] == str(job_id), lines
    assert lines[1].endswith("cli-job  [from-spec, lr=1e-3, sweep:1]"), lines
    assert main(["tag", str(other["id"]), "sweep:1", "b"]) == 0
    assert capsys.readouterr().out == f"job {other['id']}: tags b, sweep:1\n"
    assert main(["jobs", "--tag", "sweep:1", "--tag", "b"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [str(other["id"])]
    assert main(["untag", str(job_id), "from-spec", "absent"]) == 0
    assert capsys.readouterr().out == f"job {job_id}: tags lr=1e-3, sweep:1\n"

    cli_as(BOB)
    assert main(["tag", str(job_id), "bob"]) == 1
    assert "only alice or an admin may change the tags or notes of it, not bob" in capsys.readouterr().err


def test_the_client_submits_tags_finds_jobs_by_them_and_sets_tags_and_notes(api):
    with client_on(api, ALICE) as client:
        job = client.submit(helpers.job_body(steps=1_000_000), tags=["a", "b"], notes="first")
        assert (job.info.tags, job.info.notes) == (["a", "b"], "first")
        assert [j.id for j in client.jobs(tag=["a", "b"])] == [job.id]
        assert client.jobs(tag="c") == []
        assert job.set_tags(["c"]).info.tags == ["c"]
        assert job.set_notes("second").info.notes == "second"
        assert [j.id for j in client.jobs(tag="c")] == [job.id]
        assert client.job(job.id).info.notes == "second"
