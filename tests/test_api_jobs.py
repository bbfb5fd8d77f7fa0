"""The jobs API end to end: admission, the scheduler, Ray dispatch and metrics in the database.

Packages: service.api, service.scheduling, service.store.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime

import fsspec
import pytest
import ray
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from service.api.job_responses import thinned_steps
from service.main import create_app
from service.scheduling.job_states import running_reason, stage_change
from service.store.tables import Job

import helpers
from conftest import make_settings, serve, serve_on_fakes
from helpers import FAST, TERMINAL, TINY, wait_job


def job_body(**overrides) -> dict:
    return helpers.job_body(**{"steps": 40, "micro_batch_size": 4, **overrides})


@pytest.fixture
def app_client(ray_cluster, database_url, tmp_path):
    """A fresh app per test on each database backend."""
    with serve(make_settings(tmp_path, database_url=database_url)) as client:
        yield client


@pytest.fixture
def sqlite_client(ray_cluster, tmp_path):
    with serve(make_settings(tmp_path)) as client:
        yield client


@pytest.fixture
def fakes_client(tmp_path):
    """The app on stand-ins for Ray (conftest's serve_on_fakes): what is refused, stored, queued and listed."""
    with serve_on_fakes(make_settings(tmp_path)) as client:
        yield client


@pytest.fixture
def fakes_app_client(database_url, tmp_path):
    """The app on stand-ins for Ray on each database backend."""
    with serve_on_fakes(make_settings(tmp_path, database_url=database_url)) as client:
        yield client


def submit(client, body: dict, **kwargs) -> dict:
    response = client.post("/v1/jobs", json=body, **kwargs)
    assert response.status_code == 201, response.text
    return response.json()


def finished(job: dict) -> bool:
    return job["status"] in TERMINAL


def test_a_job_runs_to_success_with_every_metric_stored(app_client):
    job = submit(app_client, job_body())
    assert job["status"] == "queued" and job["queue_position"] == 1 and job["step"] is None
    assert job["plan"]["num_gpus"] == 2 and job["plan"]["fits"] is True
    job = wait_job(app_client, job["id"], finished)
    assert job["status"] == "succeeded", job["error"]
    assert job["step"] == 39 and job["latest"]["step"] == 39 and job["finished_at"] is not None

    metrics = app_client.get(f"/v1/jobs/{job['id']}/metrics").json()
    assert [m["step"] for m in metrics["data"]] == list(range(40)) and metrics["next_after_step"] is None
    assert all(len(m["mem_peak_bytes"]) == 2 and m["attempt"] == 0 for m in metrics["data"])
    assert metrics["data"][-1]["loss"] < metrics["data"][0]["loss"]

    page = app_client.get(f"/v1/jobs/{job['id']}/metrics", params={"after_step": 9, "limit": 10}).json()
    assert [m["step"] for m in page["data"]] == list(range(10, 20)) and page["next_after_step"] == 19
    thin = app_client.get(f"/v1/jobs/{job['id']}/metrics", params={"max_points": 5}).json()["data"]
    assert [m["step"] for m in thin] == [0, 10, 20, 30, 39]  # at most max_points, the last included

    events = app_client.get(f"/v1/jobs/{job['id']}/events").json()["data"]
    assert [(e["from_status"], e["to_status"]) for e in events] == [
        (None, "queued"),
        ("queued", "starting"),
        ("starting", "running"),
        ("running", "succeeded"),
    ]
    times = [datetime.fromisoformat(e["at"]) for e in events]
    assert times == sorted(times)

    prometheus = {
        (sample.name, sample.labels.get("status") or sample.labels.get("outcome")): sample.value
        for family in text_string_to_metric_families(app_client.get("/metrics").text)
        for sample in family.samples
    }
    assert prometheus["zero1_jobs", "succeeded"] == 1 and prometheus["zero1_gpus_in_use", None] == 0
    # the scheduler's own: the job's run and wait, the rows and lines it stored (rank 0 logs a line a step)
    assert prometheus["zero1_job_duration_seconds_count", "succeeded"] == 1
    assert prometheus["zero1_queue_wait_seconds_count", None] == 1
    assert prometheus["zero1_scheduler_tick_duration_seconds_count", None] > 0
    assert prometheus["zero1_metric_rows_ingested_total", None] == 40
    assert prometheus["zero1_log_lines_ingested_total", None] >= 40


def _held(events_by_job: dict[int, list[dict]]) -> list[tuple[datetime, int, int]]:
    """(time, +gpus or -gpus, job) for every start and end, from the events."""
    changes = []
    for job_id, (gpus, events) in events_by_job.items():
        for event in events:
            at = datetime.fromisoformat(event["at"])
            if event["to_status"] == "starting":
                changes.append((at, gpus, job_id))
            elif event["to_status"] in TERMINAL and event["from_status"] != "queued":
                changes.append((at, -gpus, job_id))
    return sorted(changes, key=lambda c: (c[0], c[1]))


def test_gang_scheduling_never_holds_more_gpus_than_exist(sqlite_client):
    # the first two cannot end on their own: the third's wait is for their GPUs, not a race with them
    jobs = [submit(sqlite_client, job_body(name=f"gang-{i}", steps=1_000_000)) for i in range(2)]
    jobs.append(submit(sqlite_client, job_body(name="gang-2", steps=5)))
    first_two = [wait_job(sqlite_client, j["id"], lambda j: j["step"] is not None) for j in jobs[:2]]
    assert {j["status"] for j in first_two} == {"running"}
    third = sqlite_client.get(f"/v1/jobs/{jobs[2]['id']}").json()
    assert (third["status"], third["queue_position"]) == ("queued", 1)  # its 2 GPUs are held by the others
    assert sqlite_client.post(f"/v1/jobs/{jobs[0]['id']}/cancel").status_code == 202
    assert wait_job(sqlite_client, jobs[2]["id"], finished)["status"] == "succeeded"
    assert sqlite_client.get(f"/v1/jobs/{jobs[1]['id']}").json()["status"] == "running"  # beside it all along
    assert sqlite_client.post(f"/v1/jobs/{jobs[1]['id']}/cancel").status_code == 202
    assert [wait_job(sqlite_client, j["id"], finished)["status"] for j in jobs[:2]] == ["cancelled"] * 2

    events = {j["id"]: (2, sqlite_client.get(f"/v1/jobs/{j['id']}/events").json()["data"]) for j in jobs}
    held = 0
    peak = 0
    for _, change, _ in _held(events):
        held += change
        peak = max(peak, held)
    assert peak == 4  # two jobs ran side by side, never three
    third_start = next(e["at"] for e in events[jobs[2]["id"]][1] if e["to_status"] == "starting")
    first_end = min(e["at"] for j in jobs[:2] for e in events[j["id"]][1] if e["to_status"] in TERMINAL)
    assert datetime.fromisoformat(third_start) >= datetime.fromisoformat(first_end)


def test_idempotency_key(fakes_app_client):
    first = fakes_app_client.post("/v1/jobs", json=job_body(steps=5), headers={"Idempotency-Key": "abc"})
    again = fakes_app_client.post("/v1/jobs", json=job_body(steps=5), headers={"Idempotency-Key": "abc"})
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = fakes_app_client.post("/v1/jobs", json=job_body(steps=6), headers={"Idempotency-Key": "abc"})
    assert other.status_code == 409 and other.json()["error"] == "idempotency_conflict"
    assert f"job {first.json()['id']}" in other.json()["message"]
    assert len(fakes_app_client.get("/v1/jobs").json()["data"]) == 1


def test_cancel_a_running_job_frees_its_gpus(sqlite_client):
    job = submit(sqlite_client, job_body(steps=1_000_000))
    wait_job(sqlite_client, job["id"], lambda j: j["step"] is not None)
    response = sqlite_client.post(f"/v1/jobs/{job['id']}/cancel")
    assert response.status_code == 202
    job = wait_job(sqlite_client, job["id"], finished, timeout_s=30)
    assert job["status"] == "cancelled"
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < 4:
        assert time.monotonic() < deadline, "the cancelled job's GPUs were not freed"
        time.sleep(0.05)
    assert sqlite_client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 409


def test_cancel_a_queued_job_and_list_by_status(fakes_client):
    blocker = submit(fakes_client, job_body(name="blocker", num_gpus=4, steps=1_000_000))
    queued = submit(fakes_client, job_body(name="waiting"))
    assert wait_job(fakes_client, blocker["id"], lambda j: j["status"] == "running")
    assert fakes_client.get(f"/v1/jobs/{queued['id']}").json()["queue_position"] == 1
    cancelled = fakes_client.post(f"/v1/jobs/{queued['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    running = fakes_client.get("/v1/jobs", params={"status": "running"}).json()["data"]
    assert [j["id"] for j in running] == [blocker["id"]]
    fakes_client.post(f"/v1/jobs/{blocker['id']}/cancel")
    assert wait_job(fakes_client, blocker["id"], finished)["status"] == "cancelled"


def test_list_pages_with_a_cursor(fakes_client):
    ids = [
        submit(fakes_client, job_body(name=f"p{i}", num_gpus=4, steps=1, micro_batch_size=1))["id"] for i in range(5)
    ]
    first = fakes_client.get("/v1/jobs", params={"limit": 2}).json()
    second = fakes_client.get("/v1/jobs", params={"limit": 2, "cursor": first["next_cursor"]}).json()
    third = fakes_client.get("/v1/jobs", params={"limit": 2, "cursor": second["next_cursor"]}).json()
    assert [j["id"] for j in first["data"] + second["data"] + third["data"]] == ids[::-1]
    assert third["next_cursor"] is None
    for job_id in ids:
        fakes_client.post(f"/v1/jobs/{job_id}/cancel")
        assert wait_job(fakes_client, job_id, finished)["status"] in ("cancelled", "succeeded")


GPT_7B5 = {"kind": "gpt", "vocab_size": 50304, "n_layer": 36, "n_head": 32, "n_embd": 4096, "block_size": 2048}


def test_a_model_that_does_not_fit_is_rejected_with_what_would(fakes_client):
    r = fakes_client.post("/v1/jobs", json=job_body(model=GPT_7B5, num_gpus=2, precision="bf16"))
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "does_not_fit" and body["plan"]["fits"] is False
    assert body["plan"]["num_params"] == 7_464_116_224
    assert "min_gpus" in body["message"] and "the cluster has 4" in body["message"]
    assert "stage 2 on N >=" in body["message"]
    gpt3 = {"kind": "gpt", "vocab_size": 50257, "n_layer": 96, "n_head": 96, "n_embd": 12288, "block_size": 2048}
    for precision, bytes_per_param in (("fp32", 8), ("bf16", 4)):
        never = fakes_client.post("/v1/jobs", json=job_body(model=gpt3, num_gpus=4, precision=precision)).json()
        floor_gb = bytes_per_param * never["plan"]["num_params"] / 1e9
        assert f"the replicated {precision} weights and gradients alone are {floor_gb:.2f} GB" in never["message"]
    too_many = fakes_client.post("/v1/jobs", json=job_body(num_gpus=8))
    assert too_many.status_code == 422 and "exceeds the cluster's 4 GPUs" in too_many.json()["message"]
    assert fakes_client.get("/v1/jobs").json()["data"] == []


def test_zero_stage_admits_at_the_stage_asked_or_the_first_that_fits(fakes_client):
    """7.5B in bf16, 3 sequences a micro-batch, on 4 GPUs of 80 GB: stage 1 needs more GPUs, stage 2
    fits. zero_stage 1 is a 422 that names stage 2 and its per-GPU bytes; auto is admitted at stage 2
    and its first event says why."""
    body = job_body(model=GPT_7B5, num_gpus=4, precision="bf16", steps=1, micro_batch_size=3)
    refused = fakes_client.post("/v1/jobs", json={**body, "zero_stage": 1}).json()
    assert refused["error"] == "does_not_fit" and refused["plan"]["stage"] == 1
    stage2_gb = refused["plan"]["stages"]["2"] / 1e9
    assert "ZeRO stage 2 on N >= " in refused["message"]
    assert f"({stage2_gb:.2f} GB per GPU at N = 4; zero_stage: 2 or auto)" in refused["message"], refused["message"]
    stage3_gb = refused["plan"]["stages"]["3"] / 1e9
    later = rf"ZeRO stage 3 on N >= \d+ \({stage3_gb:.2f} GB per GPU at N = 4; zero_stage: 3 or auto\)"
    assert re.search(later, refused["message"]), refused["message"]

    for asked in (2, "auto"):
        dry = fakes_client.post("/v1/jobs", json={**body, "zero_stage": asked}, params={"dry_run": True}).json()
        assert dry["admitted"] is True and dry["plan"]["stage"] == 2 and dry["plan"]["fits"] is True
        assert dry["plan"]["per_gpu"]["total_bytes"] == dry["plan"]["stages"]["2"] < refused["plan"]["stages"]["1"]
    job = fakes_client.post("/v1/jobs", json={**body, "zero_stage": "auto"}).json()
    assert job["spec"]["zero_stage"] == "auto" and job["plan"]["stage"] == 2
    first = fakes_client.get(f"/v1/jobs/{job['id']}/events").json()["data"][0]
    stage1_gb = refused["plan"]["per_gpu"]["total_bytes"] / 1e9
    assert first["reason"] == (
        f"submitted; zero_stage auto: stage 2 (stage 1 needs {stage1_gb:.2f} GB per GPU at N = 4, above the "
        "80.00 GB of each GPU)"
    )
    fakes_client.post(f"/v1/jobs/{job['id']}/cancel")

    small = fakes_client.post("/v1/jobs", json=job_body(zero_stage="auto"), params={"dry_run": True}).json()
    assert small["plan"]["stage"] == 1  # the first stage that fits: it sends the least


def test_an_elastic_auto_job_is_planned_a_stage_for_each_n_it_may_run_on(fakes_client):
    """7.5B in bf16 on 2 to 4 GPUs of 80 GB: its plan is at its fewest GPUs, and auto names the first stage
    that fits on each N (each GPU holds less on more of them); a job that is not elastic, or asks for a
    stage, has none but its plan's."""
    body = job_body(model=GPT_7B5, precision="bf16", steps=1, micro_batch_size=1, global_batch_size=4)
    elastic = {**body, "num_gpus": 4, "min_gpus": 2, "zero_stage": "auto"}
    plan = fakes_client.post("/v1/jobs", json=elastic, params={"dry_run": True}).json()["plan"]
    fits = {
        n: next(
            stage
            for stage in (1, 2, 3)
            if fakes_client.post(
                "/v1/plan",
                json={"model": GPT_7B5, "num_gpus": n, "precision": "bf16", "stage": stage, "micro_batch_size": 1},
            ).json()["fits"]
        )
        for n in (2, 4)
    }
    assert fits[2] > fits[4]  # the size was chosen so: the stage moves with N
    assert plan["num_gpus"] == 2 and plan["stage"] == fits[2] and plan["stage_at"] == {"2": fits[2], "4": fits[4]}
    for fixed in ({**elastic, "zero_stage": fits[2]}, {**elastic, "min_gpus": None}):
        planned = fakes_client.post("/v1/jobs", json=fixed, params={"dry_run": True}).json()["plan"]
        assert planned["stage_at"] is None, planned


def test_a_resize_and_a_start_name_the_stage_an_elastic_auto_job_trains_at_on_its_n(fakes_client):
    """The events of a job whose stage moves with N say which it trains at; others' read as before."""
    body = job_body(model=GPT_7B5, precision="bf16", steps=1, micro_batch_size=1, global_batch_size=4)
    plans = {
        elastic: fakes_client.post(
            "/v1/jobs",
            json={**body, "num_gpus": 4, "min_gpus": 2 if elastic else None, "zero_stage": "auto"},
            params={"dry_run": True},
        ).json()["plan"]
        for elastic in (True, False)
    }
    moving = Job(plan=plans[True], num_gpus=4, world_size=4, status="starting", attempt=0)
    low, high = plans[True]["stage_at"]["2"], plans[True]["stage_at"]["4"]
    assert running_reason(moving, nodes=2) == f"4 ranks placed on 2 node(s) and training at ZeRO stage {high}"
    assert stage_change(moving, 4, 2) == f" (ZeRO stage {high} -> {low})"
    fixed = Job(plan=plans[False], num_gpus=4, world_size=4, status="starting", attempt=0)
    assert running_reason(fixed, nodes=2) == "4 ranks placed on 2 node(s) and training"
    assert stage_change(fixed, 4, 2) == ""


def test_where_only_stage_3_fits_zero_stage_1_is_a_422_naming_it_and_auto_trains_at_stage_3(ray_cluster, tmp_path):
    """A 12-layer GPT on 4 GPUs of 2.5 MB (ZERO1_SIMULATED_GPU_MEMORY_GB, no overhead): per GPU at N = 4,
    stage 1 needs 3.22 MB and stage 2 3.37 MB (a model this small is one gradient bucket a buffer: a
    stage-2 rank stages all of it while backward runs); stage 3 2.40 MB fits. zero_stage 1 is a 422
    naming stage 3; auto is admitted at stage 3, says why in its first event, trains through Ray and
    succeeds."""
    model = {"kind": "gpt", "vocab_size": 64, "n_layer": 12, "n_head": 2, "n_embd": 32, "block_size": 32}
    body = job_body(model=model, num_gpus=4, micro_batch_size=2, steps=4)
    with serve(make_settings(tmp_path, simulated_gpu_memory_gb=0.0025, gpu_overhead_gb=0)) as client:
        refused = client.post("/v1/jobs", json={**body, "zero_stage": 1}).json()
        assert refused["error"] == "does_not_fit" and refused["plan"]["stage"] == 1, refused
        stages = refused["plan"]["stages"]
        assert stages["3"] <= 2_500_000 < stages["1"] < stages["2"]
        assert re.search(
            r"ZeRO stage 3 on N >= \d+ \([\d.]+ GB per GPU at N = 4; zero_stage: 3 or auto\)", refused["message"]
        )
        job = client.post("/v1/jobs", json={**body, "zero_stage": "auto"}).json()
        assert job["plan"]["stage"] == 3 and job["plan"]["per_gpu"]["total_bytes"] == stages["3"], job
        done = wait_job(client, job["id"], lambda job: job["status"] in TERMINAL)
        assert done["status"] == "succeeded", done["error"]
        events = client.get(f"/v1/jobs/{job['id']}/events").json()["data"]
        assert events[0]["reason"].startswith("submitted; zero_stage auto: stage 3 (stage 1 needs ")
        assert "; stage 2 needs " in events[0]["reason"]
        rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
        assert [row["step"] for row in rows] == list(range(4))


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (0, "zero_stage"),
        (4, "zero_stage"),
        ("2", "zero_stage"),
    ],
)
def test_zero_stage_that_does_not_run_is_a_422_naming_the_field(fakes_client, value, says):
    r = fakes_client.post("/v1/jobs", json=job_body(zero_stage=value))
    assert r.status_code == 422 and says in r.text, r.text


def test_dry_run_plans_and_stores_nothing(fakes_client):
    r = fakes_client.post("/v1/jobs", json=job_body(), params={"dry_run": "true"})
    assert r.status_code == 200 and r.json()["admitted"] is True and r.json()["plan"]["num_gpus"] == 2
    assert fakes_client.get("/v1/jobs").json()["data"] == []


def test_cluster_reports_ray_and_where_data_and_models_may_lie(sqlite_client):
    settings = sqlite_client.app.state.runtime.settings
    assert sqlite_client.get("/v1/cluster").json() == {
        "num_gpus": 4,
        "num_gpus_free": 4,
        "gpu_memory_bytes": 80_000_000_000,
        "nodes": 2,
        "simulated": True,
        "data_roots": [os.path.realpath(root) for root in settings.data_roots],
        "model_roots": [os.path.realpath(root) for root in settings.model_roots],
    }


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "text"),
    [
        ("get", "/v1/jobs/999999", {}, 404, "no job with id 999999"),
        ("post", "/v1/jobs/999999/cancel", {}, 404, "no job with id 999999"),
        ("get", "/v1/jobs/999999/metrics", {}, 404, "no job with id 999999"),
        ("get", "/v1/jobs/999999/events", {}, 404, "no job with id 999999"),
        ("get", "/v1/jobs/abc", {}, 422, "job_id: "),
        ("get", "/v1/jobs", {"params": {"status": "sleeping"}}, 422, "status.0: "),
        ("get", "/v1/jobs", {"params": {"limit": 0}}, 422, "limit: "),
        ("get", "/v1/jobs", {"params": {"cursor": "x"}}, 422, "cursor: "),
        ("get", "/v1/jobs/1/metrics", {"params": {"max_points": 1}}, 422, "max_points: "),
        ("post", "/v1/jobs", {"content": "{", "headers": {"content-type": "application/json"}}, 422, "invalid JSON"),
        ("post", "/v1/jobs", {"json": job_body(num_gpus="two")}, 422, "num_gpus: "),
        ("post", "/v1/jobs", {"json": job_body(steps=0)}, 422, "steps: "),
        ("post", "/v1/jobs", {"json": job_body(global_batch_size=6)}, 422, "global_batch_size (6) must be a multiple"),
        ("post", "/v1/jobs", {"json": job_body(data={"kind": "text", "path": "/no/such/file"})}, 422, "data.path"),
        ("post", "/v1/jobs", {"json": {**job_body(), "name": ""}}, 422, "name: "),
    ],
)
def test_bad_requests_are_4xx_json(fakes_client, method, path, kwargs, status, text):
    r = getattr(fakes_client, method)(path, **kwargs)
    assert r.status_code == status, r.text
    assert text in r.json()["message"]


HUGE_NUMBERS = {
    "9" * 5000: "body: invalid JSON: an integer of more than 4300 digits",
    "1e1000000": "Input should be a finite number (got inf)",
    "-1e1000000": "Input should be a finite number (got -inf)",
}
"""Each number, and the refusal that shows which bounded step refused it: json.loads's int(), which
counts the digits against sys.get_int_max_str_digits() before it converts any, or a float parse to
±inf that validation refuses. A parse that expanded the number (a Decimal, an unlimited int) would
answer otherwise, or not at all."""


@pytest.mark.parametrize("number", HUGE_NUMBERS, ids=["5000 digits", "1e1000000", "-1e1000000"])
def test_a_huge_json_number_is_a_422_at_once(fakes_client, number):
    bodies = {
        "/v1/plan": f'{{"num_params": {number}}}',
        "/v1/jobs": json.dumps(job_body(steps=0)).replace('"steps": 0', f'"steps": {number}'),
    }
    for path, body in bodies.items():
        r = fakes_client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert HUGE_NUMBERS[number] in r.json()["message"], r.text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.dictionaries(
        st.sampled_from(list(job_body()) + ["data", "seq_len", "global_batch_size", "seed", "max_retries"]),
        st.none()
        | st.booleans()
        | st.integers(-(10**20), 10**20)
        | st.floats()
        | st.text(max_size=8)
        | st.lists(st.integers(-5, 5), max_size=3)
        | st.just(TINY)
        | st.just(FAST),
        max_size=8,
    )
)
def test_no_job_body_yields_a_500(fakes_client, body):
    r = fakes_client.post(
        "/v1/jobs", content=json.dumps(body), headers={"content-type": "application/json"}, params={"dry_run": "true"}
    )
    assert r.status_code in (200, 422), r.text


def test_a_submit_is_refused_when_the_gpu_nodes_cannot_write_checkpoints(ray_cluster, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    settings = make_settings(tmp_path, checkpoint_uri=str(blocker / "checkpoints"))
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        for params in ({}, {"dry_run": "true"}):
            response = client.post("/v1/jobs", json=job_body(), params=params)
            assert response.status_code == 503, response.text
            body = response.json()
            assert body["error"] == "checkpoint_storage_unwritable"
            assert (
                f"ZERO1_CHECKPOINT_URI ({blocker / 'checkpoints'}) is not writable from 2 GPU node(s)"
                in body["message"]
            )
            assert "NotADirectoryError" in body["message"]
        assert client.get("/v1/jobs").json()["data"] == []


@given(first=st.integers(0, 5_000), span=st.integers(0, 20_000), max_points=st.integers(2, 10_000))
def test_a_thinned_curve_has_at_most_max_points_and_ends_at_the_last_step(first, span, max_points):
    last = first + span
    steps = thinned_steps(first, last, max_points=max_points)
    assert len(steps) <= max_points and steps[-1] == last
    assert steps == sorted(set(steps)) and first <= steps[0]
    if span + 1 <= max_points:  # nothing to thin
        assert steps == list(range(first, last + 1))


def test_max_points_100_of_101_steps_gives_at_most_100():
    assert len(thinned_steps(0, 100, max_points=100)) <= 100
    assert thinned_steps(0, 3, max_points=3) == [0, 2, 3]


# --------------------------------------------------------------------------- keep_last


@pytest.mark.parametrize(("keep_last", "got"), [(0, "0"), (-3, "-3"), (1_000_001, "1000001"), ("all", "'all'")])
def test_keep_last_out_of_range_is_a_422_naming_it_and_the_value(fakes_client, keep_last, got):
    r = fakes_client.post("/v1/jobs", json=job_body(keep_last=keep_last), params={"dry_run": "true"})
    assert r.status_code == 422, r.text
    assert r.json()["message"].startswith("keep_last: ") and f"(got {got})" in r.json()["message"], r.text


def test_keep_last_is_stored_in_the_spec_and_wins_over_the_servers_default(fakes_client):
    kept = submit(fakes_client, job_body(name="kept", steps=2, keep_last=2))
    default = submit(fakes_client, job_body(name="default", steps=2))
    assert (kept["spec"]["keep_last"], default["spec"]["keep_last"]) == (2, None)
    assert fakes_client.get(f"/v1/jobs/{kept['id']}").json()["spec"]["keep_last"] == 2
    for job in (kept, default):
        fakes_client.post(f"/v1/jobs/{job['id']}/cancel")  # a running job's keep_last: the test below

    from service.schemas.requests import JobSpec

    def config_keep_last(spec: dict) -> int:  # as the launcher converts it, with the server's default
        return JobSpec.model_validate(spec).to_config(checkpoint_dir="/unused", keep_last=3).keep_last

    assert (config_keep_last(kept["spec"]), config_keep_last(default["spec"])) == (2, 3)


@pytest.mark.parametrize("storage", ["directory", "s3"])
def test_a_job_with_keep_last_1_ends_with_one_complete_checkpoint(ray_cluster, tmp_path, request, storage):
    """keep_last bounds what a running job keeps; the server keeps up to 5 of a finished job's here, so
    what is left is what the job kept: 1 with keep_last 1, ZERO1_CHECKPOINT_KEEP_LAST's 3 without."""
    uri = request.getfixturevalue("s3_uri") if storage == "s3" else str(tmp_path / "checkpoints")
    settings = make_settings(
        tmp_path, checkpoint_uri=uri, local_dir=str(tmp_path), checkpoint_keep_last=3, checkpoint_keep_finished=5
    )
    with serve(settings) as client:
        jobs = {
            keep_last: submit(
                client, job_body(name=f"keep-{keep_last}", steps=8, checkpoint_every=2, keep_last=keep_last)
            )
            for keep_last in (1, None)
        }
        for job in jobs.values():
            assert wait_job(client, job["id"], finished)["status"] == "succeeded"
    fs, root = fsspec.core.url_to_fs(uri)
    complete = {
        keep_last: sorted(path.split("/")[-2] for path in fs.glob(f"{root}/job-{job['id']}-*/step-*/complete.json"))
        for keep_last, job in jobs.items()
    }
    assert complete == {
        1: ["step-000000007"],
        None: ["step-000000003", "step-000000005", "step-000000007"],
    }
