"""Security: API tokens and owners, the dashboard's cookie and CSRF header, data roots, request limits,
and `zero1 serve` refusing to listen beyond loopback without tokens.

Packages: service.auth, service.api, service.dashboard.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient

from service import auth
from service.api.job_responses import job_public
from service.auth import TOKEN_COOKIE, check_bind, is_loopback, load_tokens
from service.cli import main
from service.errors import ServiceError
from service.intake.admission import admit
from service.intake.submission import submit_job
from service.lockout import MAX_FAILURES, WINDOW_S, LoginLockout, client_key
from service.main import create_app
from service.planning.capacity import ClusterCapacity, RayCluster
from service.schemas.requests import JobSpec
from service.store.db import Database, upgrade
from service.store.tables import Job, JobEvent
from workers.memory.model import GB

from conftest import make_settings, serve_on_fakes
from helpers import TERMINAL, TINY, bearer, wait_job

ZERO1 = str(Path(sys.executable).with_name("zero1"))
ALICE, BOB, ROOT = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "bob", "root"))
TOKENS = f"alice:{ALICE}, bob:{BOB},root:{ROOT}:admin"
MAX_QUEUED = 2


def job_body(**overrides) -> dict:
    return {
        "name": "sec",
        "model": TINY,
        "num_gpus": 4,
        "precision": "fp32",
        "steps": 1_000_000,
        "micro_batch_size": 4,
        **overrides,
    }


def submit(client: TestClient, token: str, **overrides) -> dict:
    response = client.post("/v1/jobs", json=job_body(**overrides), headers=bearer(token))
    assert response.status_code == 201, response.text
    return response.json()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """A data root with a corpus in it, a file beside it (outside), and symlinks in it to both."""
    base = tmp_path_factory.mktemp("data")
    root = base / "root"
    root.mkdir()
    (root / "corpus.txt").write_text("to be or not to be " * 50)
    (base / "secret.txt").write_text("outside the root")
    (root / "escape.txt").symlink_to(base / "secret.txt")
    (root / "alias.txt").symlink_to(root / "corpus.txt")
    return root


@pytest.fixture(scope="module")
def secured(tmp_path_factory, data_root):
    """The app with three tokens (root is an admin), a data root, and at most 2 queued jobs per user, on
    stand-ins for Ray (conftest's serve_on_fakes): who may do what is the API's, not Ray's."""
    settings = make_settings(
        tmp_path_factory.mktemp("secured"),
        api_tokens=TOKENS,
        data_roots=[str(data_root)],
        max_queued_jobs_per_user=MAX_QUEUED,
        auth_max_failures=1000,  # its tests send a wrong token to every endpoint: the lockout is tested apart
    )
    with serve_on_fakes(settings) as client:
        yield client


@pytest.fixture(scope="module")
def blocker(secured):
    """root's job holding all 4 GPUs, so that every job submitted meanwhile stays queued."""
    job = submit(secured, ROOT, name="blocker")
    wait_job(secured, job["id"], lambda j: j["status"] == "running", headers=bearer(ROOT))
    yield job
    secured.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(ROOT))
    wait_job(secured, job["id"], lambda j: j["status"] in TERMINAL, headers=bearer(ROOT))


def cancel_all(client: TestClient, jobs: list[dict]) -> None:
    for job in jobs:
        client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(ROOT))


# --------------------------------------------------------------------------- tokens


MUTATIONS = [
    ("post", "/v1/jobs", {"json": job_body()}),
    ("post", "/v1/jobs/1/cancel", {}),
    ("post", "/v1/code", {"content": b"PK\x05\x06" + bytes(18)}),
]
READS = [
    ("get", "/v1/jobs", {}),
    ("get", "/v1/jobs/1", {}),
    ("get", "/v1/jobs/1/metrics", {}),
    ("get", "/v1/jobs/1/events", {}),
    ("get", "/v1/jobs/1/checkpoints", {}),
    ("get", "/v1/jobs/1/checkpoints/9/complete.json", {}),
    ("get", "/v1/cluster", {}),
    ("get", f"/v1/code/sha256:{'0' * 64}", {}),
    ("get", "/metrics", {}),
    ("post", "/v1/plan", {"json": {"num_params": 7_500_000_000}}),
    ("post", "/v1/plan/recommend", {"json": {"model": {"kind": "mlp", "sizes": [4, 2]}, "global_batch_size": 4}}),
]
BAD_CREDENTIALS = {
    "none": {},
    "wrong token": bearer("x" * 40),
    "not bearer": {"Authorization": f"Basic {ALICE}"},
    "empty bearer": {"Authorization": "Bearer "},
}


@pytest.mark.parametrize("credentials", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
@pytest.mark.parametrize(
    ("method", "path", "kwargs"), MUTATIONS + READS, ids=[f"{m} {p}" for m, p, _ in MUTATIONS + READS]
)
def test_every_api_endpoint_needs_a_valid_token(secured, method, path, kwargs, credentials):
    before = len(secured.get("/v1/jobs", headers=bearer(ROOT)).json()["data"])
    response = getattr(secured, method)(path, headers=credentials, **kwargs)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"] == "unauthorized" and "Bearer <token>" in response.json()["message"]
    assert len(secured.get("/v1/jobs", headers=bearer(ROOT)).json()["data"]) == before  # nothing stored


@pytest.mark.parametrize(("method", "path", "kwargs"), READS, ids=[f"{m} {p}" for m, p, _ in READS])
def test_a_valid_token_reads(secured, method, path, kwargs):
    response = getattr(secured, method)(path, headers=bearer(BOB), **kwargs)
    assert response.status_code in (200, 404), response.text  # job 1 may not exist: past auth either way


@pytest.mark.parametrize("path", ["/", "/jobs/1", "/plan?num_gpus=8"])
def test_dashboard_pages_send_a_browser_without_a_token_to_log_in(secured, path):
    response = secured.get(path, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == f"/login?next={quote(path, safe='')}"
    page = secured.get(response.headers["location"])
    assert page.status_code == 200 and 'name="token"' in page.text and f'value="{path}"' in page.text


@pytest.mark.parametrize("path", ["/healthz", "/docs", "/openapi.json", "/static/dashboard.js"])
def test_health_docs_and_static_files_stay_public(secured, path):
    assert secured.get(path).status_code == 200


def test_openapi_declares_the_bearer_token_where_it_is_required(secured):
    schema = secured.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert schema["paths"]["/v1/jobs"]["post"]["security"] == [{"bearer": []}]
    assert schema["paths"]["/v1/jobs"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("public"), api_tokens=TOKENS, public_read=True)
    with serve_on_fakes(settings) as client:
        yield client


def test_public_read_opens_reads_but_not_writes(public):
    for path in ("/v1/jobs", "/v1/cluster", "/metrics", "/", "/plan"):
        assert public.get(path, follow_redirects=False).status_code == 200, path
    assert public.post("/v1/plan", json={"num_params": 10**9}).status_code == 200
    recommend = {"model": {"kind": "mlp", "sizes": [4, 2]}, "global_batch_size": 4}
    assert public.post("/v1/plan/recommend", json=recommend).status_code == 200
    assert public.post("/v1/jobs", json=job_body()).status_code == 401
    assert public.post("/v1/jobs/1/cancel").status_code == 401
    assert public.post("/v1/code", content=b"PK", headers={"Content-Type": "application/zip"}).status_code == 401
    schema = public.get("/openapi.json").json()["paths"]
    assert "security" not in schema["/v1/jobs"]["get"] and schema["/v1/jobs"]["post"]["security"]
    assert "security" not in schema["/v1/plan/recommend"]["post"]  # a read, like POST /v1/plan


def seed_cancelled_job(client: TestClient, *, owner: str) -> int:
    """A job of `owner` stored already cancelled, so that the scheduler never starts it."""
    spec = JobSpec.model_validate(job_body(name=f"{owner}'s run"))
    cluster = ClusterCapacity(num_gpus=4, num_gpus_free=4, gpu_memory_bytes=80 * GB, simulated=True)
    plan = admit(spec, cluster=cluster, overhead_bytes=GB).model_dump(mode="json")
    with client.app.state.runtime.db.session() as session:
        job = Job(
            name=spec.name,
            status="cancelled",
            spec=spec.model_dump(mode="json"),
            plan=plan,
            num_gpus=4,
            steps=spec.steps,
            owner=owner,
        )
        session.add(job)
        session.flush()
        session.add(JobEvent(job_id=job.id, from_status=None, to_status="cancelled", reason="seeded"))
        return job.id


def test_public_read_shows_the_shared_view_only_and_a_token_still_says_who_reads(public):
    job_id = seed_cancelled_job(public, owner="alice")
    shared = public.get(f"/v1/jobs/{job_id}").json()
    assert (shared["name"], shared["owner"], shared["status"], shared["spec"]) == (
        "alice's run",
        "alice",
        "cancelled",
        None,
    )
    assert [j["spec"] for j in public.get("/v1/jobs").json()["data"] if j["id"] == job_id] == [None]
    for path in (
        f"/v1/jobs/{job_id}/metrics",
        f"/v1/jobs/{job_id}/events",
        f"/v1/jobs/{job_id}/artifacts",
        f"/v1/jobs/{job_id}/artifacts/model.safetensors",
        f"/jobs/{job_id}",
    ):
        assert public.get(path).status_code == 404, path
    assert public.get(f"/v1/jobs/{job_id}", headers=bearer(ALICE)).json()["spec"]["name"] == "alice's run"
    assert public.get(f"/v1/jobs/{job_id}/events", headers=bearer(ALICE)).json()["data"][0]["reason"] == "seeded"
    assert public.get(f"/v1/jobs/{job_id}", headers=bearer("x" * 40)).status_code == 401  # a wrong token is told so


# --------------------------------------------------------------------------- owners and limits


def test_jobs_record_their_owner_and_only_the_owner_or_an_admin_cancels(secured, blocker):
    job = submit(secured, ALICE, name="alices")
    assert job["owner"] == "alice" and job["status"] == "queued"
    listed = secured.get("/v1/jobs", params={"status": "queued"}, headers=bearer(BOB)).json()["data"]
    assert [(j["id"], j["owner"]) for j in listed] == [(job["id"], "alice")]

    refused = secured.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(BOB))
    assert refused.status_code == 403 and refused.json()["error"] == "forbidden"
    assert refused.json()["owner"] == "alice"
    assert f"job {job['id']} belongs to alice; only alice or an admin may cancel it" in refused.json()["message"]
    assert secured.get(f"/v1/jobs/{job['id']}", headers=bearer(BOB)).json()["status"] == "queued"

    by_admin = secured.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(ROOT))
    assert by_admin.status_code == 202 and by_admin.json()["status"] == "cancelled"
    own = submit(secured, BOB, name="bobs")
    assert secured.post(f"/v1/jobs/{own['id']}/cancel", headers=bearer(BOB)).json()["status"] == "cancelled"


def test_a_jobs_spec_metrics_and_events_are_for_its_owner_and_admins_only(secured, blocker, data_root):
    """Everyone sees who holds the GPUs; only the owner and admins see what a job reads, its curves and events."""
    corpus = os.path.realpath(data_root / "corpus.txt")
    job = submit(secured, ALICE, name="alices run", data={"kind": "text", "path": corpus})
    own = submit(secured, BOB, name="bobs run")
    try:
        for token in (ALICE, ROOT):
            assert secured.get(f"/v1/jobs/{job['id']}", headers=bearer(token)).json()["spec"]["data"]["path"] == corpus
            for path in (f"/v1/jobs/{job['id']}/metrics", f"/v1/jobs/{job['id']}/events", f"/jobs/{job['id']}"):
                assert secured.get(path, headers=bearer(token)).status_code == 200, path
        shared = secured.get(f"/v1/jobs/{job['id']}", headers=bearer(BOB)).json()
        assert (shared["name"], shared["owner"], shared["status"], shared["num_gpus"], shared["steps"]) == (
            "alices run",
            "alice",
            "queued",
            4,
            1_000_000,
        )
        assert (shared["spec"], shared["latest"], shared["error"]) == (None, None, None)
        assert shared["plan"] == job["plan"]  # sizes only
        listed = {j["id"]: j for j in secured.get("/v1/jobs", headers=bearer(BOB)).json()["data"]}
        assert listed[job["id"]]["spec"] is None and listed[blocker["id"]]["spec"] is None
        assert listed[own["id"]]["spec"]["name"] == "bobs run"
        parts = ("metrics", "events", "artifacts", "artifacts/model.safetensors", "checkpoints", "checkpoints/9/a")
        for part in parts:  # as if there were no such job
            hidden = secured.get(f"/v1/jobs/{job['id']}/{part}", headers=bearer(BOB))
            assert hidden.status_code == 404 and hidden.json()["message"] == f"no job with id {job['id']}"
        for token in (ALICE, ROOT):  # its owner and admins are told it has none yet
            assert secured.get(f"/v1/jobs/{job['id']}/artifacts", headers=bearer(token)).status_code == 409
        page = secured.get(f"/jobs/{job['id']}", headers=bearer(BOB))
        assert page.status_code == 404 and f"no job with id {job['id']}" in page.text and corpus not in page.text
        table = secured.get("/", headers=bearer(BOB))
        assert table.status_code == 200 and "alices run" in table.text
        assert corpus not in table.text + secured.get("/metrics", headers=bearer(BOB)).text
    finally:
        cancel_all(secured, [job, own])


def test_only_the_owner_admins_and_auth_off_see_a_jobs_details(tmp_path):
    url = f"sqlite:///{tmp_path / 'zero1.db'}"
    upgrade(url)
    db = Database(url)
    cluster = ClusterCapacity(num_gpus=4, num_gpus_free=4, gpu_memory_bytes=80 * GB, simulated=True)
    spec = JobSpec.model_validate(job_body())
    readers = {
        "alice": auth.Principal(user="alice"),
        "root": auth.Principal(user="root", admin=True),
        "auth off": auth.ANONYMOUS,
        "bob": auth.Principal(user="bob"),
        "public read": auth.PUBLIC,
    }
    try:
        with db.session() as session:
            job, _ = submit_job(
                session,
                spec=spec,
                plan=admit(spec, cluster=cluster, overhead_bytes=GB),
                idempotency_key=None,
                owner="alice",
            )
            job.latest = {"step": 3, "loss": 2.5}
            job.error = {"exception": "RuntimeError", "message": "in alice's data"}
            views = {who: job_public(job, position=1, principal=principal) for who, principal in readers.items()}
    finally:
        db.dispose()
    for who, view in views.items():
        private = (view.spec, view.latest, view.error)
        if who in ("alice", "root", "auth off"):
            assert private == (spec.model_dump(mode="json"), {"step": 3, "loss": 2.5}, job.error), who
        else:
            assert private == (None, None, None), who
        assert (view.name, view.owner, view.status, view.queue_position, view.plan) == (
            "sec",
            "alice",
            "queued",
            1,
            views["alice"].plan,
        ), who


def test_queued_jobs_per_user_are_limited(secured, blocker):
    mine = [submit(secured, ALICE, name=f"q{i}") for i in range(MAX_QUEUED)]
    try:
        over = secured.post("/v1/jobs", json=job_body(name="one too many"), headers=bearer(ALICE))
        assert over.status_code == 429, over.text
        body = over.json()
        assert body["error"] == "too_many_queued_jobs" and (body["queued"], body["limit"]) == (2, 2)
        assert "user alice has 2 queued jobs, the limit is 2" in body["message"]
        mine.append(submit(secured, BOB, name="bob is not alice"))  # the limit is per user
        dry = secured.post("/v1/jobs", json=job_body(), params={"dry_run": "true"}, headers=bearer(ALICE))
        assert dry.status_code == 200  # a dry run stores nothing, so it is not limited
    finally:
        cancel_all(secured, mine)
    assert submit(secured, ALICE, name="room again")["status"] == "queued"
    cancel_all(secured, secured.get("/v1/jobs", params={"status": "queued"}, headers=bearer(ROOT)).json()["data"])


def test_an_idempotency_key_is_not_shared_between_users(secured, blocker):
    first = secured.post("/v1/jobs", json=job_body(name="keyed"), headers={**bearer(ALICE), "Idempotency-Key": "k1"})
    again = secured.post("/v1/jobs", json=job_body(name="keyed"), headers={**bearer(BOB), "Idempotency-Key": "k1"})
    try:
        assert first.status_code == 201 and again.status_code == 409
        assert again.json()["message"] == "Idempotency-Key 'k1' is in use by another user"
        assert str(first.json()["id"]) not in again.text  # nothing of alice's job
    finally:
        cancel_all(secured, [first.json()])


def test_with_auth_off_everyone_is_one_anonymous_user_for_the_queue_limit(tmp_path):
    url = f"sqlite:///{tmp_path / 'zero1.db'}"
    upgrade(url)
    db = Database(url)
    cluster = ClusterCapacity(num_gpus=4, num_gpus_free=4, gpu_memory_bytes=80 * GB, simulated=True)
    spec = JobSpec.model_validate(job_body())
    plan = admit(spec, cluster=cluster, overhead_bytes=GB)
    try:
        with db.session() as session:
            job, _ = submit_job(session, spec=spec, plan=plan, idempotency_key=None, max_queued=1)
            assert job.owner is None
            with pytest.raises(ServiceError) as error:
                submit_job(session, spec=spec, plan=plan, idempotency_key=None, max_queued=1)
    finally:
        db.dispose()
    assert error.value.status_code == 429
    assert error.value.message.startswith("the anonymous user (auth is off) has 1 queued jobs, the limit is 1")


# --------------------------------------------------------------------------- the dashboard's cookie


def test_the_login_cookie_reads_and_cancels_only_with_the_csrf_header(secured, blocker):
    login = secured.post("/login", data={"token": ALICE, "next": "/jobs/1"}, follow_redirects=False)
    secured.cookies.clear()  # every request below says which cookie it sends
    assert login.status_code == 303 and login.headers["location"] == "/jobs/1"
    cookie = login.headers["set-cookie"]
    assert cookie.startswith(f"{TOKEN_COOKIE}={ALICE};") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    as_alice = {"Cookie": f"{TOKEN_COOKIE}={ALICE}"}

    assert secured.get("/v1/jobs", headers=as_alice).status_code == 200
    page = secured.get("/", headers=as_alice)
    assert page.status_code == 200 and '<span>alice</span><button type="submit">Log out</button>' in page.text
    job = submit(secured, ALICE, name="by cookie")
    try:
        forged = secured.post(f"/v1/jobs/{job['id']}/cancel", headers=as_alice)  # what a cross-site form sends
        assert forged.status_code == 403 and forged.json()["error"] == "csrf"
        assert "X-Zero1-CSRF: 1" in forged.json()["message"]
        assert secured.post("/v1/jobs", json=job_body(), headers=as_alice).status_code == 403
        assert secured.get(f"/v1/jobs/{job['id']}", headers=as_alice).json()["status"] == "queued"
        cancelled = secured.post(f"/v1/jobs/{job['id']}/cancel", headers={**as_alice, "X-Zero1-CSRF": "1"})
        assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    finally:
        cancel_all(secured, [job])


def test_the_dashboard_script_sends_the_csrf_header():
    script = (Path(__file__).parents[1] / "service" / "dashboard" / "static" / "dashboard.js").read_text()
    assert '"X-Zero1-CSRF": "1"' in script


def test_login_refuses_a_wrong_token_and_redirects_only_within_the_site(secured):
    wrong = "w" * 32
    refused = secured.post("/login", data={"token": wrong, "next": "/"}, follow_redirects=False)
    assert refused.status_code == 401 and "That token is not valid." in refused.text
    assert wrong not in refused.text and "set-cookie" not in refused.headers
    for target in ("//evil.example/x", "https://evil.example/", "/\\evil.example"):
        response = secured.post("/login", data={"token": BOB, "next": target}, follow_redirects=False)
        assert response.headers["location"] == "/", target
    secured.cookies.clear()
    logout = secured.post("/logout", follow_redirects=False)
    assert logout.status_code == 303 and f'{TOKEN_COOKIE}=""' in logout.headers["set-cookie"]


def test_login_locks_a_client_out_after_10_wrong_tokens_within_a_minute(secured):
    """A locked-out client gets 429 even with a valid token it never used from there (else guessing
    would go on at full speed), until its oldest failure is WINDOW_S old; other addresses are not
    locked out."""
    now_s = [1000.0]
    saved = secured.app.state.login_lockout
    secured.app.state.login_lockout = LoginLockout(clock=lambda: now_s[0])
    try:
        for _ in range(MAX_FAILURES):  # one a second
            now_s[0] += 1
            assert secured.post("/login", data={"token": "w" * 32}, follow_redirects=False).status_code == 401
        wait_s = int(1001 + WINDOW_S - now_s[0])  # until the first failure is WINDOW_S old
        for token in ("w" * 32, BOB):
            locked = secured.post("/login", data={"token": token, "next": "/"}, follow_redirects=False)
            assert locked.status_code == 429 and locked.headers["retry-after"] == str(wait_s)
            assert f"10 wrong tokens within 60 s: try again in {wait_s} s" in locked.text
            assert "set-cookie" not in locked.headers and token not in locked.text
        elsewhere = TestClient(secured.app, client=("203.0.113.7", 50000))
        assert elsewhere.post("/login", data={"token": "w" * 32}, follow_redirects=False).status_code == 401
        now_s[0] += wait_s
        again = secured.post("/login", data={"token": BOB}, follow_redirects=False)
        assert again.status_code == 303 and again.headers["set-cookie"].startswith(f"{TOKEN_COOKIE}={BOB};")
    finally:
        secured.app.state.login_lockout = saved
        secured.cookies.clear()


def test_the_login_lockout_remembers_a_bounded_number_of_clients():
    now_s = [0.0]
    lockout = LoginLockout(max_failures=2, window_s=60, max_clients=3, clock=lambda: now_s[0])
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"):
        now_s[0] += 1
        lockout.record_failure(host)
        lockout.record_failure(host)
    assert len(lockout) == 3  # 10.0.0.1, whose last failure is the oldest, was forgotten
    assert lockout.retry_after_s("10.0.0.1") == 0 and lockout.retry_after_s("10.0.0.4") == 60
    now_s[0] += 60
    assert lockout.retry_after_s("10.0.0.4") == 0 and len(lockout) == 2  # 10.0.0.4's failures expired
    # an IPv6 host usually holds a whole /64: its addresses are one client
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff:2") == "2001:db8::/64"
    assert client_key("192.0.2.1") == "192.0.2.1" and client_key(None) == "unknown"


def test_tokens_are_never_logged_nor_echoed(secured, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "never-a-token-" + secrets.token_hex(16)
    responses = [
        secured.get("/v1/jobs", headers=bearer(wrong)),
        secured.post("/v1/jobs", json=job_body(steps=0), headers=bearer(ALICE)),
        secured.post("/v1/jobs/999999/cancel", headers=bearer(BOB)),
        secured.post("/login", data={"token": wrong}),
        secured.get("/v1/jobs", headers={"Authorization": f"Token {ALICE}"}),
    ]
    secured.cookies.clear()
    assert [r.status_code for r in responses] == [401, 422, 404, 401, 401]
    for token in (ALICE, BOB, ROOT, wrong):
        assert token not in caplog.text
        assert all(token not in r.text for r in responses)
    assert repr(secured.app.state.authenticator.tokens) == "TokenTable(3 tokens)"


# --------------------------------------------------------------------------- the token table


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("alice", "ZERO1_API_TOKENS entry 1: expected user:token or user:token:admin, got 1 ':'-separated fields"),
        ("alice:SECRET-0123456789abcdef:root", "ZERO1_API_TOKENS entry 1: the third field of user:token:admin"),
        (":SECRET-0123456789abcdef", "ZERO1_API_TOKENS entry 1: the user must be 1-200 of"),
        ("bob:SECRET-0123456789abcdef,alice:SECRET-9", "ZERO1_API_TOKENS entry 2 (user alice): the token has 8"),
        ("bob:SECRET-0123456789abcdef,carol:SECRET-0123456789abcdef", "entry 2 (user carol): the token repeats"),
    ],
)
def test_a_malformed_token_entry_stops_the_app_without_showing_the_token(tmp_path, entry, message):
    with pytest.raises(ValueError) as error:
        create_app(make_settings(tmp_path, api_tokens=entry))
    assert message in str(error.value)
    assert "SECRET" not in str(error.value)


def test_the_token_file_adds_users_skipping_comments(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# zero1 tokens\n\ncarol:{'c' * 20}\n  dave:{'d' * 20}:admin  \n")
    table = load_tokens(make_settings(tmp_path, api_tokens=f"alice:{ALICE}", api_tokens_file=str(path)))
    assert len(table) == 3
    assert table.lookup("c" * 20) == auth.Principal(user="carol", admin=False)
    assert table.lookup("d" * 20) == auth.Principal(user="dave", admin=True)
    assert table.lookup(ALICE).user == "alice" and table.lookup("c" * 19) is None
    path.write_text("carol:short\n")
    with pytest.raises(ValueError, match=f"ZERO1_API_TOKENS_FILE {path} line 1 \\(user carol\\)"):
        load_tokens(make_settings(tmp_path, api_tokens_file=str(path)))


def test_a_token_is_compared_with_every_entry(monkeypatch):
    """No early exit on a match: the time taken does not tell which entry (if any) matched."""
    table = load_tokens(make_settings(Path("/nonexistent"), api_tokens=TOKENS))
    calls = []
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or a == b)
    assert table.lookup(ALICE).user == "alice"  # the first entry
    assert len(calls) == 3


# --------------------------------------------------------------------------- .env.example's placeholders


def env_example() -> dict[str, str]:
    """.env.example's variables (name -> value), as `cp .env.example .env` would deploy them."""
    lines = (Path(__file__).parents[1] / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.lstrip().startswith("#"))


def test_the_example_api_tokens_stop_the_app_naming_the_entry_not_the_token(tmp_path):
    example = env_example()["ZERO1_API_TOKENS"]
    with pytest.raises(ValueError) as error:
        create_app(make_settings(tmp_path, api_tokens=example))
    assert "ZERO1_API_TOKENS entry 1 (user ops): the token is a placeholder" in str(error.value)
    assert all(entry.split(":")[1] not in str(error.value) for entry in example.split(","))


@pytest.mark.parametrize("token", ["CHANGE-ME-0123456789abcdef", "0123456789abcdef_Change_Me", "xchangemex0123456789"])
def test_a_token_with_the_placeholder_mark_is_refused_in_any_spelling(token):
    with pytest.raises(ValueError) as error:
        auth.parse_entry(f"carol:{token}", where="ZERO1_API_TOKENS entry 3")
    assert str(error.value).startswith("ZERO1_API_TOKENS entry 3 (user carol): the token is a placeholder")
    assert token not in str(error.value)


def test_the_example_ray_token_stops_zero1_before_it_connects_to_ray(ray_cluster, tmp_path, monkeypatch):
    token = env_example()["RAY_AUTH_TOKEN"]
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    cluster = RayCluster(make_settings(tmp_path))
    with pytest.raises(ValueError) as error:
        cluster.connect()
    assert str(error.value).startswith("RAY_AUTH_TOKEN is a placeholder")
    assert token not in str(error.value) and not cluster.owned


def test_the_example_postgres_password_is_refused_before_connecting():
    password = env_example()["POSTGRES_PASSWORD"]
    url = f"postgresql+psycopg://zero1:{password}@127.0.0.1:5432/zero1_{secrets.token_hex(8)}"
    for open_database in (Database, upgrade):
        with pytest.raises(ValueError) as error:
            open_database(url)
        assert str(error.value).startswith("ZERO1_DATABASE_URL: the password is a placeholder"), error.value
        assert password not in str(error.value)


def test_serve_and_db_upgrade_refuse_the_example_env_as_it_is():
    """What the api container of `cp .env.example .env && docker compose up` runs, one placeholder at a time."""
    example = env_example()
    url = f"postgresql+psycopg://zero1:{example['POSTGRES_PASSWORD']}@127.0.0.1:5432/zero1_{secrets.token_hex(8)}"
    env = {**example, "ZERO1_DATABASE_URL": url, "RAY_AUTH_MODE": "token"}
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("ZERO1_", "RAY_AUTH"))}
    migrate = subprocess.run([ZERO1, "db", "upgrade"], env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert migrate.returncode == 2, migrate.stderr
    assert migrate.stderr.startswith("zero1 db upgrade: ZERO1_DATABASE_URL: the password is a placeholder")
    outputs = [migrate.stdout + migrate.stderr]
    steps = [
        ({}, "ZERO1_API_TOKENS entry 1 (user ops): the token is a placeholder"),
        ({"ZERO1_API_TOKENS": f"ops:{ROOT}:admin"}, "RAY_AUTH_TOKEN is a placeholder"),
        ({"RAY_AUTH_TOKEN": secrets.token_urlsafe(32)}, "ZERO1_DATABASE_URL: the password is a placeholder"),
    ]
    for replaced, refused in steps:  # each placeholder replaced in turn: the next one is refused
        env |= replaced
        out = _serve("--host", "0.0.0.0", "--port", "1", **env)
        assert out.returncode == 2 and out.stderr.startswith(f"zero1 serve: {refused}"), out.stderr
        outputs.append(out.stdout + out.stderr)
    placeholders = [part for value in example.values() for part in re.split("[:,]", value) if "change-me" in part]
    # the fifth, MINIO_ROOT_PASSWORD's, is refused by compose's minio-init (tests/test_deploy.py)
    assert len(placeholders) == 5 and not [p for p in placeholders if any(p in output for output in outputs)]


# --------------------------------------------------------------------------- data roots


def text_job(path: str) -> dict:
    return job_body(data={"kind": "text", "path": path})


def test_text_data_inside_a_root_is_admitted_by_its_real_path(secured, blocker, data_root):
    for path in (data_root / "corpus.txt", data_root / "alias.txt", data_root / "sub" / ".." / "corpus.txt"):
        (data_root / "sub").mkdir(exist_ok=True)
        dry = secured.post("/v1/jobs", json=text_job(str(path)), params={"dry_run": "true"}, headers=bearer(BOB))
        assert dry.status_code == 200, dry.text
    job = submit(secured, BOB, data={"kind": "text", "path": str(data_root / "alias.txt")})
    try:  # the workers read the very file that was checked
        assert job["spec"]["data"]["path"] == os.path.realpath(data_root / "corpus.txt")
    finally:
        cancel_all(secured, [job])


@pytest.mark.parametrize("name", ["../secret.txt", "escape.txt", "../root/../secret.txt", "/etc/hostname"])
def test_text_data_outside_the_roots_is_refused(secured, data_root, name):
    path = name if name.startswith("/") else str(data_root / name)
    response = secured.post("/v1/jobs", json=text_job(path), params={"dry_run": "true"}, headers=bearer(BOB))
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["message"] == (
        f"data.path: {path!r} is outside the data roots {[str(data_root)]} (ZERO1_DATA_ROOTS; symlinks are followed)"
    )
    assert body["detail"][0]["field"] == "data.path"


def test_a_missing_file_inside_a_root_is_refused(secured, data_root):
    path = str(data_root / "nope.txt")
    response = secured.post("/v1/jobs", json=text_job(path), params={"dry_run": "true"}, headers=bearer(BOB))
    assert response.status_code == 422 and response.json()["message"] == f"data.path: no such file: {path!r}"


# --------------------------------------------------------------------------- request size


LIMIT = 1 << 20  # the default ZERO1_MAX_REQUEST_BYTES


def test_a_body_over_the_limit_is_413_by_its_content_length(secured):
    response = secured.post("/v1/jobs", content=b" " * (LIMIT + 1), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {
        "error": "request_too_large",
        "message": f"the request body is over the limit of {LIMIT} bytes (ZERO1_MAX_REQUEST_BYTES)",
    }


def _chunks(total_bytes: int, *, head: bytes = b"") -> object:
    yield head
    sent = len(head)
    while sent < total_bytes:
        chunk = b" " * min(64 * 1024, total_bytes - sent)
        sent += len(chunk)
        yield chunk


def test_a_streamed_body_without_content_length_is_counted(secured):
    response = secured.post(
        "/v1/jobs", content=_chunks(LIMIT + 1), headers={**bearer(ALICE), "Content-Type": "application/json"}
    )
    assert "content-length" not in response.request.headers
    assert response.status_code == 413 and response.json()["error"] == "request_too_large"
    assert f"limit of {LIMIT} bytes" in response.json()["message"]
    at_limit = secured.post(
        "/v1/jobs", content=_chunks(LIMIT, head=b"{}"), headers={**bearer(ALICE), "Content-Type": "application/json"}
    )
    assert at_limit.status_code == 422 and "name: Field required" in at_limit.json()["message"]


# --------------------------------------------------------------------------- the CLI and `zero1 serve`


class _ViaTestClient:
    """Stands in for httpx.Client in the CLI: its requests go to the test app with the headers it was given."""

    def __init__(self, app_client: TestClient, headers: dict):
        self.app_client = app_client
        self.headers = headers

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None

    def close(self) -> None:
        return None

    def get(self, url, **kwargs):
        return self.app_client.get(url, headers=self.headers, **kwargs)

    def post(self, url, **kwargs):
        return self.app_client.post(url, headers=self.headers, **kwargs)


def test_the_cli_sends_zero1_token(secured, blocker, monkeypatch, capsys):
    monkeypatch.setattr(httpx, "Client", lambda *, base_url, timeout, headers: _ViaTestClient(secured, headers))
    job = submit(secured, ALICE, name="cli")
    try:
        monkeypatch.delenv("ZERO1_TOKEN", raising=False)
        assert main(["jobs"]) == 1 and "401 this endpoint needs an API token" in capsys.readouterr().err
        monkeypatch.setenv("ZERO1_TOKEN", BOB)
        assert main(["jobs"]) == 0 and f"{job['id']:>6}  queued" in capsys.readouterr().out
        assert main(["status", str(job["id"])]) == 0  # the shared view, without alice's events
        status = capsys.readouterr().out
        assert '"owner": "alice"' in status and "submitted" not in status
        assert main(["cancel", str(job["id"])]) == 1
        assert f"403 job {job['id']} belongs to alice" in capsys.readouterr().err
        monkeypatch.setenv("ZERO1_TOKEN", ALICE)
        assert main(["cancel", str(job["id"])]) == 0 and "(cancelled)" in capsys.readouterr().out
    finally:
        cancel_all(secured, [job])


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("", False),
        ("example.com", False),
    ],
)
def test_only_loopback_is_served_without_tokens(host, loopback):
    assert is_loopback(host) is loopback
    no_tokens = load_tokens(make_settings(Path("/nonexistent")))
    if loopback:
        check_bind(host, tokens=no_tokens)
    else:
        with pytest.raises(ValueError, match="ZERO1_API_TOKENS .* or ZERO1_API_TOKENS_FILE"):
            check_bind(host, tokens=no_tokens)
    check_bind(host, tokens=load_tokens(make_settings(Path("/nonexistent"), api_tokens=TOKENS)))


def _serve(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("ZERO1_")}
    return subprocess.run([ZERO1, "serve", *args], env={**clean, **env}, capture_output=True, text=True, timeout=60)


def test_serve_refuses_a_public_address_without_tokens():
    out = _serve("--host", "0.0.0.0", "--port", "1")
    assert out.returncode == 2
    assert out.stderr.startswith("zero1 serve: refusing to bind '0.0.0.0' without API tokens")
    assert "ZERO1_API_TOKENS" in out.stderr and "ZERO1_API_TOKENS_FILE" in out.stderr
    assert "Uvicorn running" not in out.stderr + out.stdout
    by_env = _serve(ZERO1_HOST="::")
    assert by_env.returncode == 2 and "refusing to bind '::'" in by_env.stderr


def test_serve_names_a_malformed_token_entry_without_printing_it():
    out = _serve("--host", "0.0.0.0", ZERO1_API_TOKENS=f"alice:{ALICE},bob-no-token")
    assert out.returncode == 2
    assert "ZERO1_API_TOKENS entry 2: expected user:token or user:token:admin" in out.stderr
    assert ALICE not in out.stderr + out.stdout


# --------------------------------------------------------------------------- the dashboard in a browser

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def served(secured) -> str:
    """The secured app over real HTTP on loopback (its runtime is the test client's: lifespan off)."""
    import threading

    import uvicorn

    config = uvicorn.Config(secured.app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # poll until it listens, with a deadline
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_the_dashboard_logs_in_and_cancels_a_job_with_its_cookie(secured, blocker, served):
    """Chromium: a page without a token goes to /login and back; the Cancel button works by the cookie."""
    if not CHROMIUM.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)", pytrace=False)
        pytest.skip(f"{CHROMIUM} is missing")
    from playwright.sync_api import expect, sync_playwright

    job = submit(secured, ALICE, name="cancel me in a browser")
    errors: list[str] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox"])
            try:
                page = browser.new_page(base_url=served)
                page.on("pageerror", lambda error: errors.append(str(error)))
                page.on("dialog", lambda dialog: dialog.accept())  # "Cancel job #…?"
                page.goto(f"/jobs/{job['id']}")
                expect(page).to_have_url(f"{served}/login?next=%2Fjobs%2F{job['id']}")
                page.fill("#token", ALICE)
                page.click("#login-form button[type=submit]")
                expect(page).to_have_url(f"{served}/jobs/{job['id']}")
                expect(page.locator(".who span")).to_have_text("alice")
                expect(page.locator('[data-field="owner"]')).to_have_text("alice")
                page.click("#cancel")
                expect(page.locator("#cancel-note")).to_contain_text("Cancel requested")
            finally:
                browser.close()
        assert secured.get(f"/v1/jobs/{job['id']}", headers=bearer(ALICE)).json()["status"] == "cancelled"
        assert errors == []
    finally:
        cancel_all(secured, [job])
