"""Priorities, quotas, suspend and resume as a user drives them: the ceilings of ZERO1_PRIORITY_LIMITS and the
quotas of ZERO1_GPU_QUOTAS at submit, PATCH /v1/jobs/{id}, suspend and resume, GET /v1/queue, the CLI's
commands, the /metrics names, and the dashboard's queue panel. The scheduler is stopped, so every job
stays where the requests put it (the scheduler's own side is tests/test_scheduler.py's).

Packages: service.scheduling, service.api, service.cli, service.dashboard, service.telemetry.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from fakes import metric_row
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from service.cli import main
from service.scheduling import controls
from service.scheduling.dispatch import Reasons
from service.scheduling.job_states import transition
from service.store.metric_rows import store_metrics
from service.store.tables import Job

import helpers
from conftest import make_settings, serve_on_fakes
from helpers import bearer

ALICE, INTERN, ROOT = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "intern", "root"))
TOKENS = f"alice:{ALICE},intern:{INTERN},root:{ROOT}:admin"


WAITING_REASON = Reasons().of(0)  # before the scheduler's first tick


def job_body(**overrides) -> dict:
    return helpers.job_body(**{"steps": 1_000_000, **overrides})


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[TestClient]:
    """intern's ceiling is 50 and quota 2 GPUs, everyone else's ceiling 80 and no quota; root is an admin.
    The scheduler is stopped once the app is up: nothing starts, every job stays as the requests leave it
    (on stand-ins for Ray: none would run)."""
    settings = make_settings(
        tmp_path_factory.mktemp("priorities"),
        api_tokens=TOKENS,
        priority_limits="intern=50,*=80",
        gpu_quotas="intern=2",
    )
    with serve_on_fakes(settings) as client:
        client.app.state.runtime.scheduler.stop()
        yield client


@pytest.fixture(autouse=True)
def _empty_queue(request) -> Iterator[None]:
    """Each test of the app starts with no job waiting or held: every one left is ended in the database."""
    yield
    if "api" not in request.fixturenames:
        return
    with request.getfixturevalue("api").app.state.runtime.db.session() as session:
        for job in session.scalars(select(Job).where(Job.status.not_in(("succeeded", "failed", "cancelled")))):
            transition(session, job, "cancelled", "the test ended")


def submit(client: TestClient, token: str, **overrides) -> dict:
    response = client.post("/v1/jobs", json=job_body(**overrides), headers=bearer(token))
    assert response.status_code == 201, response.text
    return response.json()


def get(client: TestClient, job_id: int) -> dict:
    return client.get(f"/v1/jobs/{job_id}", headers=bearer(ROOT)).json()


def start_by_hand(client: TestClient, job_id: int, *, world_size: int | None = None) -> None:
    """queued -> starting as the scheduler would move it (which is stopped): the job now holds its GPUs."""
    with client.app.state.runtime.db.session() as session:
        job = session.get(Job, job_id)
        assert transition(session, job, "starting", "started by the test")
        job.world_size = world_size


# --------------------------------------------------------------------------- at submit


def test_a_priority_above_the_owners_ceiling_is_a_403_naming_both_numbers(api):
    refused = api.post("/v1/jobs", json=job_body(priority=90), headers=bearer(INTERN))
    assert refused.status_code == 403, refused.text
    body = refused.json()
    assert (body["error"], body["priority"], body["limit"]) == ("forbidden_priority", 90, 50)
    assert body["message"] == "priority 90 is above user intern's ceiling of 50 (ZERO1_PRIORITY_LIMITS)"
    dry = api.post("/v1/jobs", json=job_body(priority=90), params={"dry_run": "true"}, headers=bearer(INTERN))
    assert dry.status_code == 403  # refused before it is planned
    assert api.post("/v1/jobs", json=job_body(priority=81), headers=bearer(ALICE)).json()["limit"] == 80  # `*`

    assert submit(api, INTERN)["priority"] == 50  # ZERO1_DEFAULT_PRIORITY
    assert submit(api, INTERN, priority=50)["priority"] == 50
    assert submit(api, ALICE, priority=80)["priority"] == 80
    assert submit(api, ROOT, priority=100)["priority"] == 100  # an admin's ceiling
    mine = api.get("/v1/jobs", params={"status": "queued"}, headers=bearer(ROOT)).json()["data"]
    assert sorted(j["priority"] for j in mine) == [50, 50, 80, 100]


@pytest.mark.parametrize("priority", [101, -1, "high", True, 50.5])
def test_a_priority_outside_0_to_100_or_not_a_whole_number_is_a_422_naming_it(api, priority):
    response = api.post("/v1/jobs", json=job_body(priority=priority), headers=bearer(ROOT))
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_request"
    assert response.json()["message"].startswith("priority: ")
    assert [d["field"] for d in response.json()["detail"]] == ["priority"]


def test_a_job_larger_than_its_owners_quota_is_a_422_naming_both_numbers(api):
    refused = api.post("/v1/jobs", json=job_body(num_gpus=4, micro_batch_size=1), headers=bearer(INTERN))
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert (body["error"], body["gpus"], body["quota"]) == ("over_quota", 4, 2)
    assert body["message"] == "the job needs at least 4 GPUs and user intern's quota is 2 (ZERO1_GPU_QUOTAS)"
    elastic = submit(api, INTERN, num_gpus=4, min_gpus=2, micro_batch_size=1, global_batch_size=4)
    assert (elastic["min_gpus"], elastic["num_gpus"]) == (2, 4)  # its fewest fit the quota: it may run at 2
    assert submit(api, ALICE, num_gpus=4, micro_batch_size=1)["num_gpus"] == 4  # alice has no quota


# --------------------------------------------------------------------------- PATCH, suspend, resume


def test_an_owner_changes_a_priority_within_the_ceiling_and_the_queue_reorders(api):
    first = submit(api, ALICE, name="first")
    second = submit(api, ALICE, name="second")
    assert (get(api, first["id"])["queue_position"], get(api, second["id"])["queue_position"]) == (1, 2)

    raised = api.patch(f"/v1/jobs/{second['id']}", json={"priority": 70}, headers=bearer(ALICE))
    assert raised.status_code == 200, raised.text
    assert (raised.json()["priority"], raised.json()["queue_position"]) == (70, 1)
    assert get(api, first["id"])["queue_position"] == 2

    above = api.patch(f"/v1/jobs/{second['id']}", json={"priority": 81}, headers=bearer(ALICE))
    assert above.status_code == 403 and above.json()["error"] == "forbidden_priority"
    assert "priority 81 is above user alice's ceiling of 80" in above.json()["message"]
    assert get(api, second["id"])["priority"] == 70  # unchanged

    others = api.patch(f"/v1/jobs/{first['id']}", json={"priority": 10}, headers=bearer(INTERN))
    assert others.status_code == 403 and others.json()["error"] == "forbidden"
    assert others.json()["message"] == (
        f"job {first['id']} belongs to alice; only alice or an admin may change the priority of it, not intern"
    )
    admin = api.patch(f"/v1/jobs/{first['id']}", json={"priority": 100}, headers=bearer(ROOT))
    assert (admin.status_code, admin.json()["priority"], admin.json()["queue_position"]) == (200, 100, 1)
    assert get(api, second["id"])["queue_position"] == 2


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"priority": 101}, "priority: Input should be less than or equal to 100"),
        ({"priority": -1}, "priority: Input should be greater than or equal to 0"),
        ({"priority": "90"}, "priority: Input should be a number, not a string"),
        ({}, "priority: give at least one of priority, tags, notes and depends_on"),
        ({"priority": 60, "name": "x"}, "name: Extra inputs are not permitted"),
    ],
)
def test_a_bad_priority_patch_is_the_projects_422(api, body, text):
    job = submit(api, ALICE)
    response = api.patch(f"/v1/jobs/{job['id']}", json=body, headers=bearer(ALICE))
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_request" and text in response.json()["message"]


def test_a_priority_patch_of_a_job_that_ended_or_never_was_is_a_409_or_404(api):
    job = submit(api, ALICE)
    assert api.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(ALICE)).status_code == 202
    ended = api.patch(f"/v1/jobs/{job['id']}", json={"priority": 60}, headers=bearer(ALICE))
    assert ended.status_code == 409 and ended.json()["error"] == "conflict"
    assert ended.json()["message"].startswith(f"job {job['id']} is cancelled: ")
    missing = api.patch("/v1/jobs/999999", json={"priority": 60}, headers=bearer(ALICE))
    assert (missing.status_code, missing.json()["message"]) == (404, "no job with id 999999")


def test_suspend_a_queued_job_resume_it_then_cancel_it_suspended(api):
    job = submit(api, ALICE, priority=60)
    behind = submit(api, ALICE)
    suspended = api.post(f"/v1/jobs/{job['id']}/suspend", headers=bearer(ALICE))
    assert suspended.status_code == 202, suspended.text
    assert (suspended.json()["status"], suspended.json()["queue_position"]) == ("suspended", None)
    assert get(api, behind["id"])["queue_position"] == 1  # a suspended job holds no place
    assert [e["id"] for e in api.get("/v1/queue", headers=bearer(ALICE)).json()["data"]] == [behind["id"]]

    resumed = api.post(f"/v1/jobs/{job['id']}/resume", headers=bearer(ALICE))
    assert resumed.status_code == 202, resumed.text
    assert (resumed.json()["status"], resumed.json()["queue_position"]) == ("queued", 1)  # its place by priority
    again = api.post(f"/v1/jobs/{job['id']}/resume", headers=bearer(ALICE))
    assert again.status_code == 409
    assert again.json()["message"] == f"job {job['id']} is queued: only a suspended job can be resumed"

    assert api.post(f"/v1/jobs/{job['id']}/suspend", headers=bearer(INTERN)).status_code == 403
    assert api.post(f"/v1/jobs/{job['id']}/suspend", headers=bearer(ROOT)).status_code == 202  # an admin may
    cancelled = api.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(ALICE))
    assert (cancelled.status_code, cancelled.json()["status"]) == (202, "cancelled")
    events = api.get(f"/v1/jobs/{job['id']}/events", headers=bearer(ALICE)).json()["data"]
    assert [(e["from_status"], e["to_status"], e["reason"]) for e in events] == [
        (None, "queued", "submitted"),
        ("queued", "suspended", "suspended by request while queued"),
        ("suspended", "queued", "resumed by request: back in the queue at priority 60"),
        ("queued", "suspended", "suspended by request while queued"),
        ("suspended", "cancelled", "cancelled by request while suspended"),
    ]
    finished = api.post(f"/v1/jobs/{job['id']}/suspend", headers=bearer(ALICE))
    assert (finished.status_code, finished.json()["error"]) == (409, "conflict")
    assert finished.json()["message"] == f"job {job['id']} is cancelled: only a queued or running job can be suspended"


def test_suspending_an_active_job_flags_it_for_the_scheduler(api):
    job = submit(api, ALICE)
    start_by_hand(api, job["id"])
    flagged = api.post(f"/v1/jobs/{job['id']}/suspend", headers=bearer(ALICE))
    assert (flagged.status_code, flagged.json()["status"]) == (202, "starting")  # it stops at a step boundary
    with api.app.state.runtime.db.session() as session:
        assert session.get(Job, job["id"]).suspend_requested is True
    assert api.post(f"/v1/jobs/{job['id']}/resume", headers=bearer(ALICE)).status_code == 409  # not yet suspended


# --------------------------------------------------------------------------- the queue


def test_the_queue_is_by_priority_then_submission_with_why_each_waits(api, monkeypatch):
    low = submit(api, ALICE, name="low", priority=20)
    first = submit(api, ALICE, name="first")
    second = submit(api, INTERN, name="second")
    top = submit(api, ROOT, name="top", priority=90)
    held = submit(api, ALICE, name="held")
    start_by_hand(api, held["id"])
    queue = api.get("/v1/queue", headers=bearer(INTERN)).json()  # anyone's: everyone sees who waits
    order = [top, first, second, low]
    assert [(e["position"], e["id"], e["priority"]) for e in queue["data"]] == [
        (i + 1, job["id"], job["priority"]) for i, job in enumerate(order)
    ]
    assert queue["count"] == 4 and all(e["reason"] == WAITING_REASON for e in queue["data"])  # no tick yet
    assert set(queue["data"][0]) == {
        "position", "id", "name", "owner", "priority", "num_gpus", "min_gpus", "created_at", "reason", "estimated_start"
    }  # fmt: skip
    assert [(o["owner"], o["gpus_in_use"], o["quota"], o["borrowed_gpus"]) for o in queue["owners"]] == [
        ("alice", 2, None, 0),
        ("intern", 0, 2, 0),
        ("root", 0, None, 0),
    ]
    assert [job["queue_position"] for job in map(lambda j: get(api, j["id"]), order)] == [1, 2, 3, 4]

    reasons = {first["id"]: f"behind job {top['id']} (priority 90)", second["id"]: "quota: intern holds 2 of 2 GPUs"}
    monkeypatch.setattr(api.app.state.runtime.scheduler, "queue_reasons", lambda: Reasons(by_job=reasons))
    page = api.get("/v1/queue", params={"limit": 2}, headers=bearer(ALICE)).json()
    assert [(e["id"], e["reason"]) for e in page["data"]] == [
        (top["id"], WAITING_REASON),
        (first["id"], f"behind job {top['id']} (priority 90)"),
    ]
    assert page["count"] == 4
    assert api.get("/v1/queue").status_code == 401  # a reader's, as GET /v1/jobs
    assert api.get("/v1/queue", params={"limit": 0}, headers=bearer(ALICE)).status_code == 422


def test_the_dashboard_lists_the_queue_and_each_owners_gpus(api, monkeypatch):
    later = submit(api, ALICE, name="later-<b>")
    sooner = submit(api, INTERN, name="sooner", priority=50)
    api.patch(f"/v1/jobs/{sooner['id']}", json={"priority": 40}, headers=bearer(INTERN))
    api.patch(f"/v1/jobs/{later['id']}", json={"priority": 30}, headers=bearer(ALICE))
    reasons = {sooner["id"]: "waiting for 2 GPUs, 0 free"}
    monkeypatch.setattr(api.app.state.runtime.scheduler, "queue_reasons", lambda: Reasons(by_job=reasons))
    page = api.get("/", headers=bearer(ALICE))
    assert page.status_code == 200
    panel = page.text[page.text.index('id="queue-panel"') : page.text.index('id="jobs-heading"')]
    assert re.findall(r'<tr data-id="(\d+)"', panel) == [str(sooner["id"]), str(later["id"])]
    assert "waiting for 2 GPUs, 0 free" in panel and WAITING_REASON.replace("'", "&#39;") in panel
    assert "later-&lt;b&gt;" in panel and "<b>" not in panel  # a name is text
    assert '<td class="num" data-label="Priority">40</td>' in panel
    assert panel.count('<td class="num c-start" data-label="Starts" title="estimated ') == 2  # nothing holds a GPU
    assert panel.count(">&lt;1 min</td>") == 2
    assert re.search(r'data-label="Owner">intern</th><td[^>]*>0</td><td[^>]*>2</td>', panel)  # 0 of quota 2
    assert '<dd data-field="queued">2</dd>' in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text


def test_each_queued_job_has_an_estimated_start_from_the_steps_left_of_the_jobs_holding_its_gpus(api):
    """GET /v1/queue's estimated_start: the policy replayed forward on the database (service/scheduling/
    estimates.py). A running job without a step time yet holds its GPUs for an unknown time: null."""
    held = submit(api, ALICE, name="held", num_gpus=4)  # all 4 GPUs, 1,000,000 steps
    waiting = submit(api, ALICE, name="next")  # 2 GPUs: once the held job ends
    behind = submit(api, ALICE, name="behind", num_gpus=4)  # behind it, once it ends (it never trained)
    start_by_hand(api, held["id"], world_size=4)
    with api.app.state.runtime.db.session() as session:
        job = session.get(Job, held["id"])
        assert transition(session, job, "running", "4 ranks placed on 1 node(s) and training")

    def starts() -> dict[int, str | None]:
        data = api.get("/v1/queue", headers=bearer(ALICE)).json()["data"]
        return {e["id"]: e["estimated_start"] for e in data}

    assert starts() == {waiting["id"]: None, behind["id"]: None}  # no row yet: no step time
    with api.app.state.runtime.db.session() as session:
        job = session.get(Job, held["id"])
        store_metrics(session, job, [replace(metric_row(9), step_time_s=0.5, world_size=4)])
    before = datetime.now(UTC)
    estimated = starts()
    after = datetime.now(UTC)
    left_s = (1_000_000 - 10) * 0.5  # its steps left x its step time
    start = datetime.fromisoformat(estimated[waiting["id"]])
    assert before + timedelta(seconds=left_s) <= start <= after + timedelta(seconds=left_s)
    assert estimated[behind["id"]] is None  # it waits on the next job's end, which nobody knows yet
    page = api.get("/", headers=bearer(ALICE)).text  # the dashboard's queue panel: in 5.8 d
    assert re.search(
        rf'<tr data-id="{waiting["id"]}">.*?data-label="Starts" title="estimated [^"]+">in 5\.8 d</td>', page
    )


def test_a_failed_estimate_leaves_the_queue_listed_with_no_estimated_start(api, monkeypatch):
    job = submit(api, ALICE, name="waits")

    def fails(session, *, limit):
        raise RuntimeError("a bug in the replay")

    monkeypatch.setattr(api.app.state.runtime.scheduler.dispatcher, "estimate_starts", fails)
    response = api.get("/v1/queue", headers=bearer(ALICE))
    assert response.status_code == 200
    assert [(e["id"], e["estimated_start"]) for e in response.json()["data"]] == [(job["id"], None)]


def test_a_jobs_page_shows_its_priority_and_a_preemption_event_marked(api):
    job = submit(api, ALICE, priority=70)
    start_by_hand(api, job["id"])
    with api.app.state.runtime.db.session() as session:
        row = session.get(Job, job["id"])
        assert transition(session, row, "running", "2 ranks placed on 1 node(s) and training")
        row.borrowed = True
        assert transition(session, row, "queued", "preempted by job 12 (priority 90): checkpoint at step 431")
    page = api.get(f"/jobs/{job['id']}", headers=bearer(ALICE)).text
    assert '<span data-field="priority">70</span>' in page
    assert re.search(r'<span class="tag" data-field="borrowed"[^>]*>borrowed</span>', page)
    assert re.search(r'<span class="tag" data-field="borrowed" hidden', page) is None
    marked = re.findall(r'<li data-kind="preemption">.*?<span class="reason">(.*?)</span>', page)
    assert marked == ["preempted by job 12 (priority 90): checkpoint at step 431"]


def test_the_queue_view_follows_the_policy_and_counts_borrowed_gpus(database, tmp_path):
    """On each backend: the order of ZERO1_QUEUE_POLICY, and each owner's GPUs as their active jobs hold them."""
    rows = [  # (owner, status, priority, num_gpus, world_size, borrowed)
        ("alice", "queued", 10, 2, None, False),
        ("bob", "queued", 90, 1, None, False),
        ("alice", "running", 50, 4, 2, False),  # an elastic job at N = 2 holds 2
        ("alice", "restarting", 50, 1, None, True),
        ("bob", "suspended", 50, 3, None, False),
        (None, "starting", 50, 1, None, False),
        ("carol", "succeeded", 50, 8, 8, False),  # ended: holds nothing, waits for nothing
    ]
    with database.session() as session:
        for owner, status, priority, num_gpus, world_size, borrowed in rows:
            session.add(
                Job(
                    name=f"{owner}-{status}",
                    status=status,
                    spec={},
                    plan={},
                    num_gpus=num_gpus,
                    steps=1,
                    owner=owner,
                    priority=priority,
                    world_size=world_size,
                    borrowed=borrowed,
                )
            )
    for policy, names in (("priority", ["bob-queued", "alice-queued"]), ("fifo", ["alice-queued", "bob-queued"])):
        settings = make_settings(tmp_path, queue_policy=policy, gpu_quotas="alice=4,*=2")
        with database.session() as session:
            view = controls.queue_view(session, reasons=Reasons(), settings=settings)
        assert [(e.position, e.name) for e in view.data] == [(1, names[0]), (2, names[1])], policy
    assert [(o.owner, o.gpus_in_use, o.borrowed_gpus, o.quota) for o in view.owners] == [
        ("alice", 3, 1, 4),
        (None, 1, 0, 2),
        ("bob", 0, 0, 2),
    ]


# --------------------------------------------------------------------------- /metrics


def _samples(client: TestClient) -> dict[tuple[str, str | None], float]:
    text = client.get("/metrics", headers=bearer(ROOT)).text
    return {
        (sample.name, sample.labels.get("owner", sample.labels.get("outcome"))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_each_owners_gpus_and_the_preemptions(api):
    held = submit(api, ALICE, num_gpus=4, min_gpus=2, micro_batch_size=1, global_batch_size=4)
    submit(api, INTERN)
    start_by_hand(api, held["id"], world_size=2)  # an elastic job holds its current N
    before = _samples(api)
    assert before["zero1_owner_gpus_in_use", "alice"] == 2
    assert before["zero1_owner_gpus_in_use", "intern"] == 0  # only waiting
    assert ("zero1_owner_gpus_in_use", "root") not in before
    assert {before["zero1_preemptions_total", o] for o in ("checkpointed", "shrunk", "killed", "suspended")} == {0}

    api.app.state.telemetry.preempted("checkpointed")
    after = _samples(api)
    assert after["zero1_preemptions_total", "checkpointed"] == 1 and after["zero1_preemptions_total", "killed"] == 0
    with pytest.raises(AssertionError, match="'evicted' is not one of"):
        api.app.state.telemetry.preempted("evicted")


# --------------------------------------------------------------------------- the CLI


def test_the_cli_submits_with_a_priority_changes_it_suspends_resumes_and_lists_the_queue(cli_as, api, tmp_path, capsys):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(job_body(name="cli-job")))
    cli_as(ALICE)
    assert main(["submit", str(spec), "--priority", "70"]) == 0, capsys.readouterr().err
    job_id = int(re.search(r"job (\d+) queued \(queue position 1\)", capsys.readouterr().out)[1])
    assert get(api, job_id)["priority"] == 70
    cli_as(INTERN)
    other = submit(api, INTERN, name="intern-job")

    assert main(["priority", str(other["id"]), "90"]) == 1
    assert capsys.readouterr().err == (
        "zero1: 403 priority 90 is above user intern's ceiling of 50 (ZERO1_PRIORITY_LIMITS)\n"
    )
    assert main(["suspend", str(job_id)]) == 1  # alice's
    assert "only alice or an admin may suspend it, not intern" in capsys.readouterr().err

    cli_as(ALICE)
    assert main(["priority", str(job_id), "80"]) == 0
    assert capsys.readouterr().out == f"job {job_id}: priority 80 (queued, queue position 1)\n"
    assert main(["queue"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["#", "id", "priority", "gpus", "owner", "name", "starts", "reason"]
    # both fit on the 4 idle GPUs: each would start at the scheduler's next tick
    reason = WAITING_REASON.split()
    assert lines[1].split() == ["1", str(job_id), "80", "2", "alice", "cli-job", "<1", "min", *reason]
    assert lines[2].split() == ["2", str(other["id"]), "50", "2", "intern", "intern-job", "<1", "min", *reason]
    assert [line.split() for line in lines[3:]] == [
        [],
        ["owner", "gpus", "in", "use", "quota"],
        ["alice", "0", "none"],
        ["intern", "0", "2"],
    ]

    assert main(["suspend", str(job_id)]) == 0
    assert capsys.readouterr().out == f"job {job_id}: suspended\n"
    assert get(api, job_id)["status"] == "suspended"
    assert main(["resume", str(job_id)]) == 0
    assert capsys.readouterr().out == f"job {job_id}: queued (queue position 1, priority 80)\n"
    assert main(["resume", str(job_id)]) == 1
    assert capsys.readouterr().err == f"zero1: 409 job {job_id} is queued: only a suspended job can be resumed\n"
