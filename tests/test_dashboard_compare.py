"""The experiment pages: jobs side by side (/compare?jobs=), a sweep (/sweeps/{id}) and the sweeps' list.

Over HTTP (a TestClient) and in Chromium (Playwright, headless, Debian's /usr/bin/chromium), on one app
on stand-ins for Ray (conftest's serve_on_fakes) whose scheduler ticks only when a test says, served
over loopback by uvicorn for the browser. Jobs get their metric rows and their end from the test, as
tests/test_sweeps.py gives them. The module's jobs and sweeps add up: each test names those it made.

Packages: service.dashboard, service.api, service.scheduling.
"""

from __future__ import annotations

import html
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import FakeClock, tick
from fastapi.testclient import TestClient
from playwright.sync_api import expect, sync_playwright
from sqlalchemy import update

from service.auth import TOKEN_COOKIE
from service.dashboard.experiments import MAX_COMPARED, differing_fields, flatten
from service.schemas.fields import TERMINAL
from service.store.metric_rows import store_metrics
from service.store.tables import Job, Metric
from workers.records import AttemptPoll, AttemptStatus, MetricRow

import helpers
from conftest import make_settings, serve_on_fakes
from helpers import bearer
from marks import starts

ALICE = "alice-token-of-the-compare-tests-0123456789"
BOB = "bob-token-of-the-compare-tests-0123456789"
ROOT = "root-token-of-the-compare-tests-0123456789"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
EXPECT_TIMEOUT_MS = 60_000
"""A bound on each wait (a busy machine), not a measure: an assertion that holds returns at once."""
STEPS = 10
EVAL_STEPS = (4, 9)


# --------------------------------------------------------------------------- the app


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[TestClient]:
    """The app on 4 logical GPUs, ticked by the tests; alice's token by default, bob's and root's (admin) too."""
    tokens = f"alice:{ALICE},bob:{BOB},root:{ROOT}:admin"
    settings = make_settings(tmp_path_factory.mktemp("compare"), api_tokens=tokens)
    with serve_on_fakes(settings) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.launcher.clock = FakeClock()
        client.headers["Authorization"] = f"Bearer {ALICE}"
        yield client


def row(step: int, *, scale: float) -> MetricRow:
    return MetricRow(
        step=step, loss=scale * 4.0 / (1 + step), grad_norm=1.0, loss_scale=1.0, skipped=False, step_time_s=0.1,
        tokens_per_s=1.0, mem_peak_bytes=(1,), mem_planned_bytes=1, lr=scale * 1e-3,
        eval_loss=scale * 4.5 / (1 + step) if step in EVAL_STEPS else None,
    )  # fmt: skip


def train(api: TestClient, job_id: int, *, scale: float, end: AttemptStatus | None = AttemptStatus.SUCCEEDED) -> None:
    """The job's STEPS rows (its loss and eval loss `scale` times the others'), and its attempt ended `end`
    (None: it runs on), ticked into the database."""
    runtime = api.app.state.runtime
    with runtime.db.session() as session:
        job = session.get(Job, job_id)
        store_metrics(session, job, [row(step, scale=scale) for step in range(STEPS)])
        attempt = job.attempt
    if end is not None:
        runtime.launcher.attempts[(job_id, attempt)].ended = AttemptPoll(status=end, nodes=("node-0",))
    tick(api, 2)


def submit(api: TestClient, token: str, **overrides) -> dict:
    response = api.post("/v1/jobs", json=helpers.job_body(num_gpus=1, **overrides), headers=bearer(token))
    assert response.status_code == 201, response.text
    return response.json()


def end_all(api: TestClient) -> None:
    """Every job still running ends, so that the next test's jobs find the GPUs free."""
    for job in api.get("/v1/jobs", params={"limit": 500}, headers=bearer(ROOT)).json()["data"]:
        if job["status"] in ("starting", "running"):
            api.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(ROOT))
    tick(api, 2)


def chart_data(page_html: str) -> dict:
    """What the page hands charts.js: its #chart-data JSON."""
    found = re.search(r'<script type="application/json" id="chart-data">(.*?)</script>', page_html, re.S)
    assert found, page_html[-2000:]
    return json.loads(found.group(1))


@pytest.fixture(scope="module")
def compared(api) -> dict:
    """alice's two finished jobs that differ in optimizer.lr alone (besides their names), one of whose last
    two rows are superseded; bob's job, which alice may not see."""
    first = submit(api, ALICE, name="lr-small", optimizer={**helpers.FAST, "lr": 0.001})
    second = submit(api, ALICE, name="lr-large", optimizer={**helpers.FAST, "lr": 0.01})
    hidden = submit(api, BOB, name="bobs-secret-run")
    tick(api, 2)
    train(api, first["id"], scale=1.0)
    train(api, second["id"], scale=1.5)
    train(api, hidden["id"], scale=2.0)
    with api.app.state.runtime.db.session() as session:  # as a relaunch from step 8 marks them
        session.execute(update(Metric).where(Metric.job_id == second["id"], Metric.step >= 8).values(superseded=True))
    return {"first": first["id"], "second": second["id"], "hidden": hidden["id"]}


# --------------------------------------------------------------------------- the differing fields


def test_a_spec_flattens_by_dotted_path_and_only_the_paths_whose_values_differ_are_rows():
    spec = {"name": "a", "optimizer": {"lr": 0.001, "schedule": {"warmup_steps": 0}}, "steps": 10, "tags": ["x"]}
    assert flatten(spec) == {
        "name": "a", "optimizer.lr": 0.001, "optimizer.schedule.warmup_steps": 0, "steps": 10, "tags": ["x"],
    }  # fmt: skip
    other = {**spec, "name": "b", "optimizer": {"lr": 0.01, "schedule": {"warmup_steps": 0}}, "seed": 3}
    assert differing_fields([spec, other]) == [("optimizer.lr", ["0.001", "0.01"]), ("seed", ["—", "3"])]
    assert differing_fields([spec, {**spec, "name": "c", "steps": 10.0}]) == []  # 10 == 10.0; names head columns
    assert differing_fields([spec, {**spec, "tags": ["y"]}]) == [("tags", ['["x"]', '["y"]'])]


def test_the_compare_page_shows_the_differing_fields_and_leaves_out_what_the_reader_may_not_see(api, compared):
    ids = [compared["first"], compared["second"], compared["hidden"], 999_999, "abc"]
    page = api.get("/compare", params={"jobs": ",".join(map(str, ids))})
    assert page.status_code == 200, page.text
    text = page.text
    assert re.findall(r'<tr data-path="([^"]+)">', text) == ["optimizer.lr"]  # steps, seed, model: the same
    assert "bobs-secret-run" not in text and f"/jobs/{compared['hidden']}" not in text
    assert "3 jobs not shown." in text
    data = chart_data(text)
    assert [s["label"] for s in data["series"]] == [
        f"job {compared['first']} lr-small",
        f"job {compared['second']} lr-large",
    ]
    first, second = data["series"]
    assert first["steps"] == list(range(STEPS)) and first["eval_steps"] == list(EVAL_STEPS)
    assert second["steps"] == list(range(8)) and second["eval_steps"] == [4]  # the superseded rows are not drawn
    assert second["lr"] == [pytest.approx(1.5e-3)] * 8

    bob = api.get("/compare", params={"jobs": f"{compared['first']},{compared['hidden']}"}, headers=bearer(BOB))
    assert "lr-small" not in bob.text and "bobs-secret-run" in bob.text and "1 job not shown." in bob.text
    assert [s["job_id"] for s in chart_data(bob.text)["series"]] == [compared["hidden"]]
    admin = api.get("/compare", params={"jobs": f"{compared['first']},{compared['hidden']}"}, headers=bearer(ROOT))
    assert len(chart_data(admin.text)["series"]) == 2 and "not shown" not in admin.text


def test_the_compare_page_draws_at_most_max_compared_jobs_and_says_so(api, compared):
    asked = [compared["first"]] + list(range(10_000, 10_000 + MAX_COMPARED))
    page = api.get("/compare", params={"jobs": ",".join(map(str, asked))})
    assert f"the first {MAX_COMPARED} of the {MAX_COMPARED + 1} asked for" in page.text
    assert len(chart_data(page.text)["series"]) == 1
    assert f"{MAX_COMPARED - 1} jobs not shown." in page.text  # of the first twelve, eleven are no job
    assert "No job to compare" in api.get("/compare").text


# --------------------------------------------------------------------------- a sweep


SPACE = {"optimizer.lr": [0.0003, 0.03], "optimizer.schedule.warmup_steps": [0, 10]}
SCALES = {0: 1.2, 1: 1.0, 2: 1.4}
"""Trial -> its curve's scale (its last eval loss 0.45 times it); trial 3 runs on without a row."""


@pytest.fixture(scope="module")
def sweep(api, compared) -> dict:
    """alice's grid of 4 trials, all running at once: trials 0-2 trained and succeeded (trial 1 the best),
    trial 3 running with no row yet."""
    end_all(api)
    body = {"name": "lr-grid", "base": helpers.job_body(num_gpus=1), "space": SPACE, "max_concurrent": 4}
    created = api.post("/v1/sweeps", json=body)
    assert created.status_code == 201, created.text
    tick(api, 2)
    trials = api.get(f"/v1/sweeps/{created.json()['id']}").json()["trials"]
    assert all(t["job_id"] for t in trials), trials
    for trial in trials:
        if trial["index"] in SCALES:
            train(api, trial["job_id"], scale=SCALES[trial["index"]])
    shown = api.get(f"/v1/sweeps/{created.json()['id']}").json()
    assert shown["best"]["index"] == 1 and shown["status"] == "running", shown
    return shown


def test_a_sweep_page_is_its_owners_and_admins_only(api, sweep):
    assert api.get(f"/sweeps/{sweep['id']}").status_code == 200
    assert api.get(f"/sweeps/{sweep['id']}", headers=bearer(ROOT)).status_code == 200
    for path, headers in [
        (f"/sweeps/{sweep['id']}", bearer(BOB)),
        ("/sweeps/999999", {}),
        ("/sweeps/abc", {}),
        ("/sweeps/99999999999999999999999", {}),
    ]:
        page = api.get(path, headers=headers)
        assert page.status_code == 404, (path, page.text)
        assert "lr-grid" not in page.text and "Not found" in page.text
    assert "lr-grid" not in api.get("/sweeps", headers=bearer(BOB)).text
    assert f'href="/sweeps/{sweep["id"]}"' in api.get("/sweeps").text


def test_a_sweep_page_gives_each_trial_its_curve_and_each_searched_field_its_scatter(api, sweep):
    text = api.get(f"/sweeps/{sweep['id']}").text
    data = chart_data(text)
    jobs = {t["index"]: t["job_id"] for t in sweep["trials"]}
    assert [s["label"] for s in data["series"]] == [f"trial {i} · job {jobs[i]}" for i in sorted(SCALES)]
    assert data["overlays"] == [{"figure": "trials-figure", "steps": "eval_steps", "values": "eval_loss"}]
    by_path = {s["path"]: s for s in data["scatters"]}
    assert list(by_path) == list(SPACE)
    lr = by_path["optimizer.lr"]
    assert lr["log"] is True and lr["categories"] is None  # 0.03 / 0.0003: a hundredfold
    assert by_path["optimizer.schedule.warmup_steps"]["log"] is False  # 0 is no value for a log scale
    assert sorted((p["trial"], p["best"]) for p in lr["points"]) == [(0, False), (1, True), (2, False)]
    assert {p["trial"]: p["y"] for p in lr["points"]} == pytest.approx({i: s * 4.5 / 10 for i, s in SCALES.items()})
    assert re.findall(r'<tr data-index="(\d+)" class="best"', text) == ["1"]
    assert f'href="/compare?jobs={",".join(str(jobs[i]) for i in range(4))}"' in html.unescape(text)


# --------------------------------------------------------------------------- in Chromium


@pytest.fixture(scope="module")
def served(api) -> Iterator[str]:
    """The module's app over real HTTP on loopback (its runtime is the test client's: lifespan off)."""
    import uvicorn

    config = uvicorn.Config(api.app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
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


class Pages:
    """alice's pages in Chromium: every request is routed through the test, which lets only the served origin's
    through (and notes any other); every console error and uncaught page error is kept."""

    def __init__(self, browser, base: str):
        self.base = base
        self.context = browser.new_context(base_url=base, viewport={"width": 1280, "height": 900})
        self.context.add_cookies([{"name": TOKEN_COOKIE, "value": ALICE, "url": base}])
        self.requests: list[str] = []
        self.elsewhere: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)

    def _route(self, route) -> None:
        url = route.request.url
        self.requests.append(url)
        if url.startswith(self.base + "/"):
            route.continue_()
        else:
            self.elsewhere.append(url)
            route.abort()

    def open(self, path: str):
        page = self.context.new_page()
        page.on("console", lambda m: m.type == "error" and self.errors.append(f"console.error: {m.text}"))
        page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        page.goto(path)
        return page

    def check(self) -> None:
        """Nothing left the server, uPlot came from it, and no script failed."""
        assert self.requests and self.elsewhere == [], self.elsewhere
        assert any("/static/vendor/uplot/uPlot.iife.min.js" in url for url in self.requests)
        assert self.errors == [], self.errors


@pytest.fixture(scope="module")
@starts("browser")
def browser():
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def pages(browser, served) -> Iterator[Pages]:
    opened = Pages(browser, served)
    yield opened
    opened.context.close()


def _uplot(figure: str) -> str:
    return f"document.querySelector('#{figure} .u-chart').uplot"


def _labels(page, figure: str) -> list[str]:
    """The labels of a figure's uPlot series, the x series (index 0) left out."""
    return page.evaluate(f"{_uplot(figure)}.series.slice(1).map((s) => s.label)")


def _drawn(page, figure: str, index: int) -> list:
    return page.evaluate(f"{_uplot(figure)}.data[{index}]")


def _wait_drawn(page, count: int) -> None:
    page.wait_for_function(f"document.body.dataset.drawn == {count}", timeout=EXPECT_TIMEOUT_MS)


def test_in_chromium_the_compare_page_overlays_one_series_a_job_and_leaves_out_anothers(pages, compared):
    page = pages.open(f"/compare?jobs={compared['first']},{compared['hidden']},{compared['second']}")
    _wait_drawn(page, 3)
    labels = [f"job {compared['first']} lr-small", f"job {compared['second']} lr-large"]
    for figure in ("loss-figure", "eval-figure", "lr-figure"):
        assert _labels(page, figure) == labels, figure
        expect(page.locator(f"#{figure} .u-legend .u-series")).to_have_count(3)  # the step, then each job
    expect(page.locator("#loss-figure .u-legend")).to_contain_text("lr-large")
    assert _drawn(page, "loss-figure", 0) == list(range(STEPS))
    assert _drawn(page, "loss-figure", 2)[8:] == [None, None]  # its superseded steps: no point
    assert [v for v in _drawn(page, "eval-figure", 1) if v is not None] == pytest.approx([4.5 / 5, 4.5 / 10])
    expect(page.locator("#differing tbody tr")).to_have_count(1)
    expect(page.locator("#differing tbody tr th")).to_have_text("optimizer.lr")
    expect(page.locator("#differing tbody tr td")).to_have_text(["0.001", "0.01"])
    expect(page.locator("#left-out")).to_have_text("1 job not shown.")
    assert "bobs-secret-run" not in page.content()
    pages.check()


def test_in_chromium_the_sweep_page_draws_the_trials_curves_a_scatter_a_field_and_marks_the_best(pages, sweep):
    page = pages.open(f"/sweeps/{sweep['id']}")
    _wait_drawn(page, 1 + len(SPACE))
    jobs = {t["index"]: t["job_id"] for t in sweep["trials"]}
    assert _labels(page, "trials-figure") == [f"trial {i} · job {jobs[i]}" for i in sorted(SCALES)]
    assert _drawn(page, "trials-figure", 0) == list(EVAL_STEPS)
    for i, path in enumerate(SPACE):
        figure = f"field-{i}"
        expect(page.locator(f"#{figure}")).to_have_attribute("data-path", path)
        assert _labels(page, figure) == ["eval_loss", "best"]
        assert page.evaluate(f"{_uplot(figure)}.series[1].paths(0)") is None, "points only, no line"
        metrics = _drawn(page, figure, 1)
        best = [v for v in _drawn(page, figure, 2) if v is not None]
        assert sorted(metrics) == pytest.approx(sorted(s * 0.45 for s in SCALES.values()))
        assert best == pytest.approx([SCALES[1] * 0.45])
    assert page.evaluate(f"{_uplot('field-0')}.scales.x.distr") == 3  # lr spans a hundredfold: log
    assert page.evaluate(f"{_uplot('field-1')}.scales.x.distr") == 1
    best_row = page.locator("#trials tr.best")
    expect(best_row).to_have_count(1)
    expect(best_row).to_have_attribute("data-index", "1")
    expect(best_row.locator(".best-mark")).to_be_visible()
    expect(page.locator('#trials tr[data-index="3"] .badge')).to_have_text("running")

    page.locator("#compare-link").click()
    _wait_drawn(page, 3)
    assert len(_labels(page, "loss-figure")) == len(jobs)  # trial 3's job too: a series with no row yet
    pages.check()


def test_in_chromium_a_job_stopped_early_wears_its_own_badge_and_is_final(pages, api):
    """stopped_early (a sweep's trial that early stopping ended) is drawn in its own muted amber, not as
    cancelled; once the service knows it as terminal, its job page offers no Cancel."""
    job = submit(api, ALICE, name="stopped-at-a-rung")
    tick(api, 2)
    train(api, job["id"], scale=1.0)
    with api.app.state.runtime.db.session() as session:  # as early stopping leaves it
        session.get(Job, job["id"]).status = "stopped_early"
    page = pages.open(f"/compare?jobs={job['id']},{job['id'] - 1}")
    badge = page.locator(f'#compared tr[data-id="{job["id"]}"] .badge')
    expect(badge).to_have_text("stopped_early")
    expect(badge).to_have_css("background-color", "rgb(254, 243, 199)")
    cancelled = page.evaluate(
        "(() => { const b = Object.assign(document.createElement('span'), { className: 'badge s-cancelled' });"
        " document.body.append(b); return getComputedStyle(b).backgroundColor; })()"
    )
    assert cancelled != "rgb(254, 243, 199)"
    if "stopped_early" in TERMINAL:  # service/schemas/fields.py's: the job page reads the job as the API does
        job_page = pages.open(f"/jobs/{job['id']}")
        expect(job_page.locator('[data-field="status"]')).to_have_text("stopped_early")
        expect(job_page.locator("#curves")).to_have_attribute("data-points", str(STEPS))  # the first poll is done
        expect(job_page.locator("#cancel")).to_be_hidden()
    pages.check()
