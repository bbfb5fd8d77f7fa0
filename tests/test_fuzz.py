"""Fuzz every operation of /openapi.json with schemathesis: no input yields a 5xx, every response matches the schema.

Schemathesis runs three phases per operation: the schema's examples, coverage (boundary
values, missing and malformed parameters, undocumented methods) and fuzzing (MAX_EXAMPLES
generated cases of valid and of invalid data), derandomized so that every run sends the
same requests. They go in-process to a started app on stand-ins for Ray (tests/fakes.py: its
scheduler is stopped, no job trains), once with a SQLite database and once with a PostgreSQL one
(some inputs fail only there).

The schema is the app's own /openapi.json, read at import time from an app that is never
started (making the document needs no database or Ray). Schemathesis' `from_fixture`
loader, which could build the schema from a started app, reads pytest's `Item._nodeid`,
gone in pytest 9; so the cases are sent with the fixture's TestClient and checked with
`case.validate_response`, the path the schemathesis docs give for a client of one's own.
The inputs the fuzzing found to fail are kept below as plain tests.

Packages: service.api, service.schemas.
"""

from __future__ import annotations

import collections
import re
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import schemathesis
from fakes import state_on_fakes
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from psycopg import sql
from schemathesis.checks import (
    content_type_conformance,
    missing_required_header,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)
from sqlalchemy import select

from service.main import create_app
from service.settings import Settings
from service.store.tables import Job

from conftest import _postgres_admin, make_settings
from figures import record

MAX_EXAMPLES = 50
"""Generated cases per operation in the fuzzing phase (the examples and coverage phases add their own)."""

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    missing_required_header,
    unsupported_method,
]
# Left out: positive_data_acceptance, which expects a 2xx for every body the schema allows. The
# schema cannot say what the memory model decides (a model too big for the GPUs is a documented
# 422 does_not_fit) nor the cross-field rules (n_embd divisible by n_head, global_batch_size a
# multiple of micro_batch_size x num_gpus); an unknown job id is a documented 404.

CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": True},
            "fuzzing": {"enabled": True},
            "stateful": {"enabled": False},
        },
    }
)
# POST /v1/code's body is a zip: bytes, sent as they are (mostly not a zip: a 422 invalid_code)
schemathesis.serializer.alias("application/zip", "application/octet-stream")
# the app is never started, so nothing is made under the directory; the settings are the fixture's
schema = schemathesis.openapi.from_dict(create_app(make_settings(Path(tempfile.gettempdir()))).openapi(), config=CONFIG)
BASE_URL = "http://testserver"  # the TestClient's

PLAN_TIMEOUT_S = 5
"""ZERO1_PLAN_TIMEOUT_S of the fuzzed app. POST /v1/plan's fuzzing took 4 s in most runs and 56-70 s
in some (the same cases, yet 15 answers 200 instead of 11): py-spy put those runs' time in the API
waiting on trace tasks, and a fuzzed traced plan may be a GPT of up to 100,000 layers. Past this
limit such a trace is the documented 422 trace_timeout; a small one traces within it."""

TALLY: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
"""operation -> status code -> responses."""


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def api(request, tmp_path_factory, record_testsuite_property) -> Iterator[TestClient]:
    """The started app on each database backend; afterwards every job the fuzzing stored is cancelled.

    Submissions are real (a valid body is stored and queued, so the paths that store, replay an
    Idempotency-Key and cancel are fuzzed too) but none trains: the scheduler is stopped first.
    A fuzzed spec may be a model of billions of parameters that fits 80 GB GPUs, and training it
    on this machine's CPUs would exhaust its memory; the scheduler is tested in test_api_jobs
    and test_load.
    """
    with (
        _database(request.param, tmp_path_factory.mktemp("fuzz")) as settings,
        TestClient(create_app(settings, make_state=state_on_fakes), raise_server_exceptions=False) as client,
    ):
        runtime = client.app.state.runtime
        runtime.scheduler.stop()
        TALLY.clear()
        yield client
        _report(request.param, record_testsuite_property)
        _cancel_every_job(client, runtime)


@contextmanager
def _database(backend: str, tmp_path) -> Iterator[Settings]:
    """Settings with an empty database: a SQLite file, or a PostgreSQL database dropped afterwards."""
    if backend == "sqlite":
        yield make_settings(tmp_path, plan_timeout_s=PLAN_TIMEOUT_S)
        return
    name = f"zero1_fuzz_{secrets.token_hex(6)}"
    with _postgres_admin() as admin:  # skips the backend where PostgreSQL is unreachable (fails on CI)
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        yield make_settings(tmp_path, database_url=url, plan_timeout_s=PLAN_TIMEOUT_S)
    finally:
        with _postgres_admin() as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _cancel_every_job(client: TestClient, runtime) -> None:
    """Cancel each queued or suspended job (a fuzzed suspend may have hit one) through the API; afterwards
    none may be left waiting or active."""
    with runtime.db.session() as session:
        ids = session.scalars(select(Job.id).where(Job.status.in_(("queued", "suspended")))).all()
    for job_id in ids:
        response = client.post(f"/v1/jobs/{job_id}/cancel")
        assert response.status_code == 202, response.text
    with runtime.db.session() as session:
        statuses = collections.Counter(session.scalars(select(Job.status)).all())
    print(f"fuzzed submissions stored: {sum(statuses.values())}, cancelled while waiting: {len(ids)}")
    assert set(statuses) <= {"cancelled"}, statuses


def _report(backend: str, record_testsuite_property) -> None:
    total = sum(sum(codes.values()) for codes in TALLY.values())
    server_errors = sum(n for codes in TALLY.values() for code, n in codes.items() if code >= 500)
    print(f"\n{backend}\n{'operation':<34} {'cases':>6}  responses by status")
    for label, codes in sorted(TALLY.items()):
        seen = ", ".join(f"{code}: {n}" for code, n in sorted(codes.items()))
        print(f"{label:<34} {sum(codes.values()):>6}  {seen}")
    print(f"{'total':<34} {total:>6}  5xx: {server_errors}")
    record_testsuite_property(f"fuzz_cases_{backend}", total)
    record_testsuite_property(f"fuzz_5xx_{backend}", server_errors)
    record(f"schemathesis on {backend}", fuzz_cases=total, responses_5xx=server_errors)


def send(client: TestClient, case: schemathesis.Case):
    """The case as schemathesis would send it, through the TestClient (an httpx client)."""
    kwargs = case.as_transport_kwargs(base_url=BASE_URL)
    cookies = kwargs.pop("cookies", None)
    if cookies:
        kwargs["headers"] = {**kwargs.get("headers", {}), "Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())}
    if isinstance(kwargs.get("data"), bytes | str):  # httpx takes a raw body as `content`
        kwargs["content"] = kwargs.pop("data")
    kwargs.pop("timeout", None)
    _end_a_followed_job(client, kwargs)
    return client.request(**kwargs)


def _end_a_followed_job(client: TestClient, kwargs: dict) -> None:
    """A log stream (follow=true) ends when its job ends, and the jobs here never start (the
    scheduler is stopped): cancel the job first, so the stream sends its lines and `end`."""
    url = httpx.URL(kwargs["url"], params=kwargs.get("params"))
    match = re.fullmatch(r"/v1/jobs/(\d{1,18})/logs", url.path)
    follow = (url.params.get("follow") or "").lower()
    if match and follow in ("true", "1", "on", "yes", "t", "y"):
        client.post(f"/v1/jobs/{match.group(1)}/cancel")  # a 404 or 409 where there is nothing to end


@schema.parametrize()
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], deadline=None)
def test_every_operation_conforms_to_its_schema(case, api):
    response = send(api, case)
    TALLY[case.operation.label][response.status_code] += 1
    case.validate_response(response, checks=CHECKS)


MLP = {"kind": "mlp", "sizes": [4, 2]}
JOB = {"name": "tiny", "model": MLP, "num_gpus": 1, "steps": 1}


@pytest.fixture(scope="module")
def client(fake_client):
    """Validation answers before anything runs: the app on stand-ins for Ray (conftest's fake_client)."""
    return fake_client


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "text"),
    [
        # a 500 from the database driver: ids are 64-bit, steps 32-bit
        ("get", f"/v1/jobs/{2**63}", {}, "job_id: Input should be less than or equal to 9223372036854775807"),
        ("post", f"/v1/jobs/{2**63}/cancel", {}, "job_id: Input should be less than or equal to"),
        ("get", f"/v1/jobs/{2**63}/events", {}, "job_id: Input should be less than or equal to"),
        ("get", "/v1/jobs", {"params": {"cursor": 2**63}}, "cursor: Input should be less than or equal to"),
        ("get", "/v1/jobs/1/metrics", {"params": {"after_step": 2**31}}, "after_step: Input should be less than"),
        # PostgreSQL's text columns cannot hold NUL: a 500 there
        ("post", "/v1/jobs", {"json": {**JOB, "name": "a\x00b"}}, "name: must not contain a NUL character"),
        ("post", "/v1/jobs", {"json": {**JOB, "data": {"kind": "text", "path": "a\x00"}}}, "data.path: must not"),
        # FastAPI's undocumented 400 "There was an error parsing the body"
        (
            "post",
            "/v1/plan",
            {"content": b'{"num_params": 1\xff}', "headers": {"content-type": "application/json"}},
            "body: invalid JSON: not UTF-8 (invalid start byte at byte 16)",
        ),
        # schema-violating input that pydantic's lax mode accepted
        ("post", "/v1/plan", {"json": {"num_params": "10"}}, "num_params: Input should be a number, not a string"),
        ("post", "/v1/jobs", {"json": {**JOB, "num_gpus": "1"}}, "num_gpus: Input should be a number, not a string"),
        (
            "post",
            "/v1/plan",
            {"json": {"model": MLP, "activation_checkpointing": 0}},
            "activation_checkpointing: Input should be a valid boolean (got 0)",
        ),
        (
            "post",
            "/v1/jobs",
            {"json": {**JOB, "activation_checkpointing": "yes"}},
            "activation_checkpointing: Input should be a valid boolean",
        ),
    ],
)
def test_what_fuzzing_found_is_a_422(client, method, path, kwargs, text):
    r = getattr(client, method)(path, **kwargs)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid_request" and text in r.json()["message"], r.json()


def test_submit_documents_its_200(client):
    """A dry run and an Idempotency-Key's replay answer 200, as /openapi.json says (it said 201 only)."""
    responses = client.get("/openapi.json").json()["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"200", "201", "422"} <= set(responses)
    dry_run = client.post("/v1/jobs", json=JOB, params={"dry_run": "true"})
    assert dry_run.status_code == 200 and dry_run.json()["dry_run"] is True
