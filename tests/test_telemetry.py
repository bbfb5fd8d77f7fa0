"""GET /metrics on prometheus_client: the histograms and counters, the gauges read from the database at
each scrape, the request timer's route templates, and the app's exposition end to end.

Packages: service.telemetry, service.scheduling.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import APIRouter, FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from service.main import create_app
from service.scheduling.gauges import JobGauges
from service.store.tables import Job
from service.telemetry import UNMATCHED, RequestTimer, Telemetry, iter_route_contexts, route_template

from conftest import make_settings

REQUEST = "zero1_http_request_duration_seconds"
Samples = dict[tuple[str, frozenset], float]


def scrape(text: str) -> Samples:
    """Every sample of an exposition, parsed by prometheus_client, by (name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_histograms_and_counters_render_what_was_observed():
    telemetry = Telemetry()
    job = {"method": "GET", "route": "/v1/jobs/{job_id}", "status": "404"}
    telemetry.request_took("GET", route="/v1/jobs/{job_id}", status=404, duration_s=0.003)
    telemetry.request_took("GET", route="/v1/jobs/{job_id}", status=404, duration_s=0.2)
    telemetry.job_ended("succeeded", duration_s=90)
    telemetry.rows_ingested(40)
    telemetry.rows_ingested(2)
    telemetry.log_lines_ingested(7)
    telemetry.tick_took(0.004)
    telemetry.queue_waited(12)
    samples = scrape(telemetry.render().decode())

    buckets = {le: value(samples, f"{REQUEST}_bucket", **job, le=le) for le in ("0.005", "0.1", "0.25", "+Inf")}
    assert buckets == {"0.005": 1, "0.1": 1, "0.25": 2, "+Inf": 2}  # cumulative
    assert value(samples, f"{REQUEST}_count", **job) == 2
    assert value(samples, f"{REQUEST}_sum", **job) == pytest.approx(0.203)

    assert value(samples, "zero1_job_duration_seconds_bucket", outcome="succeeded", le="60.0") == 0
    assert value(samples, "zero1_job_duration_seconds_bucket", outcome="succeeded", le="300.0") == 1
    assert value(samples, "zero1_job_duration_seconds_sum", outcome="succeeded") == 90
    # every outcome is scraped from the start, so a rate over it never starts from a missing series
    assert value(samples, "zero1_job_duration_seconds_count", outcome="failed") == 0
    assert value(samples, "zero1_job_duration_seconds_count", outcome="cancelled") == 0

    assert value(samples, "zero1_metric_rows_ingested_total") == 42
    assert value(samples, "zero1_log_lines_ingested_total") == 7
    assert value(samples, "zero1_scheduler_tick_duration_seconds_bucket", le="0.0025") == 0
    assert value(samples, "zero1_scheduler_tick_duration_seconds_bucket", le="0.005") == 1
    assert value(samples, "zero1_queue_wait_seconds_bucket", le="5.0") == 0
    assert value(samples, "zero1_queue_wait_seconds_bucket", le="15.0") == 1
    assert value(samples, "zero1_queue_wait_seconds_count") == 1


def test_each_telemetry_has_a_registry_of_its_own():
    first = Telemetry()
    second = Telemetry()  # the process-wide registry would refuse the second's names
    first.rows_ingested(5)
    assert value(scrape(second.render().decode()), "zero1_metric_rows_ingested_total") == 0


def test_a_method_outside_the_standard_ones_is_labelled_other():
    telemetry = Telemetry()
    telemetry.request_took("BREW", route=UNMATCHED, status=405, duration_s=0.001)
    samples = scrape(telemetry.render().decode())
    assert value(samples, f"{REQUEST}_count", method="other", route=UNMATCHED, status="405") == 1
    assert not any(dict(labels).get("method") == "BREW" for _, labels in samples)


# ----------------------------------------------------------------------- the gauges from the database


def _job(status: str, *, num_gpus: int, **fields) -> Job:
    return Job(name=f"{status}-job", status=status, spec={}, plan={}, num_gpus=num_gpus, steps=100, **fields)


def test_the_job_gauges_read_the_database_at_each_scrape(database):
    telemetry = Telemetry()
    assert "zero1_jobs" not in names(scrape(telemetry.render().decode()))  # nothing to read before bind
    with database.session() as session:
        session.add_all(
            [
                _job("queued", num_gpus=4),
                _job("running", num_gpus=4, world_size=2, latest={"step": 9, "step_time_s": 0.5}),
                _job("running", num_gpus=1, latest={"step": 3, "step_time_s": 0.25}),
                _job("restarting", num_gpus=1),
                _job("succeeded", num_gpus=4, latest={"step": 99, "step_time_s": 0.1}),
            ]
        )
    telemetry.register(JobGauges(database, total_gpus=lambda: 8))

    samples = scrape(telemetry.render().decode())
    jobs = {status: value(samples, "zero1_jobs", status=status) for status in ("queued", "running", "failed")}
    assert jobs == {"queued": 1, "running": 2, "failed": 0}
    assert value(samples, "zero1_gpus_in_use") == 2 + 1 + 1  # an elastic job holds its world size
    assert value(samples, "zero1_gpus_total") == 8
    assert value(samples, "zero1_steps_per_second") == 1 / 0.5 + 1 / 0.25  # running jobs only

    with database.session() as session:
        session.execute(update(Job).where(Job.status == "restarting").values(status="failed"))
    samples = scrape(telemetry.render().decode())
    assert value(samples, "zero1_jobs", status="failed") == 1 and value(samples, "zero1_jobs", status="restarting") == 0
    assert value(samples, "zero1_gpus_in_use") == 3


def test_rows_and_lines_are_counted_when_their_transaction_commits(database):
    telemetry = Telemetry()
    with database.session() as session:
        telemetry.ingested_on_commit(session, num_rows=3, num_lines=10)
        telemetry.ingested_on_commit(session, num_rows=2, num_lines=0)  # a second poll in the same transaction
    with pytest.raises(RuntimeError), database.session() as session:
        telemetry.ingested_on_commit(session, num_rows=100, num_lines=100)
        raise RuntimeError("the transaction rolls back")  # its poll is stored (and counted) again later
    samples = scrape(telemetry.render().decode())
    assert value(samples, "zero1_metric_rows_ingested_total") == 5
    assert value(samples, "zero1_log_lines_ingested_total") == 10


# ----------------------------------------------------------------------- route templates and the timer


@pytest.mark.parametrize(
    ("method", "path", "template"),
    [
        ("GET", "/v1/jobs/7", "/v1/jobs/{job_id}"),
        ("GET", "/v1/jobs/7/metrics", "/v1/jobs/{job_id}/metrics"),
        ("GET", "/v1/jobs/7/logs", "/v1/jobs/{job_id}/logs"),  # a stream of server-sent events with follow=true
        ("GET", "/v1/jobs/7/artifacts/model.safetensors", "/v1/jobs/{job_id}/artifacts/{name}"),
        ("DELETE", "/v1/jobs/7", "/v1/jobs/{job_id}"),  # the path's route answers 405
        ("GET", "/metrics", "/metrics"),
        ("GET", "/jobs/7", "/jobs/{job_id}"),  # the dashboard's page
        ("GET", "/static/dashboard.css", "/static/{path}"),
        ("GET", "/v1/no-such-thing/7", UNMATCHED),
    ],
)
def test_the_route_template_is_the_apps_route_never_the_raw_path(tmp_path, method, path, template):
    app = create_app(make_settings(tmp_path))  # not started: routing needs no runtime
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": []}
    assert route_template(list(iter_route_contexts(app.routes)), scope) == template


def _timed_app() -> tuple[FastAPI, Telemetry]:
    """A small app with the timer: a route under a prefixed router, one that raises, one that streams."""
    telemetry = Telemetry()
    items = APIRouter()

    @items.get("/items/{item_id}")
    def item(item_id: int) -> dict:
        raise HTTPException(404, f"no item {item_id}")

    v1 = APIRouter(prefix="/v1")
    v1.include_router(items)
    app = FastAPI()
    app.include_router(v1)

    @app.get("/boom")
    def boom() -> dict:
        raise RuntimeError("a bug")

    @app.get("/stream")
    def stream() -> StreamingResponse:
        return StreamingResponse(iter([b"a", b"b", b"c"]), media_type="text/plain")

    app.add_middleware(RequestTimer, telemetry=telemetry)
    return app, telemetry


def test_the_timer_labels_route_templates_and_statuses():
    app, telemetry = _timed_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/v1/items/5").status_code == 404
        assert client.get("/v1/items/6").status_code == 404
        assert client.get("/boom").status_code == 500
        assert client.get("/nope/8").status_code == 404
    samples = scrape(telemetry.render().decode())
    assert value(samples, f"{REQUEST}_count", method="GET", route="/v1/items/{item_id}", status="404") == 2
    assert value(samples, f"{REQUEST}_count", method="GET", route="/boom", status="500") == 1
    assert value(samples, f"{REQUEST}_count", method="GET", route=UNMATCHED, status="404") == 1
    routes = {dict(labels).get("route") for _, labels in samples} - {None}
    assert routes == {"/v1/items/{item_id}", "/boom", UNMATCHED}


def test_a_streamed_response_passes_the_timer_message_by_message():
    """Each chunk reaches the server while the request is still being timed: nothing is held back."""
    app, telemetry = _timed_app()
    sent: list[tuple[str, bytes, bool]] = []  # (type, body, whether the request was timed yet)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        timed = {name for name, labels in scrape(telemetry.render().decode()) if ("route", "/stream") in labels}
        sent.append((message["type"], message.get("body", b""), bool(timed)))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/stream",
        "raw_path": b"/stream",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("test", 1),
        "server": ("test", 80),
    }
    asyncio.run(app(scope, receive, send))
    chunks = [body for kind, body, _ in sent if kind == "http.response.body" and body]
    assert chunks == [b"a", b"b", b"c"]
    assert not any(timed for *_, timed in sent)  # every message went out before the request ended
    samples = scrape(telemetry.render().decode())
    assert value(samples, f"{REQUEST}_count", method="GET", route="/stream", status="200") == 1


# ----------------------------------------------------------------------- the app


def test_metrics_exposes_latency_by_route_template_and_the_gauges(client):
    assert client.get("/healthz").status_code == 200
    assert client.get("/v1/jobs/999999").status_code == 404
    assert client.get("/v1/jobs").status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST

    samples = scrape(response.text)
    assert value(samples, f"{REQUEST}_count", method="GET", route="/v1/jobs/{job_id}", status="404") == 1
    assert value(samples, f"{REQUEST}_bucket", method="GET", route="/v1/jobs/{job_id}", status="404", le="+Inf") == 1
    assert value(samples, f"{REQUEST}_count", method="GET", route="/v1/jobs", status="200") == 1
    assert value(samples, f"{REQUEST}_count", method="GET", route="/healthz", status="200") >= 1
    assert not any("999999" in dict(labels).get("route", "") for _, labels in samples)

    statuses = ("queued", "starting", "running", "restarting", "succeeded", "failed", "cancelled")
    assert {status: value(samples, "zero1_jobs", status=status) for status in statuses} == dict.fromkeys(statuses, 0)
    assert value(samples, "zero1_gpus_total") == 4  # the session's Ray cluster: 2 nodes of 2 GPUs
    assert value(samples, "zero1_gpus_in_use") == 0
    assert value(samples, "zero1_steps_per_second") == 0

    again = scrape(client.get("/metrics").text)  # a scrape is timed once it has been answered
    assert value(again, f"{REQUEST}_count", method="GET", route="/metrics", status="200") >= 1
