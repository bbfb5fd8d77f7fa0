"""depends_on: a job that needs others waits in the queue until they succeed, is cancelled when one fails
or is cancelled (a chain, a link a scheduler tick), and no cycle can be made (a 422 naming depends_on);
through the API, the CLI and the client, and the real scheduler on stand-ins for Ray (tests/fakes.py),
ticked by the test, whose attempts end by a clock the test moves; on SQLite and PostgreSQL.

Packages: service.scheduling, service.api, service.store, service.cli, service.client.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from fakes import FakeClock, tick
from fastapi.testclient import TestClient

from service.cli import main

import helpers
from conftest import client_on, make_settings, serve_on_fakes


@pytest.fixture
def api(tmp_path, database_url) -> Iterator[TestClient]:
    """The app on 4 logical GPUs whose scheduler ticks only when the test says (tick()), its attempts on
    the clock the test moves (clock.now)."""
    with serve_on_fakes(make_settings(tmp_path, database_url=database_url)) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.launcher.clock = FakeClock()
        yield client


def submit(api: TestClient, **fields) -> int:
    response = api.post("/v1/jobs", json=helpers.job_body(**{"num_gpus": 2, "steps": 1_000_000, **fields}))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def status(api: TestClient, job_id: int) -> str:
    return api.get(f"/v1/jobs/{job_id}").json()["status"]


def waits_for(api: TestClient) -> dict[int, str]:
    return {entry["id"]: entry["reason"] for entry in api.get("/v1/queue").json()["data"]}


def last_reason(api: TestClient, job_id: int) -> str:
    return api.get(f"/v1/jobs/{job_id}/events").json()["data"][-1]["reason"]


def test_a_job_starts_only_once_what_it_depends_on_has_succeeded_though_gpus_were_free(api):
    launcher = api.app.state.runtime.launcher
    first = submit(api)
    second = submit(api, depends_on=[first])
    third = submit(api, depends_on=[first, second])
    launcher.durations_s[first] = 10.0
    launcher.durations_s[second] = 0.0  # done once it runs
    assert api.get(f"/v1/jobs/{third}").json()["depends_on"] == [first, second]

    tick(api, 2)
    assert [status(api, j) for j in (first, second, third)] == ["running", "queued", "queued"]
    assert launcher.held_gpus == 2  # 2 of 4 free: the second would have started, but for first
    assert waits_for(api) == {
        second: f"waiting for job {first} to succeed (it is running)",
        third: f"waiting for job {first} to succeed (it is running)",
    }

    launcher.clock.now = 10.0  # the first's work is done: the tick that sees it succeed starts the second
    tick(api)
    assert [status(api, j) for j in (first, second, third)] == ["succeeded", "starting", "queued"]
    assert waits_for(api) == {third: f"waiting for job {second} to succeed (it is starting)"}
    tick(api)
    assert [status(api, j) for j in (second, third)] == ["succeeded", "starting"]
    assert [job_id for job_id, _, _ in launcher.launched] == [first, second, third]


def test_a_failed_dependency_cancels_the_jobs_that_need_it_link_by_link_naming_it(api):
    launcher = api.app.state.runtime.launcher
    first = submit(api)
    second = submit(api, depends_on=[first])
    third = submit(api, depends_on=[second])
    other = submit(api)  # needs nothing: starts beside first
    tick(api, 2)
    launcher.fail(first, 0)
    tick(api)
    assert status(api, first) == "failed"
    tick(api)
    assert (status(api, second), last_reason(api, second)) == (
        "cancelled",
        f"job {first}, which it depends on, ended failed",
    )
    tick(api)
    assert (status(api, third), last_reason(api, third)) == (
        "cancelled",
        f"job {second}, which it depends on, ended cancelled",
    )
    assert status(api, other) == "running"
    assert [job_id for job_id, _, _ in launcher.launched] == [first, other]

    refused = api.post("/v1/jobs", json=helpers.job_body(depends_on=[first]))
    assert refused.status_code == 422, refused.text
    assert refused.json()["message"] == (
        f"depends_on: job {first} ended failed: a job that depends on it could never start"
    )
    assert [d["field"] for d in refused.json()["detail"]] == ["depends_on"]


def test_no_cycle_can_be_made_and_only_a_job_that_has_not_started_changes_what_it_needs(api):
    a = submit(api, num_gpus=4)  # takes every GPU: the rest stay queued
    tick(api, 2)
    x = submit(api)
    y = submit(api, depends_on=[x])
    z = submit(api, depends_on=[y])
    for needs, cycle in (([z], f"job {x} → job {z} → job {y} → job {x}"), ([x], f"job {x} → job {x}")):
        refused = api.patch(f"/v1/jobs/{x}", json={"depends_on": needs})
        assert refused.status_code == 422, refused.text
        assert refused.json()["message"] == f"depends_on: {cycle} would be a cycle (each needs the next to succeed)"
    assert api.get(f"/v1/jobs/{x}").json()["depends_on"] == []  # nothing of a refused change kept

    changed = api.patch(f"/v1/jobs/{z}", json={"depends_on": [x, a]})
    assert changed.status_code == 200 and changed.json()["depends_on"] == sorted([x, a]), changed.text
    assert api.patch(f"/v1/jobs/{y}", json={"depends_on": []}).json()["depends_on"] == []
    assert api.patch(f"/v1/jobs/{x}", json={"depends_on": [y]}).status_code == 200  # no longer a cycle

    running = api.patch(f"/v1/jobs/{a}", json={"depends_on": [x]})
    assert running.status_code == 409, running.text
    assert f"job {a} is running: only a queued or suspended job's depends_on can change" in running.text

    missing = api.post("/v1/jobs", json=helpers.job_body(depends_on=[10**9]))
    assert missing.status_code == 422 and missing.json()["message"] == "depends_on: no job with id 1000000000"
    for bad, says in (([0], "greater than or equal to 1"), (list(range(1, 34)), "at most 32 items")):
        response = api.post("/v1/jobs", json=helpers.job_body(depends_on=bad))
        assert response.status_code == 422 and says in response.text, response.text


def test_the_cli_and_the_client_submit_a_job_after_another(api, cli_as, tmp_path, capsys):
    first = submit(api)
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(helpers.job_body(name="after", num_gpus=2, steps=1_000_000)))
    cli_as(None)
    assert main(["submit", str(spec), "--depends-on", str(first)]) == 0, capsys.readouterr().err
    after = int(re.search(r"job (\d+) queued", capsys.readouterr().out)[1])
    assert api.get(f"/v1/jobs/{after}").json()["depends_on"] == [first]
    with client_on(api) as client:
        job = client.submit(helpers.job_body(num_gpus=2, steps=1_000_000), depends_on=[first, after])
        assert job.info.depends_on == [first, after]
    tick(api, 2)
    assert waits_for(api) == {
        after: f"waiting for job {first} to succeed (it is running)",
        job.id: f"waiting for job {first} to succeed (it is running)",
    }
