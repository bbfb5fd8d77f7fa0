"""GPU usage: GPU-seconds held (each job's N from its events) and spent training (its stored rows' step
times x N) by owner and priority class over a period. The definitions on events and rows written at known
times (SQLite and PostgreSQL); GET /v1/usage, zero1_gpu_seconds_*_total on /metrics, `zero1 usage` and the
/usage page (in Chromium too) on one app on stand-ins for Ray, whose scheduler ticks only when a test says,
and whose jobs get their rows and their end from the test. tests/test_usage_ray.py trains real jobs.

Packages: service.scheduling, service.api, service.dashboard, service.cli, service.client, service.experiments.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from fakes import FakeClock, tick
from fastapi.testclient import TestClient
from playwright.sync_api import expect, sync_playwright
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from service.auth import ANONYMOUS, PUBLIC, TOKEN_COOKIE, Principal
from service.cli import main as cli_main
from service.errors import ServiceError
from service.experiments import sweeps
from service.scheduling import usage
from service.scheduling.gauges import UsageCounters
from service.store.tables import Job, JobEvent, Metric
from workers.records import AttemptPoll, AttemptStatus, MetricRow

import helpers
from conftest import make_settings, serve_on_fakes
from helpers import bearer
from marks import starts

ALICE = "alice-token-of-the-usage-tests-0123456789"
BOB = "bob-token-of-the-usage-tests-0123456789"
ROOT = "root-token-of-the-usage-tests-0123456789"
T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
"""The hand-written jobs' clock: minutes after T0."""


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


# --------------------------------------------------------------------------- the spans


def test_a_job_holds_each_events_gpus_until_its_next_event_and_its_last_up_to_now():
    events = [
        (1, "queued", at(0), 0),
        (2, "queued", at(0), None),  # stored before the column: active ones hold the job's N
        (1, "starting", at(10), 4),
        (2, "starting", at(10), None),
        (1, "running", at(11), 4),
        (1, "restarting", at(30), 2),  # resized 4 -> 2
        (2, "running", at(30), None),
        (1, "running", at(31), 2),
        (2, "succeeded", at(40), None),
        (1, "queued", at(50), 0),  # preempted: holds nothing
        (1, "starting", at(55), 2),
    ]
    spans = usage.held_spans(events, fallback={1: 4, 2: 3}, now=at(60))
    assert sorted(spans) == [
        (1, at(10), at(11), 4),
        (1, at(11), at(30), 4),
        (1, at(30), at(31), 2),
        (1, at(31), at(50), 2),
        (1, at(55), at(60), 2),  # still starting: up to now
        (2, at(10), at(30), 3),
        (2, at(30), at(40), 3),
    ]


# --------------------------------------------------------------------------- a period, on the database


def _job(session, *, owner, priority, num_gpus, events, started, finished=None, world_size=None) -> Job:
    job = Job(
        name=f"{owner}-{priority}", status=events[-1][0], spec={}, plan={}, num_gpus=num_gpus, steps=100,
        owner=owner, priority=priority, started_at=started, finished_at=finished, world_size=world_size,
    )  # fmt: skip
    session.add(job)
    session.flush()
    previous = None
    for to_status, when, gpus in events:
        session.add(JobEvent(job_id=job.id, at=when, from_status=previous, to_status=to_status, reason="", gpus=gpus))
        previous = to_status
    return job


def _rows(session, job: Job, *, stored: list[tuple[datetime | None, float, int | None]]) -> None:
    """Rows of `job`, one per (stored_at, step_time_s, world_size)."""
    for step, (when, step_time_s, world_size) in enumerate(stored):
        session.add(
            Metric(
                job_id=job.id, attempt=0, step=step, loss=1.0, grad_norm=1.0, loss_scale=1.0, skipped=False,
                step_time_s=step_time_s, tokens_per_s=1.0, mem_peak_bytes=[1], mem_planned_bytes=1,
                eval_loss=None, world_size=world_size, checkpoint_blocked_s=None, lr=None, superseded=step == 0,
                stored_at=when,
            )
        )  # fmt: skip


@pytest.fixture
def ledger(database) -> dict[str, int]:
    """Five jobs at known times (minutes after T0), now = 120:
    - alice, priority 70, 2 GPUs, 0-60; rows stored at 20 (superseded, still counted), 50 and 100 (as a row
      recovered from a checkpoint is, later).
    - alice, priority 30, 1 GPU, 90- still running.
    - bob, priority 50, elastic: 4 GPUs 30-60, resized to 2 at 60, 2 GPUs to 100, preempted (queued) then.
    - carol, priority 50, 3 GPUs 0-10: ended before any period below.
    - old, priority 50: events and rows stored before migration 0024 (gpus and stored_at null), 2 GPUs 40-80.
    """
    with database.session() as session:
        jobs = {
            "alice-70": _job(
                session, owner="alice", priority=70, num_gpus=2, started=at(0), finished=at(60),
                events=[("queued", at(0), 0), ("starting", at(0), 2), ("running", at(1), 2), ("succeeded", at(60), 0)],
            ),
            "alice-30": _job(
                session, owner="alice", priority=30, num_gpus=1, started=at(90),
                events=[("queued", at(85), 0), ("starting", at(90), 1), ("running", at(91), 1)],
            ),
            "bob": _job(
                session, owner="bob", priority=50, num_gpus=4, world_size=2, started=at(30),
                events=[
                    ("queued", at(25), 0), ("starting", at(30), 4), ("running", at(31), 4),
                    ("restarting", at(60), 2), ("running", at(62), 2), ("queued", at(100), 0),
                ],
            ),
            "carol": _job(
                session, owner="carol", priority=50, num_gpus=3, started=at(0), finished=at(10),
                events=[("queued", at(0), 0), ("starting", at(0), 3), ("succeeded", at(10), 0)],
            ),
            "old": _job(
                session, owner="old", priority=50, num_gpus=2, started=at(40), finished=at(80),
                events=[("queued", at(35), None), ("starting", at(40), None), ("succeeded", at(80), None)],
            ),
        }  # fmt: skip
        _rows(session, jobs["alice-70"], stored=[(at(20), 1.5, 2), (at(50), 2.0, 2), (at(100), 4.0, 2)])
        _rows(session, jobs["bob"], stored=[(at(45), 1.0, 4), (at(75), 1.0, 2)])
        _rows(session, jobs["old"], stored=[(None, 3.0, None)])  # counted at its job's start, 40, on num_gpus
        return {name: job.id for name, job in jobs.items()}


def _minutes(gpu_minutes: float) -> float:
    return gpu_minutes * 60


def test_usage_by_job_clips_each_span_to_the_period_and_counts_rows_stored_in_it(database, ledger):
    with database.session() as session:
        found = usage.usage_by_job(session, since=at(20), until=at(95), now=at(120))
    assert set(found) == {ledger[name] for name in ("alice-70", "alice-30", "bob", "old")}  # not carol
    assert found[ledger["alice-70"]].held == pytest.approx(_minutes(2 * 40))  # 20-60
    assert found[ledger["alice-70"]].training == pytest.approx(1.5 * 2 + 2.0 * 2)  # stored at 20 and 50; not 100
    assert found[ledger["alice-30"]].held == pytest.approx(_minutes(1 * 5))  # 90-95 of its running span
    assert found[ledger["alice-30"]].training == 0
    assert found[ledger["bob"]].held == pytest.approx(_minutes(4 * 30 + 2 * 35))  # 30-60 at 4, 60-95 at 2
    assert found[ledger["bob"]].training == pytest.approx(1.0 * 4 + 1.0 * 2)
    assert found[ledger["old"]].held == pytest.approx(_minutes(2 * 40))  # its num_gpus, 40-80
    assert found[ledger["old"]].training == pytest.approx(3.0 * 2)
    assert (found[ledger["bob"]].owner, found[ledger["bob"]].priority) == ("bob", 50)


def test_the_report_is_by_owner_and_priority_class_and_the_caller_sees_their_own(database, ledger, tmp_path):
    settings = make_settings(tmp_path, database_url=database.url, gpu_quotas={"alice": 2, "dave": 1, "*": 8})
    with database.session() as session:
        everyone = usage.report(
            session, principal=ANONYMOUS, settings=settings, since=at(0), until=at(120), now=at(120)
        )
        alice = usage.report(
            session, principal=Principal(user="alice"), settings=settings, since=at(0), until=at(120), now=at(120)
        )
        public = usage.report(session, principal=PUBLIC, settings=settings, since=at(0), until=at(120), now=at(120))
    rows = {(row.owner, row.priority_class): row for row in everyone.data}
    assert list(rows) == [("alice", 70), ("alice", 30), ("bob", 50), ("carol", 50), ("old", 50)]
    assert rows[("alice", 70)].gpu_seconds_held == pytest.approx(_minutes(2 * 60))
    assert rows[("alice", 30)].gpu_seconds_held == pytest.approx(_minutes(1 * 30))  # 90 to now
    assert rows[("bob", 50)].gpu_seconds_held == pytest.approx(_minutes(4 * 30 + 2 * 40))
    assert rows[("carol", 50)].gpu_seconds_held == pytest.approx(_minutes(3 * 10))
    assert rows[("alice", 70)].gpu_seconds_training == pytest.approx(3.0 + 4.0 + 8.0)
    assert all(row.jobs == 1 for row in everyone.data)
    assert everyone.gpu_seconds_held == pytest.approx(sum(row.gpu_seconds_held for row in everyone.data))
    assert everyone.seconds == 120 * 60

    assert [(row.owner, row.priority_class) for row in alice.data] == [("alice", 70), ("alice", 30)]
    assert [q.owner for q in alice.quotas] == ["alice"]
    (quota,) = alice.quotas
    assert (quota.quota, quota.gpus_in_use) == (2, 1)  # alice-30 runs
    assert quota.gpu_seconds_held == pytest.approx(_minutes(2 * 60 + 30))
    assert quota.quota_gpu_seconds == pytest.approx(2 * 120 * 60)
    assert quota.quota_used == pytest.approx(_minutes(150) / (2 * 120 * 60), abs=1e-4)
    assert public.data == [] and public.quotas == []

    quotas = {q.owner: q for q in everyone.quotas}
    assert list(quotas) == ["alice", "bob", "carol", "dave", "old"]  # dave: named by the quotas, idle
    assert (quotas["dave"].gpu_seconds_held, quotas["dave"].quota) == (0, 1)
    assert quotas["bob"].quota == 8 and quotas["bob"].gpus_in_use == 0  # bob's job is queued again


def test_a_sweeps_gpu_seconds_are_its_jobs_held_seconds(database, ledger):
    with database.session() as session:
        jobs = [session.get(Job, ledger[name]) for name in ("bob", "carol")]
        held = usage.held_gpu_seconds(session, jobs, now=at(120))
        assert held == pytest.approx(_minutes(4 * 30 + 2 * 40 + 3 * 10))
        assert usage.held_gpu_seconds(session, []) == 0


def test_a_period_defaults_to_this_month_until_now_and_a_bad_one_names_its_parameter():
    now = datetime(2026, 12, 8, 1, 2, 3, tzinfo=UTC)
    assert usage.period(None, None, now=now) == (datetime(2026, 12, 1, tzinfo=UTC), now)
    naive = datetime(2026, 12, 2, 5)
    assert usage.period(naive, None, now=now)[0] == naive.replace(tzinfo=UTC)
    plus_one = datetime(2026, 12, 2, 6, tzinfo=UTC).astimezone(timezone(timedelta(hours=1)))
    assert usage.period(plus_one, None, now=now)[0] == datetime(2026, 12, 2, 6, tzinfo=UTC)
    for since, until, field in [
        (datetime(2027, 1, 1, tzinfo=UTC), None, "since"),  # after now, with until defaulted
        (None, datetime(2026, 11, 1, tzinfo=UTC), "until"),  # before this month's start
        (datetime(2026, 12, 3, tzinfo=UTC), datetime(2026, 12, 3, tzinfo=UTC), "until"),  # empty
        (datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1))), None, "since"),  # before year 1 in UTC
    ]:
        with pytest.raises(ServiceError) as raised:
            usage.period(since, until, now=now)
        assert raised.value.status_code == 422 and raised.value.extra["detail"][0]["field"] == field
        assert raised.value.message.startswith(f"{field}: ")


def test_the_held_counter_adds_each_scrapes_window_and_never_falls(database, ledger):
    """UsageCounters on a clock the test moves: each scrape adds the seconds held since the last, so the total
    over windows is the usage over their union, whatever a job's priority became meanwhile."""
    clock = iter([at(20), at(50), at(50), at(95), at(120)])
    counters = UsageCounters(database, clock=lambda: next(clock))

    def scrape() -> dict[tuple[str, str], float]:
        (family,) = list(counters.collect())
        return {(s.labels["owner"], s.labels["priority_class"]): s.value for s in family.samples}

    first = scrape()  # 20-50
    assert first[("alice", "70")] == pytest.approx(_minutes(2 * 30))
    assert first[("bob", "50")] == pytest.approx(_minutes(4 * 20))
    assert scrape() == first  # 50-50: an empty window adds nothing
    with database.session() as session:
        session.execute(update(Job).where(Job.id == ledger["bob"]).values(priority=90))
    third = scrape()  # 50-95
    assert third[("bob", "50")] == first[("bob", "50")]  # what was counted under 50 stays
    assert third[("bob", "90")] == pytest.approx(_minutes(4 * 10 + 2 * 35))
    assert all(third[key] >= value for key, value in first.items())
    fourth = scrape()  # 95-120: alice-30 on, bob queued since 100
    assert fourth[("alice", "30")] == pytest.approx(_minutes(1 * 30))
    with database.session() as session:
        whole = usage.usage_by_job(session, since=at(20), until=at(120), now=at(120))
    assert sum(fourth.values()) == pytest.approx(sum(job.held for job in whole.values()))


# --------------------------------------------------------------------------- the API, on stand-ins for Ray


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[TestClient]:
    """The app on 4 logical GPUs, ticked by the tests, with quotas; alice's token by default, bob's and root's."""
    tokens = f"alice:{ALICE},bob:{BOB},root:{ROOT}:admin"
    settings = make_settings(tmp_path_factory.mktemp("usage"), api_tokens=tokens, gpu_quotas={"alice": 4, "*": 3})
    with serve_on_fakes(settings) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.launcher.clock = FakeClock()
        client.headers["Authorization"] = f"Bearer {ALICE}"
        yield client


def row(step: int, *, world_size: int, blocked: float | None = None) -> MetricRow:
    return MetricRow(
        step=step, loss=1.0, grad_norm=1.0, loss_scale=1.0, skipped=False, step_time_s=0.25 + step / 100,
        tokens_per_s=1.0, mem_peak_bytes=(1,) * world_size, mem_planned_bytes=1, world_size=world_size,
        checkpoint_blocked_s=blocked,
    )  # fmt: skip


def submit(api: TestClient, token: str, **overrides) -> dict:
    response = api.post("/v1/jobs", json=helpers.job_body(**overrides), headers=bearer(token))
    assert response.status_code == 201, response.text
    return response.json()


def end(api: TestClient, job_id: int, *, rows: list[MetricRow], status=AttemptStatus.SUCCEEDED) -> None:
    """The job's attempt ends `status`, its last poll bringing `rows`, ticked into the database."""
    runtime = api.app.state.runtime
    with runtime.db.session() as session:
        attempt = session.get(Job, job_id).attempt
    poll = AttemptPoll(status=status, nodes=("node-0",), metrics=tuple(rows))
    runtime.launcher.attempts[(job_id, attempt)].ended = poll
    tick(api, 2)


def from_events(api: TestClient, job_id: int) -> float:
    """GPU-seconds held as the job's events say: each event's gpus until the next (GET /v1/jobs/{id}/events)."""
    events = api.get(f"/v1/jobs/{job_id}/events", headers=bearer(ROOT)).json()["data"]
    held = 0.0
    for event, after in zip(events, events[1:], strict=False):
        start, stop = (datetime.fromisoformat(e["at"].replace("Z", "+00:00")) for e in (event, after))
        held += event["gpus"] * (stop - start).total_seconds()
    return held


def from_rows(api: TestClient, job_id: int) -> float:
    rows = api.get(f"/v1/jobs/{job_id}/metrics", headers=bearer(ROOT)).json()["data"]
    return sum(r["step_time_s"] * r["world_size"] for r in rows)


def samples(api: TestClient, name: str) -> dict[tuple[str, str], float]:
    text = api.get("/metrics", headers=bearer(ROOT)).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[(sample.labels["owner"], sample.labels["priority_class"])] = sample.value
    return found


@pytest.fixture(scope="module")
def ran(api) -> dict[str, int]:
    """alice's elastic job (2-4 GPUs, priority 50) resized 4 -> 2 by a failure while bob's 2-GPU job waited
    (then started beside it); alice's 1-GPU job at priority 30 queued behind them; all ended."""
    elastic = submit(api, ALICE, name="elastic", num_gpus=4, min_gpus=2, max_retries=1)
    tick(api, 3)
    waiting = submit(api, BOB, name="bobs", num_gpus=2, priority=50)
    small = submit(api, ALICE, name="small", num_gpus=1, priority=30)
    api.app.state.runtime.launcher.fail(elastic["id"], 0)
    tick(api, 3)  # the retry leaves the queue's head its 2 GPUs: bob's starts beside it
    assert [e["gpus"] for e in api.get(f"/v1/jobs/{elastic['id']}/events").json()["data"]] == [0, 4, 4, 2, 2]
    end(api, elastic["id"], rows=[row(s, world_size=2, blocked=0.5 if s == 3 else None) for s in range(4)])
    end(api, waiting["id"], rows=[row(s, world_size=2) for s in range(3)])
    tick(api, 2)
    end(api, small["id"], rows=[row(s, world_size=1) for s in range(5)])
    for job_id in (elastic["id"], waiting["id"], small["id"]):
        assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    return {"elastic": elastic["id"], "bobs": waiting["id"], "small": small["id"]}


def test_usage_sums_equal_the_gpu_seconds_of_the_jobs_events_and_rows(api, ran):
    shown = api.get("/v1/usage", headers=bearer(ROOT))
    assert shown.status_code == 200, shown.text
    body = shown.json()
    rows = {(r["owner"], r["priority_class"]): r for r in body["data"]}
    assert list(rows) == [("alice", 50), ("alice", 30), ("bob", 50)]
    for key, job in [(("alice", 50), "elastic"), (("alice", 30), "small"), (("bob", 50), "bobs")]:
        held = from_events(api, ran[job])
        assert held > 0
        assert rows[key]["gpu_seconds_held"] == pytest.approx(held, rel=0.01, abs=1e-3), key
        assert rows[key]["gpu_seconds_training"] == pytest.approx(from_rows(api, ran[job]), rel=0.01), key
        assert rows[key]["jobs"] == 1
    assert rows[("alice", 50)]["gpu_seconds_training"] == pytest.approx(2 * (0.25 + 0.26 + 0.27 + 0.28))
    assert body["gpu_seconds_held"] == pytest.approx(sum(r["gpu_seconds_held"] for r in body["data"]))
    now = datetime.now(UTC)
    since = datetime.fromisoformat(body["since"].replace("Z", "+00:00"))
    assert since == now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    quotas = {q["owner"]: q for q in body["quotas"]}
    assert quotas["alice"]["quota"] == 4 and quotas["bob"]["quota"] == 3
    assert quotas["alice"]["gpu_seconds_held"] == pytest.approx(
        rows[("alice", 50)]["gpu_seconds_held"] + rows[("alice", 30)]["gpu_seconds_held"], abs=2e-3
    )


def test_a_user_sees_their_own_usage_and_a_bad_period_is_a_422_naming_its_parameter(api, ran):
    alice = api.get("/v1/usage").json()
    assert {r["owner"] for r in alice["data"]} == {"alice"} and [q["owner"] for q in alice["quotas"]] == ["alice"]
    bob = api.get("/v1/usage", headers=bearer(BOB)).json()
    assert [(r["owner"], r["priority_class"]) for r in bob["data"]] == [("bob", 50)]
    before = api.get("/v1/usage", params={"since": "2020-01-01", "until": "2020-02-01T00:00:00Z"}).json()
    assert before["data"] == [] and before["seconds"] == 31 * 86_400
    for params, field in [
        ({"since": "yesterday"}, "since"),
        ({"since": "1700000000"}, "since"),  # seconds since 1970, which pydantic's lax mode would read
        ({"until": "2026-13-01"}, "until"),
        ({"since": "2026-12-01T00:00:00Z", "until": "2026-11-30"}, "until"),
        ({"since": "9999-12-31T23:00:00-05:00"}, "since"),
    ]:
        answer = api.get("/v1/usage", params=params)
        assert answer.status_code == 422, (params, answer.text)
        assert answer.json()["error"] == "invalid_request" and answer.json()["detail"][0]["field"] == field
        assert answer.json()["message"].startswith(f"{field}: ")
    assert api.get("/v1/usage", headers={"Authorization": "Bearer " + "x" * 40}).status_code == 401


def test_the_counters_on_metrics_count_what_was_held_and_trained(api, ran):
    training = samples(api, "zero1_gpu_seconds_training_total")
    held = samples(api, "zero1_gpu_seconds_held_total")
    body = api.get("/v1/usage", headers=bearer(ROOT)).json()
    for r in body["data"]:
        key = (r["owner"], str(r["priority_class"]))
        assert training[key] == pytest.approx(r["gpu_seconds_training"], rel=1e-6)  # every row came by a poll
        assert held[key] == pytest.approx(r["gpu_seconds_held"], abs=1e-3)  # from the app's start: all of it
    assert samples(api, "zero1_gpu_seconds_held_total") == held  # nothing held since: nothing added


def test_a_sweeps_gpu_seconds_are_what_usage_counts_for_its_trials(api, ran):
    with api.app.state.runtime.db.session() as session:
        jobs = [session.get(Job, ran[name]) for name in ("elastic", "small")]
        held = sweeps.usage.held_gpu_seconds(session, jobs)
    rows = {(r["owner"], r["priority_class"]): r for r in api.get("/v1/usage").json()["data"]}
    shown = rows[("alice", 50)]["gpu_seconds_held"] + rows[("alice", 30)]["gpu_seconds_held"]
    assert held == pytest.approx(shown, abs=2e-3)  # the API rounds to the millisecond


def test_zero1_usage_prints_each_owner_and_class_and_the_quotas(api, ran, cli_as, capsys):
    cli_as(ROOT)
    assert cli_main(["usage"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("from ") and "GPU-hours held" in lines[0]
    assert [line.split()[:3] for line in lines[3:6]] == [["alice", "50", "1"], ["alice", "30", "1"], ["bob", "50", "1"]]
    assert any(line.split()[:1] == ["alice"] and line.split()[2] == "4" for line in lines[7:])
    assert cli_main(["usage", "--since", "2020-01-01", "--until", "2020-01-02", "--json"]) == 0
    assert '"data": []' in capsys.readouterr().out
    assert cli_main(["usage", "--since", "tomorrow-ish"]) == 1
    assert "422 since: " in capsys.readouterr().err


# --------------------------------------------------------------------------- the page


def test_the_usage_page_lists_the_readers_usage_and_says_what_is_wrong_with_a_period(api, ran):
    page = api.get("/usage")
    assert page.status_code == 200, page.text
    assert 'data-owner="alice" data-priority-class="50"' in page.text and 'data-owner="bob"' not in page.text
    admin = api.get("/usage", headers=bearer(ROOT)).text
    assert 'data-owner="bob" data-priority-class="50"' in admin
    wrong = api.get("/usage", params={"since": "2026-12-01T00:00", "until": "last week"})
    assert wrong.status_code == 422 and "until: " in wrong.text and 'id="usage"' not in wrong.text
    empty = api.get("/usage", params={"since": "2020-01-01T00:00", "until": "2020-01-02T00:00"}).text
    assert '<p class="empty" id="usage-empty">' in empty


@pytest.fixture(scope="module")
def served(api) -> Iterator[str]:
    """The module's app over real HTTP on loopback (its runtime is the test client's: lifespan off)."""
    import uvicorn

    config = uvicorn.Config(api.app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)


CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
@starts("browser")
def browser():
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    expect.set_options(timeout=60_000)
    with sync_playwright() as playwright:
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=args)
        try:
            yield chromium
        finally:
            chromium.close()


def test_in_chromium_the_usage_page_tables_each_owner_and_class_and_a_period_is_picked(
    browser, served, api, ran, tmp_path_factory
):
    context = browser.new_context(base_url=served, viewport={"width": 1280, "height": 900})
    context.add_cookies([{"name": TOKEN_COOKIE, "value": ROOT, "url": served}])
    elsewhere, errors = [], []
    context.route(
        "**/*", lambda route: route.continue_() if route.request.url.startswith(served + "/") else (
            elsewhere.append(route.request.url), route.abort())
    )  # fmt: skip
    try:
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto("/")
        page.get_by_role("link", name="Usage", exact=True).click()
        expect(page).to_have_url(f"{served}/usage")
        expect(page.get_by_role("link", name="Usage", exact=True)).to_have_attribute("aria-current", "page")
        body = api.get("/v1/usage", headers=bearer(ROOT)).json()
        table = page.locator("#usage tbody tr")
        expect(table).to_have_count(len(body["data"]))
        for index, r in enumerate(body["data"]):
            cells = table.nth(index)
            expect(cells.locator("th")).to_have_text(r["owner"])
            expect(cells.locator("td").nth(0)).to_have_text(str(r["priority_class"]))
            assert float(cells.get_attribute("data-held")) == pytest.approx(r["gpu_seconds_held"])
            expect(cells.locator("td").nth(2)).to_have_text(f"{r['gpu_seconds_held'] / 3600:,.2f}")
        expect(page.locator('#quotas tr[data-owner="alice"] td').nth(2)).to_have_text("4")
        expect(page.locator("#usage-error")).to_be_hidden()

        page.fill("#since", "2020-01-01T00:00")
        page.fill("#until", "2020-01-02T00:00")
        page.get_by_role("button", name="Show").click()
        expect(page).to_have_url(f"{served}/usage?since=2020-01-01T00%3A00&until=2020-01-02T00%3A00")
        expect(page.locator("#usage-empty")).to_be_visible()
        expect(page.locator("#usage")).to_be_hidden()
        expect(page.locator("#total-held")).to_have_text("0.00")

        page.get_by_role("link", name="This month").click()
        expect(table).to_have_count(len(body["data"]))
        page.fill("#until", "2020-01-02T00:00")
        page.get_by_role("button", name="Show").click()
        expect(page.locator("#usage-error")).to_contain_text("until: must be after since")

        page.set_viewport_size({"width": 375, "height": 800})  # a phone: the tables scroll, the page does not
        page.goto("/usage")
        assert page.evaluate("document.documentElement.scrollWidth") <= 375
        page.screenshot(path=str(_shots(tmp_path_factory) / "usage.png"), full_page=True)
    finally:
        context.close()
    failed = [e for e in errors if "status of 422" not in e]  # the bad period's page is a 422, which Chromium logs
    assert elsewhere == [] and failed == [] and len(errors) == 1, (elsewhere, errors)


def _shots(tmp_path_factory) -> Path:
    """Where the screenshot goes: $ZERO1_ARTIFACTS/dashboard, else pytest's tmp dir."""
    given = os.environ.get("ZERO1_ARTIFACTS")
    if not given:
        return tmp_path_factory.mktemp("usage-artifacts")
    shots = Path(given) / "dashboard"
    shots.mkdir(parents=True, exist_ok=True)
    return shots
