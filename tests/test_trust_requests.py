"""Issue 27, what a request may ask of the service: data globs bounded and silent about what lies outside
the data roots (item 3), control characters refused in names and shown escaped wherever the CLI or
the dashboard prints user text (item 8), wrong bearer tokens locking their client out as /login's do
(item 9), and dashboard ids beyond the database's integers not found (item 10).

Packages: service.api, service.schemas, service.lockout.
"""

from __future__ import annotations

import io
import os
import secrets
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from service.cli import jobs as cli_jobs
from service.cli import main
from service.lockout import LoginLockout
from service.store.tables import Job, JobEvent, LogLine
from workers.data import datafiles
from workers.data.datafiles import MAX_RESOLVE_S, resolve_files
from zero1 import Client

from conftest import make_settings, serve, serve_on_fakes
from figures import record
from helpers import TERMINAL, bearer, job_body, wait_job

ALICE, ROOT = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "root"))
TOKENS = f"alice:{ALICE},root:{ROOT}:admin"
OWNED = "\x1b]0;OWNED-TITLE\x07\x1b[2J\x1b[Hpwned\x9b31m\x7f"
"""What a user may try to send another's terminal: a new title, a cleared screen, a C1 CSI, a DEL."""
SHOWN = "\\x1b]0;OWNED-TITLE\\x07\\x1b[2J\\x1b[Hpwned\\x9b31m\\x7f"
"""The same, as the CLI and the dashboard print it."""


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict[str, Path]:
    """A data root of three directories (a holds f.txt), and beside it a home with a token file, which
    links in the root reach: a file link, a directory link, and a directory of two links back up."""
    base = tmp_path_factory.mktemp("trust")
    root = base / "root"
    home = base / "home"
    for name in ("a", "b", "c"):
        (root / name).mkdir(parents=True)
    (root / "a" / "f.txt").write_text("to be or not to be " * 50)
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("the cluster's token")
    (root / "c" / "tok").symlink_to(home / ".ray" / "auth_token")
    (root / "out").symlink_to(home / ".ray")
    (root / "loops").mkdir()
    (root / "loops" / "x").symlink_to(root / "loops")
    (root / "loops" / "y").symlink_to(root / "loops")
    return {"root": root, "home": home}


@pytest.fixture(scope="module")
def trusted(tmp_path_factory, tree):
    """The app with two tokens (root an admin) and the tree's data root, on stand-ins for Ray."""
    settings = make_settings(tmp_path_factory.mktemp("app"), api_tokens=TOKENS, data_roots=[str(tree["root"])])
    with serve_on_fakes(settings) as client:
        yield client


def dataset(path: str, **fields) -> dict:
    return {"kind": "dataset", "format": "text", "path": path, "tokenizer": "bytes", **fields}


def dry_run(client: TestClient, **overrides) -> httpx.Response:
    return client.post("/v1/jobs", params={"dry_run": "true"}, json=job_body(**overrides), headers=bearer(ALICE))


# --------------------------------------------------------------------------- item 3: globs


@pytest.mark.parametrize("k", [10, 800])
def test_a_glob_of_dot_dot_components_is_a_422_at_once(trusted, tree, k, monkeypatch):
    """`*/../` k times visits 3^k paths under three directories: 2 s at k = 9 before, and k = 800 fits the
    4,096-character bound. Now refused before a directory is read."""
    path = f"{tree['root']}/{'*/../' * k}a/f.txt"
    listed: list[str] = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda directory=".": listed.append(str(directory)) or scandir(directory))
    response = dry_run(trusted, data=dataset(path))
    monkeypatch.undo()
    assert response.status_code == 422, response.text
    assert response.json()["message"].startswith(f"data.path: {path!r}: a glob may not have '.' or '..' components")
    assert [directory for directory in listed if directory.startswith(str(tree["root"]))] == []
    record("a glob of `*/../` components (item 3)", tried=1, refused=1)


def outside_paths(tree: dict[str, Path]) -> list[tuple[dict, str]]:
    """(data, the start of the 422's message) of every way the tree offers to reach the home's token file."""
    root = tree["root"]
    roots = f"the data roots [{str(root)!r}] (ZERO1_DATA_ROOTS; symlinks are followed)"
    relative = "../" * len(root.parts) + str(tree["home"]).lstrip("/")  # from the root up to / and down
    return [
        (dataset(f"{root}/*/{relative}/.ray/*"), "a glob may not have '.' or '..' components"),
        (dataset(f"{root}/c/*"), f"matches {root}/c/tok, which resolves outside {roots}"),
        (dataset(f"{root}/out/*"), f"the glob's directory '{root}/out' is outside {roots}"),
        (dataset(f"{root}/c/tok"), f"resolves outside {roots}"),
        (dataset(f"{root}/a/f.txt", tokenizer=f"{root}/c/tok"), "resolves outside the data roots"),
        (dataset(f"{root}/out", format="text"), "resolves outside"),
    ]


def test_no_refusal_names_a_path_outside_the_data_roots(trusted, tree):
    """Before, `<root>/*/../../<home>/.ray/*` answered `… matches …/.ray/auth_token, which resolves to
    ~/.ray/auth_token`: a listing of the service's files, one 422 at a time."""
    for data, message in outside_paths(tree):
        response = dry_run(trusted, data=data)
        assert response.status_code == 422, (data, response.text)
        text = response.json()["message"]
        assert message in text and text.startswith(("data.path: ", "data.tokenizer: ")), (data, text)
        assert "auth_token" not in text and str(tree["home"]) not in text.replace(data["path"], ""), text
    record("a glob fishing for paths outside the roots (item 3)", tried=1, refused=1)


class WalkClock:
    """time for workers.data.datafiles: a monotonic() that moves TICK_S at each reading, so that a walk
    reaches MAX_RESOLVE_S after a fixed number of readings, whatever the machine's speed. Its readings
    are kept."""

    TICK_S = 1 / 256  # a power of two: the readings and the deadline add up exactly

    def __init__(self) -> None:
        self.readings: list[float] = []

    def monotonic(self) -> float:
        self.readings.append(len(self.readings) * self.TICK_S)
        return self.readings[-1]


def test_a_glob_through_links_that_loop_stops_at_the_time_bound(trusted, tree, monkeypatch):
    """Two links back up make `*/` k times visit 2^k directories with no `..` at all: the walk stops at
    MAX_RESOLVE_S, or at MAX_CANDIDATES entries, with a 422 naming the field. On a clock the walk moves
    itself, it stops at the first reading past its deadline and reads the clock no more."""
    clock = WalkClock()
    monkeypatch.setattr(datafiles, "time", clock)
    path = f"{tree['root']}/loops/{'*/' * 40}f.txt"
    response = dry_run(trusted, data=dataset(path))
    monkeypatch.undo()
    assert response.status_code == 422, response.text
    message = response.json()["message"]
    assert message.startswith(f"data.path: {path!r} took more than {MAX_RESOLVE_S:g} s to resolve ("), message
    assert message.endswith("directory entries visited); name fewer directories"), message
    deadline = clock.readings[0] + MAX_RESOLVE_S
    assert [reading > deadline for reading in clock.readings].index(True) == len(clock.readings) - 1
    record("a glob through looping links (item 3)", tried=1, refused=1)


def test_every_entry_a_glob_visits_counts_matched_or_not(tmp_path):
    """Before, only matched files counted (toward MAX_FILES): a glob that matches nothing walked on."""
    for i in range(30):
        (tmp_path / f"d{i}").mkdir()
        for j in range(10):
            (tmp_path / f"d{i}" / f"{j}.txt").write_text("x")
    roots = [str(tmp_path)]
    with pytest.raises(ValueError, match=r"matches no jsonl files"):
        resolve_files(f"{tmp_path}/*/*.jsonl", format="jsonl", roots=roots, max_candidates=330)  # 30 + 300
    with pytest.raises(ValueError, match=r"^data\.path: .* visits more than 329 directory entries \(matched or not\)"):
        resolve_files(f"{tmp_path}/*/*.jsonl", format="jsonl", roots=roots, max_candidates=329)
    with pytest.raises(ValueError, match=r"^data\.path: .* visits more than 299 directory entries"):
        resolve_files(str(tmp_path), format="jsonl", roots=roots, max_candidates=299)  # a directory's walk too
    assert len(resolve_files(f"{tmp_path}/d1?/*.txt", format="text", roots=roots)) == 100  # d10 to d19


# --------------------------------------------------------------------------- item 8: control characters


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("name", {"name": OWNED}),
        ("name", {"name": "tab\there"}),
        ("name", {"name": "line\nbreak"}),
        ("name", {"name": "csi\x9b2J"}),
        ("name", {"name": "del\x7f"}),
        ("data.path", {"data": {"kind": "text", "path": "a\x1b[2J.txt"}}),
    ],
)
def test_control_characters_in_a_name_or_path_are_a_422_naming_the_field(trusted, field, overrides):
    response = dry_run(trusted, **overrides)
    assert response.status_code == 422, response.text
    assert response.json()["message"].startswith(f"{field}: must not contain a control character ("), response.text
    record("control characters in a name or path (item 8)", tried=1, refused=1)


@pytest.fixture(scope="module")
def owned(trusted) -> int:
    """alice's job as a row stored before the rule would be: named OWNED, with a log line, an event and an
    error that carry it too (a rank may print escapes; its traceback may quote them)."""
    job = trusted.post("/v1/jobs", json=job_body(steps=1_000_000), headers=bearer(ALICE)).json()
    trusted.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(ALICE))
    wait_job(trusted, job["id"], lambda j: j["status"] in TERMINAL, headers=bearer(ALICE))
    with trusted.app.state.runtime.db.session() as session:
        row = session.get(Job, job["id"])
        row.name = OWNED
        row.error = {"exception": "RuntimeError", "message": f"rank 0 printed {OWNED}\nthen failed"}
        session.add(JobEvent(job_id=row.id, from_status="cancelled", to_status="cancelled", reason=f"why {OWNED}"))
        session.add(LogLine(job_id=row.id, attempt=0, rank=0, stream="stdout", line=f"out\t{OWNED}"))
    return job["id"]


@pytest.fixture
def cli_on(trusted, monkeypatch):
    """The CLI's commands talk to the app (its transport) as root, the admin who reads everyone's jobs."""

    def through_the_app(request: httpx.Request) -> httpx.Response:
        # the app's answer, read whole (a log stream ends with its job's end)
        response = trusted.request(request.method, str(request.url), headers=request.headers, content=request.read())
        return httpx.Response(response.status_code, headers=response.headers, content=response.read())

    def client(args, *, timeout_s: float = 30) -> Client:
        transport = httpx.MockTransport(through_the_app)
        return Client(http=httpx.Client(base_url="http://testserver", headers=bearer(ROOT), transport=transport))

    monkeypatch.setattr(cli_jobs, "_client", client)


@pytest.mark.parametrize(
    ("argv", "stream"),
    [
        (["jobs"], "out"),
        (["status", "{id}"], "out"),
        (["logs", "{id}"], "out"),
        (["logs", "-f", "{id}"], "out"),
    ],
    ids=["jobs", "status", "logs", "logs -f"],
)
def test_the_cli_prints_user_text_with_its_control_characters_escaped(owned, cli_on, capsys, argv, stream):
    """`zero1 jobs` printed the name as it is, `status` the event's reason, `logs` the rank's line."""
    main([arg.format(id=owned) for arg in argv])
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x9b" not in out + err and "\x07" not in out + err
    assert SHOWN in (out if stream == "out" else err), (out, err)
    record("terminal escapes printed by the CLI (item 8)", tried=1, refused=1)


class Terminal(io.StringIO):
    """A stream that says it is a tty: what rich draws on, captured."""

    def isatty(self) -> bool:
        return True


def test_the_jobs_table_on_a_terminal_escapes_the_name(owned, cli_on, monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert main(["jobs"]) == 0
    drawn = sys.stdout.getvalue()
    assert "\x1b]" not in drawn and "\x1b[2J" not in drawn and "\x07" not in drawn  # rich's colours stay
    assert "OWNED-TITLE" in drawn


@pytest.mark.parametrize("path", ["/", "/jobs/{id}"])
def test_the_dashboard_writes_user_text_with_its_control_characters_escaped(trusted, owned, path):
    page = trusted.get(path.format(id=owned), headers=bearer(ROOT))
    assert page.status_code == 200
    assert not any(c in page.text for c in "\x1b\x07\x9b\x7f"), page.text
    assert SHOWN in page.text
    record("terminal escapes on the dashboard (item 8)", tried=1, refused=1)


# --------------------------------------------------------------------------- item 9: bearer tokens


def test_wrong_bearer_tokens_lock_their_client_out_until_the_window_passes(trusted):
    """Before, 30 wrong tokens were 30 x 401 and no 429. Now the 11th try within a minute is a 429 with
    Retry-After, a valid token included, by header or cookie, until the oldest failure is a minute old;
    another address is not locked out."""
    now_s = [1000.0]
    authenticator = trusted.app.state.authenticator
    saved = authenticator.lockout
    authenticator.lockout = LoginLockout(clock=lambda: now_s[0])
    guesser = TestClient(trusted.app, client=("198.51.100.7", 40000))
    try:
        for _ in range(10):
            now_s[0] += 1
            assert guesser.get("/v1/jobs", headers=bearer("w" * 40)).status_code == 401
        wait_s = int(1001 + 60 - now_s[0])
        for headers, cookie in ((bearer("w" * 40), None), (bearer(ROOT), None), ({}, ROOT)):
            guesser.cookies.clear()
            if cookie is not None:
                guesser.cookies.set("zero1_token", cookie)
            locked = guesser.get("/v1/jobs", headers=headers)
            assert locked.status_code == 429 and locked.headers["retry-after"] == str(wait_s), locked.text
            assert locked.json()["error"] == "too_many_failures"
            assert f"10 wrong tokens within 60 s from this address: try again in {wait_s} s" in locked.json()["message"]
            assert ROOT not in locked.text
        elsewhere = TestClient(trusted.app, client=("203.0.113.8", 40000))
        assert elsewhere.get("/v1/jobs", headers=bearer(ROOT)).status_code == 200
        now_s[0] += wait_s
        assert guesser.get("/v1/jobs", headers=bearer(ROOT)).status_code == 200
    finally:
        authenticator.lockout = saved
    record("bearer tokens guessed at full speed (item 9)", tried=1, refused=1)


def test_the_api_and_the_login_form_count_failures_together(trusted):
    """One lockout, however the tokens come: 5 wrong at /login and 5 wrong by header lock the client out."""
    guesser = TestClient(trusted.app, client=("198.51.100.8", 40000))
    assert trusted.app.state.login_lockout is trusted.app.state.authenticator.lockout
    for _ in range(5):
        assert guesser.post("/login", data={"token": "w" * 32}, follow_redirects=False).status_code == 401
        assert guesser.get("/v1/cluster", headers=bearer("w" * 40)).status_code == 401
    locked = guesser.get("/v1/cluster", headers=bearer(ROOT))
    assert locked.status_code == 429 and 0 < int(locked.headers["retry-after"]) <= 60
    assert guesser.post("/login", data={"token": ROOT}, follow_redirects=False).status_code == 429


def test_the_lockout_is_a_setting(ray_cluster, tmp_path):
    settings = make_settings(tmp_path, api_tokens=TOKENS, auth_max_failures=2, auth_failure_window_s=5)
    with serve(settings) as client:
        assert [client.get("/v1/jobs", headers=bearer("w" * 40)).status_code for _ in range(3)] == [401, 401, 429]
        assert client.get("/v1/jobs", headers=bearer(ALICE)).headers["retry-after"] in ("4", "5")


# --------------------------------------------------------------------------- item 10: ids


def test_ids_no_job_can_have_are_not_found_on_the_dashboard_and_4xx_on_the_api(ray_cluster, tmp_path, database_url):
    """Before, GET /jobs/99999999999999999999 was a 500 (the driver's integer overflow)."""
    with serve(make_settings(tmp_path, database_url=database_url, api_tokens=TOKENS)) as client:
        for job_id in (
            "99999999999999999999",
            str(2**63),
            str(2**63 - 1),
            "0",
            "-1",
            "abc",
            "1e3",
            "٣",
            "0" * 40 + "1",
        ):
            page = client.get(f"/jobs/{job_id}", headers=bearer(ROOT))
            assert page.status_code == 404 and "Not found" in page.text, (job_id, page.status_code, page.text)
        for path in ("/v1/jobs/99999999999999999999", "/v1/jobs/99999999999999999999/logs"):
            response = client.get(path, headers=bearer(ROOT))
            assert response.status_code == 422 and response.json()["message"].startswith("job_id: "), response.text
    record("ids beyond the database's integers (item 10)", tried=1, refused=1)
