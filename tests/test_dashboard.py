"""The dashboard in a real browser: Playwright drives Debian's Chromium against a live `zero1 serve`.

One server per module (an embedded Ray of 4 logical GPUs, a SQLite database seeded with 100 finished
jobs) and one browser per module. Every test fails on a console error or an uncaught page error.
Screenshots go to $ZERO1_ARTIFACTS/dashboard (or pytest's tmp dir); the module prints where.

Packages: service.dashboard.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from service.dashboard import charts
from service.dashboard.format import duration, human_bytes, significant
from service.dashboard.routes import LOG_KEEP, LOG_LINES, TABLE_LIMIT, _number, table_order
from service.intake.admission import admit
from service.intake.submission import submit_job
from service.planning.capacity import ClusterCapacity
from service.scheduling.job_states import transition
from service.schemas.requests import JobSpec
from service.store.db import Database, upgrade
from service.store.metric_rows import store_metrics
from service.store.tables import LogLine
from workers.memory.model import GB
from workers.records import MetricRow

from helpers import free_port
from marks import starts
from watched import watch_int

ZERO1 = str(Path(sys.executable).with_name("zero1"))
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TINY_GPT = json.loads((ROOT / "examples" / "tiny-gpt.json").read_text())
PARTS = ("params", "grads", "buckets", "optimizer", "padding", "activations", "overhead", "total")
SEEDED_JOBS = 100
assert SEEDED_JOBS >= TABLE_LIMIT, "the table shows its whole TABLE_LIMIT rows"
SEEDED_STEPS = 20
HTML_NAME = "<script>alert('x')</script> & <b>bold</b>"
FIRST_PAINT_LIMIT_BYTES = 200_000
TRAINING_TIMEOUT_MS = 600_000
"""A bound on a job's run, not a measure of it: a busy loop per core beside the suite slowed a 40-step
job past 180 s (as TRACE_TIMEOUT_S bounds a trace)."""
EXPECT_TIMEOUT_MS = 60_000
"""Every expect()'s bound where it names none (Playwright's default is 5 s): with a busy loop per core
beside the suite the queue panel's first reason waited longer than 5 s for a scheduler tick. An
assertion that holds returns as soon as it does."""
expect.set_options(timeout=EXPECT_TIMEOUT_MS)
LOG_STEPS = 40
"""The steps of the job whose logs a test watches: rank 0's step lines overflow the panel."""


# --------------------------------------------------------------------------- the server


TAGGED = "sevenths"
"""The tag of every seventh seeded job."""


def seed_jobs(database_url: str, *, count: int) -> None:
    """`count` finished jobs, as the service stores them: succeeded (with metrics), failed, cancelled;
    every seventh tagged TAGGED."""
    upgrade(database_url)
    db = Database(database_url)
    cluster = ClusterCapacity(num_gpus=4, num_gpus_free=4, gpu_memory_bytes=80 * GB, simulated=True)
    try:
        with db.session() as session:
            for i in range(count):
                name = f"history-{i:03d}" if i < count - 1 else HTML_NAME  # the newest: shown as text, never run
                tags = [TAGGED] if i % 7 == 0 else []
                spec = JobSpec.model_validate({**TINY_GPT, "name": name, "tags": tags})
                plan = admit(spec, cluster=cluster, overhead_bytes=GB)
                job, _ = submit_job(session, spec=spec, plan=plan, idempotency_key=None)
                end = ("succeeded", "failed", "cancelled")[i % 3]
                if end == "cancelled":
                    transition(session, job, "cancelled", "cancelled by request while queued")
                    continue
                transition(session, job, "starting", "seeded")
                transition(session, job, "running", "seeded")
                store_metrics(session, job, [_metric_row(step) for step in range(SEEDED_STEPS)])
                if end == "failed":
                    job.error = {"rank": 0, "node_id": "n", "exception": "RuntimeError", "message": "seeded failure"}
                transition(session, job, end, "seeded")
    finally:
        db.dispose()


def _metric_row(step: int) -> MetricRow:
    return MetricRow(
        step=step,
        loss=4.0 / (1 + step),
        grad_norm=1.0,
        loss_scale=1.0,
        skipped=False,
        step_time_s=0.02,
        tokens_per_s=12_800.0,
        mem_peak_bytes=(1_500_000, 1_500_000),
        mem_planned_bytes=1_538_048,
        eval_loss=4.5 / (1 + step) if step % 5 == 4 else None,  # eval_every 5
    )


@dataclass
class Server:
    base: str
    database_url: str
    process: subprocess.Popen
    log_path: Path
    api: httpx.Client

    def submit(self, body: dict) -> dict:
        response = self.api.post("/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        return response.json()

    def job(self, job_id: int) -> dict:
        return self.api.get(f"/v1/jobs/{job_id}").json()

    def log_tail(self) -> str:
        return self.log_path.read_text()[-4000:]


@pytest.fixture(scope="module")
@starts("browser")
def browser() -> Iterator[Browser]:
    """Debian's Chromium, headless; Playwright cannot download its own browser here."""
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
@starts("ray", "slow")
def server(browser, tmp_path_factory) -> Iterator[Server]:
    """`zero1 serve` on a free loopback port, over a database that already holds SEEDED_JOBS jobs."""
    tmp = tmp_path_factory.mktemp("dashboard-server")
    database_url = f"sqlite:///{tmp / 'zero1.db'}"
    seed_jobs(database_url, count=SEEDED_JOBS)
    port = free_port()
    # a root as deep as a CI checkout's: a phone must wrap it, not scroll sideways to read it
    long_root = tmp / "ci-runner-workspace-checkouts-0123456789abcdef0123456789abcdef" / "examples" / "data"
    long_root.mkdir(parents=True)
    env = {
        **os.environ,
        "ZERO1_DATABASE_URL": database_url,
        "ZERO1_DATA_ROOTS": f"data,{long_root}",
        "ZERO1_CHECKPOINT_URI": str(tmp / "checkpoints"),
        "ZERO1_RAY_NAMESPACE": f"zero1-dashboard-{secrets.token_hex(4)}",
        "ZERO1_SIMULATED_GPUS": "4",
        "ZERO1_SIMULATED_GPU_MEMORY_GB": "80",
        "ZERO1_GPU_OVERHEAD_GB": "1",
        "ZERO1_CPUS_PER_WORKER": "0.5",
        "ZERO1_SCHEDULER_INTERVAL_S": "0.1",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    log_path = tmp / "serve.log"
    with log_path.open("w") as log:  # a file, not a pipe: the access log would fill a pipe nobody reads
        process = subprocess.Popen([ZERO1, "serve", "--port", str(port)], env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    api = httpx.Client(base_url=base, timeout=30)
    try:
        deadline = time.monotonic() + 120
        while True:  # poll until the server accepts connections, with a deadline
            assert process.poll() is None, log_path.read_text()
            try:
                if api.get("/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"zero1 serve did not start within 120 s:\n{log_path.read_text()}"
            time.sleep(0.2)
        yield Server(base=base, database_url=database_url, process=process, log_path=log_path, api=api)
    finally:
        api.close()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


# --------------------------------------------------------------------------- pages and artifacts


@dataclass
class Report:
    directory: Path
    lines: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def report(request, tmp_path_factory) -> Iterator[Report]:
    """Where screenshots go ($ZERO1_ARTIFACTS/dashboard, else pytest's tmp dir), printed at the end."""
    given = os.environ.get("ZERO1_ARTIFACTS")
    directory = Path(given) / "dashboard" if given else tmp_path_factory.mktemp("dashboard-artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    collected = Report(directory=directory)
    yield collected
    shots = sorted(path.name for path in directory.glob("*.png"))
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\ndashboard screenshots ({len(shots)}) in {directory}: {', '.join(shots)}")
        for line in collected.lines:
            print(f"dashboard: {line}")


class Browsing:
    """Pages in fresh browser contexts; every console error and uncaught page error is kept."""

    def __init__(self, browser: Browser, server: Server, report: Report):
        self.browser = browser
        self.server = server
        self.report = report
        self.errors: list[str] = []
        self.contexts = []

    def open(self, path: str = "/", *, width: int = 1280, height: int = 800, javascript: bool = True) -> Page:
        page = self.new_page(width=width, height=height, javascript=javascript)
        page.goto(path)
        return page

    def new_page(self, *, width: int = 1280, height: int = 800, javascript: bool = True) -> Page:
        context = self.browser.new_context(
            base_url=self.server.base, viewport={"width": width, "height": height}, java_script_enabled=javascript
        )
        self.contexts.append(context)
        page = context.new_page()
        page.on(
            "console",
            lambda message: (
                message.type == "error"
                and self.errors.append(f"console.error at {message.location.get('url')}: {message.text}")
            ),
        )
        page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        return page

    def screenshot(self, page: Page, name: str, *, full_page: bool = True) -> None:
        page.screenshot(path=self.report.directory / f"{name}.png", full_page=full_page)

    def assert_no_console_errors(self) -> None:
        assert self.errors == [], "\n".join(self.errors)


@pytest.fixture
def ui(browser, server, report) -> Iterator[Browsing]:
    browsing = Browsing(browser, server, report)
    yield browsing
    for context in browsing.contexts:
        context.close()


def _status(scope) -> str:
    return scope.locator('[data-field="status"]')


def _no_horizontal_scroll(page: Page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


# --------------------------------------------------------------------------- a user watches a job train


def test_watch_a_job_wait_run_and_succeed_cancelling_the_job_ahead_of_it(ui, server):
    """One user's afternoon, without a reload: a long job holds the cluster and the example job waits in
    the queue; the user cancels the long job from its page (confirming), then watches the example job
    run and succeed on the dashboard, and opens its page with the keyboard."""
    dashboard = ui.open("/")
    rows = dashboard.locator("#jobs tbody tr")
    expect(rows).to_have_count(TABLE_LIMIT)
    dashboard.evaluate("window.zero1FirstLoad = true")  # gone if the page ever reloads

    # 3 of the 4 GPUs: the example job's 2 are not free, so it waits behind
    hog = server.submit(
        {**TINY_GPT, "name": "hog", "num_gpus": 3, "steps": 100_000, "eval_every": 2, "eval_batches": 1}
    )
    job = server.submit(TINY_GPT)
    row = dashboard.locator(f"#job-{job['id']}")
    expect(_status(row)).to_have_text("queued")
    expect(row.locator(".c-queue")).to_have_text("#1")
    expect(dashboard.locator('#cluster [data-field="queued"]')).to_have_text("1")
    expect(rows.nth(0)).to_have_attribute("id", f"job-{hog['id']}")  # active jobs first, then the queue
    expect(rows.nth(1)).to_have_attribute("id", f"job-{job['id']}")
    expect(rows).to_have_count(TABLE_LIMIT)  # the newest TABLE_LIMIT: two seeded jobs made way
    # the queue panel, redrawn live from GET /v1/queue: the waiting job and the scheduler's reason
    waiting = dashboard.locator(f'#queue tbody tr[data-id="{job["id"]}"]')
    expect(waiting.locator("td.why")).to_have_text("waiting for 2 GPUs, 1 free")
    expect(waiting.locator("td").first).to_have_text("#1")
    # when it starts: once the hog's rows give its step time, its 100,000 steps left x that (estimates.py)
    expect(waiting.locator("td.c-start")).to_have_text(re.compile(r"^in \d+(\.\d)? (min|h|d)$"))
    expect(waiting.locator("td.c-start")).to_have_attribute("title", re.compile(r"^estimated \d{4}-\d\d-\d\d .* UTC$"))
    ui.screenshot(dashboard, "dashboard-queued", full_page=False)

    _cancel_through_its_page(ui, server, hog["id"])
    expect(_status(dashboard.locator(f"#job-{hog['id']}"))).to_have_text("cancelled")

    expect(_status(row)).to_have_text("running", timeout=TRAINING_TIMEOUT_MS)
    expect(rows.nth(0)).to_have_attribute("id", f"job-{job['id']}")
    expect(dashboard.locator("#queue tbody tr")).to_have_count(0)
    expect(dashboard.locator("#queue-empty")).to_be_visible()
    expect(dashboard.locator('#cluster [data-field="gpus-in-use"]')).to_have_text("2")
    expect(row.locator(".c-queue")).to_have_text("—")
    expect(row.locator(".c-loss")).not_to_have_text("—", timeout=60_000)  # the ranks' first step
    ui.screenshot(dashboard, "dashboard-running", full_page=False)

    expect(_status(row)).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    expect(row.locator(".steps")).to_have_text("300 / 300")
    expect(row.locator("progress")).to_have_attribute("value", "300")
    expect(dashboard.locator("#announcer")).to_have_text(f"Job {job['id']} tiny-gpt: running to succeeded")
    latest = server.job(job["id"])["latest"]
    expect(row.locator(".c-loss")).to_have_text(f"{latest['loss']:.4g}")
    assert dashboard.evaluate("window.zero1FirstLoad") is True, "the dashboard reloaded"
    ui.screenshot(dashboard, "dashboard-succeeded", full_page=False)

    _open_first_job_with_the_keyboard(dashboard, job["id"])
    _check_job_page(ui, server, dashboard, job["id"])
    ui.assert_no_console_errors()


def _cancel_through_its_page(ui: Browsing, server: Server, job_id: int) -> None:
    """The job's page draws its loss live; Cancel asks first: dismissed, nothing happens; accepted, it ends."""
    page = ui.open(f"/jobs/{job_id}")
    expect(_status(page.locator("#job"))).to_have_text("running", timeout=TRAINING_TIMEOUT_MS)
    curves = page.locator("#curves")
    page.wait_for_function("Number(document.querySelector('#curves').dataset.points) > 0", timeout=60_000)
    drawn = int(curves.get_attribute("data-points"))  # drawn live from the first step
    page.wait_for_function(f"Number(document.querySelector('#curves').dataset.points) > {drawn}")
    # the held-out loss beside it (eval_every 2): its own series on the same axes, and the latest in the strip
    page.wait_for_function(f"{_SERIES.format(figure='loss-figure', index=3)}.filter(v => v != null).length > 1")
    expect(page.locator('#job-stats [data-field="eval-loss"]')).not_to_have_text("—")
    expect(page.locator('#peaks tr[data-rank="2"] td[data-bytes]')).not_to_have_text("—")
    ui.screenshot(page, "job-running")

    messages: list[str] = []
    page.once("dialog", lambda dialog: (messages.append(dialog.message), dialog.dismiss()))
    page.get_by_role("button", name="Cancel job").click()
    assert messages and f"#{job_id}" in messages[0], messages
    expect(page.locator("#cancel-note")).to_have_text("")
    assert server.job(job_id)["status"] == "running"  # dismissed: nothing was sent

    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel job").click()
    expect(page.locator("#cancel-note")).to_contain_text("Cancel requested")
    expect(_status(page.locator("#job"))).to_have_text("cancelled", timeout=60_000)
    expect(page.locator("#cancel")).to_be_hidden()
    expect(page.locator("#events li").last).to_contain_text("cancelled")
    assert server.job(job_id)["status"] == "cancelled"
    ui.screenshot(page, "job-cancelled")


def _open_first_job_with_the_keyboard(page: Page, job_id: int) -> None:
    """Tab from the top of the page to the newest job's link (focus visibly drawn), and press Enter."""
    for _ in range(20):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.closest('tr')?.id ?? null") == f"job-{job_id}":
            break
    else:
        pytest.fail(f"20 presses of Tab never reached job {job_id}'s link")
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") == "solid"
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(rf"/jobs/{job_id}$"))


def _check_job_page(ui: Browsing, server: Server, page: Page, job_id: int) -> None:
    """The curves hold every point the metrics endpoint gives; the memory panel is the API's plan."""
    job = server.job(job_id)
    expect(_status(page.locator("#job"))).to_have_text("succeeded")
    expect(page.locator("#cancel")).to_be_hidden()

    metrics = server.api.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 200}).json()["data"]
    assert len(metrics) >= 150  # 300 steps thinned to every 2nd, and the last
    page.wait_for_function(f"document.querySelector('#curves').dataset.points == {len(metrics)}")
    assert _series(page, "loss-figure", 1) == [m["loss"] for m in metrics]
    assert _series(page, "lr-figure", 1) == [m["lr"] for m in metrics]
    assert _series(page, "loss-figure", 0)[-1] == 299
    # beside the step time, the seconds each checkpoint step waited for its checkpoint (checkpoint_every 100)
    checkpointed = server.api.get(f"/v1/jobs/{job_id}/metrics", params={"checkpointed": True}).json()["data"]
    assert [m["step"] for m in checkpointed] == [99, 199, 299]
    assert all(0 <= m["checkpoint_blocked_s"] < 60 for m in checkpointed)
    assert [v for v in _series(page, "speed-figure", 2) if v is not None] == [
        m["checkpoint_blocked_s"] for m in checkpointed
    ]
    expect(page.locator("#checkpoints li")).to_have_count(3)
    assert _series(page, "world-size-figure", 1) == [job["world_size"]] * len(metrics)  # one size all along
    expect(page.locator("#artifacts tbody tr").first).to_be_visible()  # final/ of a succeeded job, each with a link

    plan = job["plan"]
    for part in PARTS:
        cell = page.locator(f'#breakdown tr[data-part="{part}"] td[data-bytes]')
        assert int(cell.get_attribute("data-bytes")) == plan["per_gpu"][f"{part}_bytes"], part
        expect(cell).to_have_text(f"{plan['per_gpu'][f'{part}_bytes']:,}")
    memory = page.locator('#breakdown tr[data-part="gpu_memory"] td[data-bytes]')
    assert int(memory.get_attribute("data-bytes")) == plan["gpu_memory_bytes"]
    for rank, peak in enumerate(job["latest"]["mem_peak_bytes"]):
        expect(page.locator(f'#peaks tr[data-rank="{rank}"] td[data-bytes]')).to_have_text(f"{peak:,}")

    events = page.locator("#events li")
    expect(events).to_have_count(4)
    expect(events.last).to_contain_text("succeeded")
    expect(page.locator("#spec")).to_contain_text('"name": "tiny-gpt"')
    ui.screenshot(page, "job-succeeded")


# --------------------------------------------------------------------------- charts, checkpoints, artifacts

FIGURES = ("loss-figure", "speed-figure", "lr-figure", "world-size-figure", "memory-figure")
_UPLOT = "document.querySelector('#{figure} .u-chart').uplot"
"""A figure's uPlot, as JavaScript: charts.js keeps it on its container."""
_SERIES = "Array.from(" + _UPLOT + ".data[{index}])"
RESTART_STEP = 15
RESTARTED_STEPS = 40
ARTIFACT_NAME = "model.safetensors"
ARTIFACT_BYTES = bytes(range(256)) * 33
STORED_STEP = 39
STORED_FILES = {
    "complete.json": json.dumps({"step": STORED_STEP, "world_size": 2, "format": "flat"}).encode(),
    "rank-00000-of-00002.safetensors": bytes(range(7, 256)) * 5,
    "rank-00001-of-00002.safetensors": bytes(range(9, 256)) * 6,
}


def _series(page: Page, figure: str, index: int) -> list:
    """The values uPlot draws of one series (0: the steps) of a figure's chart."""
    return page.evaluate(_SERIES.format(figure=figure, index=index))


def _restart_row(step: int) -> MetricRow:
    """A noisy loss (smoothing shows), the lr, N = 2 and a checkpoint every 10th step."""
    return MetricRow(
        step=step,
        loss=4.0 / (1 + step) + 0.5 + 0.3 * (-1) ** step,
        grad_norm=1.0,
        loss_scale=1.0,
        skipped=False,
        step_time_s=0.02 + 0.001 * (step % 3),
        tokens_per_s=12_800.0,
        mem_peak_bytes=(1_500_000 + step, 1_400_000),
        mem_planned_bytes=1_538_048,
        eval_loss=4.5 / (1 + step) + 0.5 if step % 10 == 9 else None,
        world_size=2,
        checkpoint_blocked_s=0.01 if step % 10 == 9 else None,
        lr=1e-3 * (1 + step) / RESTARTED_STEPS,
    )


@pytest.fixture(scope="module")
def restarted(server) -> int:
    """A job stored as the service stores one that a rank's death restarted at RESTART_STEP, then
    succeeded with one artifact in its final/: its id."""
    db = Database(server.database_url)
    cluster = ClusterCapacity(num_gpus=4, num_gpus_free=4, gpu_memory_bytes=80 * GB, simulated=True)
    try:
        with db.session() as session:
            spec = JobSpec.model_validate({**TINY_GPT, "name": "restarted"})
            job, _ = submit_job(
                session, spec=spec, plan=admit(spec, cluster=cluster, overhead_bytes=GB), idempotency_key=None
            )
            transition(session, job, "starting", "seeded")
            transition(session, job, "running", "seeded")
            store_metrics(session, job, [_restart_row(step) for step in range(RESTART_STEP)])
            transition(session, job, "restarting", f"rank 1 exited: attempt 1 resumes from step {RESTART_STEP - 1}")
            job.attempt = 1
            transition(session, job, "running", "attempt 1: 2 ranks placed on 1 node(s), resumed")
            store_metrics(session, job, [_restart_row(step) for step in range(RESTART_STEP, RESTARTED_STEPS)])
            transition(session, job, "succeeded", "seeded")
            session.flush()
            job_id = job.id
            run_id = job.run_id
    finally:
        db.dispose()
    checkpoints = Path(server.database_url.removeprefix("sqlite:///")).parent / "checkpoints"
    final = checkpoints / f"job-{job_id}-{run_id}" / "final"
    final.mkdir(parents=True)
    (final / ARTIFACT_NAME).write_bytes(ARTIFACT_BYTES)
    digest = hashlib.sha256(ARTIFACT_BYTES).hexdigest()
    manifest = {"files": [{"name": ARTIFACT_NAME, "bytes": len(ARTIFACT_BYTES), "sha256": digest}]}
    (final / "manifest.json").write_text(json.dumps(manifest))
    stored = final.parent / f"step-{STORED_STEP:09d}"  # the checkpoint still stored; the others were pruned
    stored.mkdir()
    for name, data in STORED_FILES.items():
        (stored / name).write_bytes(data)
    return job_id


def _ema(values: list[float], weight: float) -> list[float]:
    out: list[float] = []
    for value in values:
        out.append(value if not out else weight * out[-1] + (1 - weight) * value)
    return out


def test_the_job_pages_charts_are_uplot_with_readable_ticks_hover_and_a_restart_marker(ui, server, restarted):
    """Five uPlot charts, each with 4+ y ticks in a 10+ px font; hovering a step reads its values in the
    legend; the restart is marked on every chart and listed; N draws as integer steps; every request the
    page makes goes to the server itself (uPlot is vendored, no CDN)."""
    page = ui.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(f"/jobs/{restarted}")
    metrics = server.api.get(f"/v1/jobs/{restarted}/metrics", params={"max_points": 200}).json()["data"]
    assert len(metrics) == RESTARTED_STEPS
    page.wait_for_function(f"document.querySelector('#curves').dataset.points == {RESTARTED_STEPS}")
    for figure in FIGURES:
        expect(page.locator(f"#{figure} .uplot")).to_have_count(1)
        uplot = _UPLOT.format(figure=figure)
        axis = page.evaluate(f"({{ font: {uplot}.axes[1].font, values: {uplot}.axes[1]._values }})")
        font_px = float(re.search(r"(\d+(?:\.\d+)?)px", str(axis["font"])).group(1))
        assert font_px >= 10, (figure, axis)
        assert len([v for v in axis["values"] if v not in (None, "")]) >= 4, (figure, axis)
        # the restart: attempt 1's first step, drawn as a dashed line on the chart
        expect(page.locator(f"#{figure} .uplot")).to_have_attribute("data-markers", f"restart@{RESTART_STEP}")
    expect(page.locator("#chart-markers li")).to_have_count(1)
    expect(page.locator('#chart-markers li[data-kind="restart"]')).to_have_attribute("data-step", str(RESTART_STEP))
    assert _series(page, "world-size-figure", 1) == [2] * RESTARTED_STEPS
    gpu_ticks = page.evaluate(f"{_UPLOT.format(figure='world-size-figure')}.axes[1]._values")
    assert all(re.fullmatch(r"\d+", v) for v in gpu_ticks) and "2" in gpu_ticks, gpu_ticks

    step = 20  # hover step 20 on the loss chart: the legend reads its step and loss
    box = page.locator("#loss-figure .u-over").bounding_box()
    x = page.evaluate(f"{_UPLOT.format(figure='loss-figure')}.valToPos({step}, 'x')")
    page.mouse.move(box["x"] + x, box["y"] + box["height"] / 2)
    legend = page.locator("#loss-figure .u-legend .u-series")
    expect(legend.nth(0).locator(".u-value")).to_have_text(str(step))
    loss = next(m["loss"] for m in metrics if m["step"] == step)
    assert float(legend.nth(1).locator(".u-value").inner_text()) == pytest.approx(loss, rel=1e-2)
    ui.screenshot(page, "job-charts-restarted")

    assert requests and all(url.startswith(server.base + "/") for url in requests), requests
    assert any("/static/vendor/uplot/uPlot.iife.min.js" in url for url in requests)
    ui.assert_no_console_errors()


def test_the_smoothing_slider_and_the_log_toggle_redraw_the_loss(ui, server, restarted):
    """The smoothed loss is the EMA of the raw one at the slider's weight; moving the slider redraws the
    curve (the canvas's pixels change); the log toggle makes the y scale logarithmic."""
    page = ui.open(f"/jobs/{restarted}")
    page.wait_for_function(f"document.querySelector('#curves').dataset.points == {RESTARTED_STEPS}")
    raw = _series(page, "loss-figure", 1)
    assert raw[0] == pytest.approx(_restart_row(0).loss)
    assert _series(page, "loss-figure", 2) == pytest.approx(_ema(raw, 0.6))  # the slider's first place
    canvas = "document.querySelector('#loss-figure canvas').toDataURL()"
    before = page.evaluate(canvas)
    page.locator("#loss-smoothing").fill("0.95")
    expect(page.locator("#loss-smoothing-value")).to_have_text("0.95")
    assert _series(page, "loss-figure", 2) == pytest.approx(_ema(raw, 0.95))
    assert page.evaluate(canvas) != before

    # a drag zooms in; new data (the slider's, as a poll's during training) keeps the zoom
    uplot = _UPLOT.format(figure="loss-figure")
    box = page.locator("#loss-figure .u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.25, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()
    zoomed = page.evaluate(f"[{uplot}.scales.x.min, {uplot}.scales.x.max]")
    assert 0 < zoomed[0] < zoomed[1] < RESTARTED_STEPS - 1, zoomed
    page.locator("#loss-smoothing").fill("0.9")
    assert _series(page, "loss-figure", 2) == pytest.approx(_ema(raw, 0.9))
    assert page.evaluate(f"[{uplot}.scales.x.min, {uplot}.scales.x.max]") == zoomed
    page.locator("#loss-smoothing").fill("0.95")

    assert page.evaluate(f"{uplot}.scales.y.distr") == 1
    linear_ticks = page.evaluate(f"{uplot}.axes[1]._values")
    page.get_by_label("Log scale").check()
    page.wait_for_function(f"{uplot}.scales.y.distr == 3")
    assert page.evaluate(f"{uplot}.axes[1]._values") != linear_ticks
    assert _series(page, "loss-figure", 2) == pytest.approx(_ema(raw, 0.95))  # the smoothing stays
    page.get_by_label("Log scale").uncheck()
    page.wait_for_function(f"{uplot}.scales.y.distr == 1")
    ui.assert_no_console_errors()


def test_each_new_attempt_is_marked_by_its_cause_a_restart_a_resize_a_preemption_or_a_rollback(ui, server, restarted):
    """charts.js's markersOf, on rows and events as the service writes them: a new attempt after a
    preemption (running -> queued), after a resize (N changes), after a rank's failure and after a
    diverged run's rollback."""
    page = ui.open(f"/jobs/{restarted}")
    page.wait_for_function("window.zero1Charts !== undefined")
    rows = [  # (step, attempt, N)
        *((step, 0, 2) for step in range(0, 8)),  # the surviving curve: each step once
        *((step, 1, 2) for step in range(8, 20)),  # preempted after step 9, resumed from its checkpoint at 7
        *((step, 2, 1) for step in range(20, 30)),
        *((step, 3, 1) for step in range(30, 40)),
        *((step, 4, 1) for step in range(40, 50)),  # the spike at step 45 rolled back to the checkpoint at 39
    ]
    metrics = [{"step": step, "attempt": attempt, "world_size": n} for step, attempt, n in rows]
    reasons = [
        ("running", "queued", "preempted by job 12 (priority 90): checkpoint at step 7"),
        ("queued", "starting", "2 GPUs free: placing 2 ranks"),
        ("running", "restarting", "resized 2 -> 1: rank 1 exited; retry 1 of 3: attempt 2 resumes from step 19"),
        ("running", "restarting", "rank 0 exited; retry 2 of 3: attempt 3 resumes from step 29"),
        (
            "running",
            "restarting",
            "loss spike 9.7σ at step 45: rolled back to step 39, skipping 6 batches (rollback 1 of 1): "
            "attempt 4 resumes from checkpoint step 39",
        ),
    ]
    events = [{"from_status": a, "to_status": b, "reason": reason} for a, b, reason in reasons]
    markers = page.evaluate("([m, e]) => window.zero1Charts.markersOf(m, e)", [metrics, events])
    assert [(m["kind"], m["step"]) for m in markers] == [
        ("preemption", 8),
        ("resize", 20),
        ("restart", 30),
        ("rollback", 40),
    ]
    assert markers[1]["reason"].startswith("resized 2 -> 1")
    ui.assert_no_console_errors()


def test_the_job_page_lists_checkpoints_and_downloads_an_artifact(ui, server, restarted):
    """The checkpoint steps, the stored one's files and each final/ file, each with a link that
    downloads its bytes from the API."""
    page = ui.open(f"/jobs/{restarted}")
    steps = [step for step in range(RESTARTED_STEPS) if step % 10 == 9]
    expect(page.locator("#checkpoints li")).to_have_count(len(steps))
    assert page.locator("#checkpoints li").evaluate_all("lis => lis.map(li => Number(li.dataset.step))") == steps
    for step in steps:  # the pruned ones are listed without links
        links = page.locator(f'#checkpoints li[data-step="{step}"] a')
        expect(links).to_have_count(len(STORED_FILES) if step == STORED_STEP else 0)
    for name, data in STORED_FILES.items():
        link = page.locator(f'#checkpoints li[data-step="{STORED_STEP}"] a', has_text=name)
        expect(link).to_have_attribute("href", f"/v1/jobs/{restarted}/checkpoints/{STORED_STEP}/{name}")
        with page.expect_download() as download:
            link.click()
        assert download.value.suggested_filename == f"step-{STORED_STEP}-{name}"
        assert Path(download.value.path()).read_bytes() == data
    page.locator("#files").screenshot(path=ui.report.directory / "job-checkpoints.png")
    link = page.locator(f'#artifacts tr[data-name="{ARTIFACT_NAME}"] a')
    expect(link).to_have_attribute("href", f"/v1/jobs/{restarted}/artifacts/{ARTIFACT_NAME}")
    with page.expect_download() as download:
        link.click()
    assert Path(download.value.path()).read_bytes() == ARTIFACT_BYTES
    response = page.request.get(link.get_attribute("href"))  # the page's own context: its cookies, if any
    assert response.status == 200 and response.body() == ARTIFACT_BYTES
    ui.assert_no_console_errors()


# --------------------------------------------------------------------------- a job's logs


def store_log_line(server: Server, job_id: int, *, rank: int, stream: str, line: str) -> None:
    """A line of the job's current attempt in the server's database, as service.store.log_lines stores a rank's."""
    db = Database(server.database_url)
    try:
        with db.session() as session:
            attempt = server.job(job_id)["attempt"]
            session.add(
                LogLine(job_id=job_id, attempt=attempt, rank=rank, time=datetime.now(UTC), stream=stream, line=line)
            )
    finally:
        db.dispose()


_IN_PANEL = "li.getBoundingClientRect().top - li.closest('#log-panel').getBoundingClientRect().top"
"""A log line's offset from the top of the panel's view, in px, as JavaScript."""


def _log_panel_at_end(page: Page) -> bool:
    return page.locator("#log-panel").evaluate("p => p.scrollHeight - p.scrollTop - p.clientHeight < 4")


def test_the_job_page_tails_every_ranks_logs_live(ui, server):
    """The page of a job, opened before its ranks start, draws their lines as they are stored, without a
    reload: each rank's number in a colour of its own, rank 0's step lines up to the last step, a stderr
    line marked in words as well as in red, the newest in view. Once the job has ended and a fetch found
    nothing new it stops asking; the panel then holds every line the API has, in its order."""
    job = server.submit({**TINY_GPT, "name": "logs", "steps": LOG_STEPS, "checkpoint_every": 0})
    asked: list[float] = []
    page = ui.new_page()
    page.on("request", lambda request: "/logs?" in request.url and asked.append(time.monotonic()))
    page.goto(f"/jobs/{job['id']}")
    page.evaluate("window.zero1FirstLoad = true")
    lines = page.locator("#log-lines li")
    first_paint = lines.count()
    warning = "UserWarning: <b>not bold</b> & on rank 1's stderr"
    store_log_line(server, job["id"], rank=1, stream="stderr", line=warning)

    last = lines.filter(has_text=re.compile(rf"INFO zero1\.train: step {LOG_STEPS - 1}/{LOG_STEPS - 1}\s+loss "))
    expect(last).to_have_count(1, timeout=TRAINING_TIMEOUT_MS)
    expect(last).to_have_attribute("data-stream", "log")
    assert lines.count() > first_paint and page.evaluate("window.zero1FirstLoad") is True, "the page reloaded"
    colours = []
    for rank in (0, 1):
        started = lines.filter(has_text=f"INFO zero1.train: rank {rank} of 2 on ")
        expect(started).to_have_attribute("data-rank", str(rank))
        expect(started.locator(".rank")).to_have_text(f"rank {rank}")  # "rank " for a screen reader only
        colours.append(started.locator(".rank").evaluate("e => getComputedStyle(e).color"))
    assert colours[0] != colours[1]
    stderr = lines.filter(has_text=warning)
    expect(stderr).to_have_attribute("data-stream", "stderr")
    expect(stderr).to_contain_text(f"stderr: {warning}")  # said, not only drawn
    expect(stderr).to_have_attribute("title", re.compile(r"^rank 1 · attempt 0 · stderr · "))
    assert stderr.evaluate("e => getComputedStyle(e).borderLeftColor") == "rgb(185, 28, 28)"
    expect(page.locator("#log-lines b")).to_have_count(0)  # the line is text, never HTML

    expect(_status(page.locator("#job"))).to_have_text("succeeded", timeout=TRAINING_TIMEOUT_MS)
    page.wait_for_timeout(2500)  # a fetch after the end, which finds nothing new
    num_asked = len(asked)
    page.wait_for_timeout(1500)
    assert len(asked) == num_asked, "the page still asks for the logs of a job that has ended"
    stored = server.api.get(f"/v1/jobs/{job['id']}/logs", params={"limit": 10_000}).json()["data"]
    assert lines.evaluate_all("lines => lines.map(li => Number(li.dataset.seq))") == [row["seq"] for row in stored]
    assert _log_panel_at_end(page) and page.locator("#log-panel").evaluate("p => p.scrollHeight > p.clientHeight")
    ui.screenshot(page, "job-logs")

    page.get_by_label("Show").select_option("1")
    expect(page.locator('#log-lines li[data-rank="0"]:visible')).to_have_count(0)
    expect(page.locator('#log-lines li[data-rank="1"]:visible')).to_have_count(sum(r["rank"] == 1 for r in stored))
    page.get_by_label("Show").select_option("")
    expect(page.locator("#log-lines li:visible")).to_have_count(len(stored))
    page.evaluate(
        "document.querySelector('#log-panel').scrollTop = 0; document.querySelector('#logs').scrollIntoView()"
    )
    ui.screenshot(page, "job-logs-panel", full_page=False)  # the ranks' first lines and the stderr line
    ui.assert_no_console_errors()

    page = ui.open(f"/jobs/{job['id']}", javascript=False)  # the newest lines from the first paint
    expect(page.locator("#log-lines li")).to_have_count(len(stored))
    expect(page.locator('#log-lines li[data-stream="stderr"]')).to_contain_text(f"stderr: {warning}")
    expect(page.get_by_label("Show")).to_be_hidden()
    page = ui.open(f"/jobs/{job['id']}", width=375, height=740)
    expect(page.locator("#log-lines li")).to_have_count(len(stored))
    assert _no_horizontal_scroll(page), "the log panel scrolls the page sideways at 375 px"
    ui.screenshot(page, "phone-job-logs")


def _fake_line(seq: int) -> dict:
    """A line as GET /v1/jobs/{id}/logs answers: the first the marker, then two ranks' of every stream."""
    if seq == 1:
        text = "[zero1] 12 earlier lines (1,200 bytes) were dropped"
        return {
            "seq": 1,
            "time": "2025-01-01T12:00:00Z",
            "rank": None,
            "attempt": None,
            "stream": "marker",
            "line": text,
        }
    stream = ("stdout", "log", "stdout", "stderr")[seq % 4]
    text = f"line {seq} of rank {seq % 2}" + (f": {HTML_NAME}" if seq % 10 == 0 else "")
    return {"seq": seq, "time": "2025-01-01T12:00:01Z", "rank": seq % 2, "attempt": 0, "stream": stream, "line": text}


def test_the_log_panel_follows_the_newest_and_holds_still_when_scrolled_up(ui, server):
    """A finished job's page, its logs from a stand-in for the endpoint that gives lines when the test says:
    first a full panel a page at a time, then a few a second. Scrolled to its end the panel follows the
    newest; scrolled up, the line at its top stays put while new lines come and the oldest beyond
    LOG_KEEP go; scrolled back down, it follows again. The lines are text, never HTML."""
    listed = server.api.get("/v1/jobs", params={"status": "succeeded", "limit": 50}).json()["data"]
    seeded = next(job for job in listed if job["name"].startswith("history-"))  # no logs of its own
    pages = [LOG_LINES] * (LOG_KEEP // LOG_LINES)
    trickle = {"lines": 3}

    def logs(route) -> None:
        query = parse_qs(urlparse(route.request.url).query)
        after = int(query["after"][0])
        limit = int(query["limit"][0])
        count = min(limit, pages.pop(0) if pages else trickle["lines"])
        rows = [_fake_line(seq) for seq in range(after + 1, after + 1 + count)]
        route.fulfill(json={"data": rows, "next": rows[-1]["seq"] if rows else after})

    page = ui.new_page()
    page.route(re.compile(rf"/v1/jobs/{seeded['id']}/logs\?"), logs)
    page.goto(f"/jobs/{seeded['id']}")
    lines = page.locator("#log-lines li")
    newest = "document.querySelector('#log-lines').lastElementChild?.dataset.seq ?? 0"
    page.wait_for_function(f"Number({newest}) > {LOG_KEEP}")
    expect(lines).to_have_count(LOG_KEEP)  # the oldest went
    assert lines.first.get_attribute("data-seq") != "1" and _log_panel_at_end(page)
    seq = int(page.evaluate(newest))
    page.wait_for_function(f"Number({newest}) > {seq}")
    assert _log_panel_at_end(page), "the panel did not follow the newest line"

    kept = lines.nth(LOG_KEEP // 2).get_attribute("data-seq")
    line = page.locator(f'#log-lines li[data-seq="{kept}"]')
    line.evaluate(f"li => {{ const p = li.closest('#log-panel'); p.scrollTop += {_IN_PANEL}; }}")  # to the top
    offset = line.evaluate(f"li => {_IN_PANEL}")
    seq = int(page.evaluate(newest))
    page.wait_for_function(f"Number({newest}) > {seq + 3}")  # two polls' lines came, and as many oldest went
    expect(lines).to_have_count(LOG_KEEP)
    still = line.evaluate(f"li => {_IN_PANEL}")
    assert abs(still - offset) < 1 and not _log_panel_at_end(page), (offset, still)
    expect(page.locator("#log-lines script, #log-lines b")).to_have_count(0)
    expect(lines.filter(has_text=HTML_NAME).last.locator(".text")).to_have_text(
        re.compile(f": {re.escape(HTML_NAME)}$")
    )

    panel = page.locator("#log-panel")
    panel.evaluate("p => { p.scrollTop = p.scrollHeight; }")
    seq = int(page.evaluate(newest))
    page.wait_for_function(f"Number({newest}) > {seq}")
    assert _log_panel_at_end(page), "scrolled back to its end, the panel did not follow the newest line"
    trickle["lines"] = 0
    ui.assert_no_console_errors()


# --------------------------------------------------------------------------- the planner


def _check_plan_shown(page: Page, plan: dict) -> None:
    for part in PARTS:
        cell = page.locator(f'#plan-breakdown tr[data-part="{part}"] td[data-bytes]')
        expect(cell).to_have_attribute("data-bytes", str(plan["per_gpu"][f"{part}_bytes"]))
    for stage, total in plan["stages"].items():
        expect(page.locator(f'#plan-stages tr[data-stage="{stage}"] td[data-bytes]')).to_have_attribute(
            "data-bytes", str(total)
        )
    bars = page.locator("#sweep-chart g.bar")
    expect(bars).to_have_count(len(plan["sweep"]))
    for point in plan["sweep"]:
        row = page.locator(f'#plan-sweep tr[data-num-gpus="{point["num_gpus"]}"]')
        expect(row.locator("td[data-bytes]")).to_have_attribute("data-bytes", str(point["total_bytes"]))
        bar = page.locator(f'#sweep-chart g.bar[data-num-gpus="{point["num_gpus"]}"]')
        expect(bar).to_have_class(re.compile("fits" if point["fits"] else "over"))


def test_the_planner_form_shows_the_breakdown_and_the_sweep(ui, server):
    page = ui.open("/plan")
    page.evaluate("window.zero1FirstLoad = true")
    page.get_by_label("Parameters (Ψ)", exact=True).fill("7.5e9")
    page.get_by_label("GPUs (N)").fill("8")
    page.get_by_label("GPU memory (GB)").fill("80")
    page.get_by_label("Precision").select_option("fp16")
    page.get_by_label("ZeRO stage").select_option("1")
    page.get_by_role("button", name="Plan").click()
    expect(page).to_have_url(re.compile(r"/plan\?.*num_gpus=8"))
    plan = server.api.post("/v1/plan", json={"num_params": 7_500_000_000, "num_gpus": 8, "gpu_memory_gb": 80}).json()
    _check_plan_shown(page, plan)
    expect(page.locator("#verdict")).to_contain_text("Smallest N that fits: 2")
    expect(page.locator("#sweep-chart .floor-label")).to_have_text("floor 30.00 GB")  # 4Ψ, Ψ = 7.5e9
    heights = [
        float(h)
        for h in page.locator("#sweep-chart g.bar rect").evaluate_all(
            "rects => rects.map(r => r.getAttribute('height'))"
        )
    ]
    assert heights == sorted(heights, reverse=True) and heights[0] > 3 * heights[-1]  # 12Ψ/N melts away
    ui.screenshot(page, "planner-params")

    page.get_by_label("GPT spec").check()
    expect(page.get_by_label("Parameters (Ψ)", exact=True)).to_be_hidden()
    for label, value in (
        ("Vocabulary", "50257"),
        ("Layers", "48"),
        ("Heads", "25"),
        ("Width (n_embd)", "1600"),
        ("Context (block_size)", "1024"),
        ("Micro-batch", "1"),
    ):
        page.get_by_label(label).fill(value)
    page.get_by_label("activation checkpointing").check()
    page.get_by_role("button", name="Plan").click()
    gpt2_xl = {"kind": "gpt", "vocab_size": 50257, "n_layer": 48, "n_head": 25, "n_embd": 1600, "block_size": 1024}
    body = {
        "model": gpt2_xl,
        "num_gpus": 8,
        "gpu_memory_gb": 80,
        "micro_batch_size": 1,
        "activation_checkpointing": True,
    }
    plan = server.api.post("/v1/plan", json=body).json()
    expect(page.locator("[data-field='num_params']")).to_have_text(f"{plan['num_params']:,}")
    _check_plan_shown(page, plan)
    expect(page).to_have_url(re.compile(r"source=gpt"))
    assert page.evaluate("window.zero1FirstLoad") is True, "the page reloaded"
    ui.screenshot(page, "planner-gpt")
    ui.assert_no_console_errors()


GPT_7B = json.loads((ROOT / "examples" / "gpt-7.5b.json").read_text())["model"]


def _check_recommendations_shown(page: Page, expected: dict) -> None:
    rows = page.locator("#recommendations tbody tr")
    expect(rows).to_have_count(expected["count"])
    for index, item in enumerate(expected["recommendations"]):
        row = rows.nth(index)
        expect(row).to_have_attribute("data-num-gpus", str(item["num_gpus"]))
        expect(row).to_have_attribute("data-micro-batch-size", str(item["micro_batch_size"]))
        expect(row).to_have_attribute("data-checkpointing", str(item["activation_checkpointing"]).lower())
        expect(row).to_have_attribute("data-zero-stage", str(item["zero_stage"]))
        expect(row.locator("td").nth(4)).to_have_text(str(item["zero_stage"]))
        expect(row).to_have_attribute("data-total-bytes", str(item["total_bytes"]))
        expect(row.locator("td.why")).to_have_text(item["why"])


def test_the_planner_recommends_what_fits_for_a_global_batch(ui, server):
    page = ui.open("/plan")
    page.evaluate("window.zero1FirstLoad = true")
    page.get_by_label("GPT spec").check()
    for label, key in (
        ("Vocabulary", "vocab_size"),
        ("Layers", "n_layer"),
        ("Heads", "n_head"),
        ("Width (n_embd)", "n_embd"),
        ("Context (block_size)", "block_size"),
    ):
        page.get_by_label(label).fill(str(GPT_7B[key]))
    page.get_by_label("Micro-batch").fill("1")
    page.get_by_label("GPUs (N)").fill("64")
    page.get_by_label("GPU memory (GB)").fill("80")
    page.get_by_label("Precision").select_option("bf16")
    page.get_by_label("Global batch size").fill("64")
    page.get_by_role("button", name="Plan").click()
    body = {"model": GPT_7B, "global_batch_size": 64, "max_gpus": 64, "gpu_memory_gb": 80, "precision": "bf16"}
    expected = server.api.post("/v1/plan/recommend", json=body).json()
    assert expected["count"] == len(expected["recommendations"]) > 1
    _check_recommendations_shown(page, expected)
    expect(page.locator("#recommend-summary [data-field='formula']")).to_have_text(expected["cost_model"]["formula"])
    expect(page.locator("#recommend-error")).to_be_hidden()
    expect(page).to_have_url(re.compile(r"/plan\?.*global_batch_size=64"))
    assert page.evaluate("window.zero1FirstLoad") is True, "the page reloaded"
    ui.screenshot(page, "planner-recommend")
    url = page.url

    page.get_by_label("Global batch size").fill("")  # no global batch: no recommendations
    page.get_by_role("button", name="Plan").click()
    expect(page.locator("#recommend-result")).to_be_hidden()
    ui.assert_no_console_errors()

    page = ui.open(url, javascript=False)  # the same table from the first paint
    _check_recommendations_shown(page, expected)
    page = ui.open(url, width=375, height=740)
    expect(page.locator("#recommendations tbody tr")).to_have_count(expected["count"])
    assert _no_horizontal_scroll(page), "the recommendations scroll the page sideways at 375 px"
    ui.screenshot(page, "phone-planner-recommend")

    page = ui.open(url.replace("num_gpus=64", "num_gpus=1"), javascript=False)
    expect(page.locator("#recommend-error")).to_contain_text("nothing fits within max_gpus = 1")
    expect(page.locator("#recommend-list")).to_be_hidden()
    invalid = server.api.get(
        "/plan", params={"source": "gpt", "n_layer": "2", "n_head": "4", "n_embd": "128", "global_batch_size": "0"}
    )
    assert (
        invalid.status_code == 422 and "global_batch_size: Input should be greater than or equal to 1" in invalid.text
    )
    ui.assert_no_console_errors()


@pytest.mark.parametrize("num_gpus", ["1e1000000", "1e5000", "9" * 5000])
def test_a_huge_number_in_the_planner_is_a_422_at_once_while_other_routes_answer(server, num_gpus):
    """int() of 1e1000000 would hold the server's GIL for tens of seconds; repr() of 1e5000 as an int raises.
    The 422 says the number reached validation as the text it was typed as, so the server never expanded
    it (the test below watches int() in _number itself); the health checks asked meanwhile are answered."""
    answers: list[tuple[int, str]] = []

    def plan() -> None:
        response = httpx.get(f"{server.base}/plan", params={"num_gpus": num_gpus}, timeout=120)
        answers.append((response.status_code, response.text))

    thread = threading.Thread(target=plan)
    thread.start()
    for _ in range(5):  # while the plan is asked for: every route must keep answering
        assert httpx.get(f"{server.base}/healthz", timeout=10).status_code == 200
    thread.join(timeout=120)
    [(status, text)] = answers
    assert status == 422 and "num_gpus: Input should be a number, not a string" in text, text[:500]


@pytest.mark.parametrize("text", ["1e1000000", "-1e1000000", "1e5000", "9" * 5000, "1" + "0" * 30, "0." + "1" * 31])
def test_the_planner_leaves_a_number_of_more_than_30_digits_to_validation(text, monkeypatch):
    """The text comes back as it was given, and int() was never asked to expand it (int() is watched)."""
    expanded = watch_int(monkeypatch, "service.dashboard.routes")
    assert _number(text) == text and expanded.decimals == []
    assert _number("9" * 30) == int("9" * 30) and _number("7.5e9") == 7_500_000_000 and _number("0.5") == 0.5
    assert expanded.decimals == [Decimal("9" * 30), Decimal("7.5e9")]  # the watch sees the ones within the bound


# --------------------------------------------------------------------------- filter, no JavaScript, phone, weight


def test_the_status_filter_updates_the_table_in_place(ui, server):
    page = ui.open("/")
    page.evaluate("window.zero1FirstLoad = true")
    page.get_by_label("Status").select_option("failed")
    expect(page).to_have_url(re.compile(r"/\?status=failed$"))
    failed = server.api.get("/v1/jobs", params={"status": "failed", "limit": 100}).json()["data"]
    rows = page.locator("#jobs tbody tr")
    expect(rows).to_have_count(len(failed))
    assert set(rows.evaluate_all("rows => rows.map(r => r.dataset.status)")) == {"failed"}
    page.get_by_label("Status").select_option("")
    expect(rows).to_have_count(TABLE_LIMIT)
    expect(page.locator(f"#job-{SEEDED_JOBS} .job-name")).to_have_text(HTML_NAME)  # a row the script drew
    assert page.evaluate("window.zero1FirstLoad") is True, "the page reloaded"
    ui.assert_no_console_errors()


def test_the_tag_filter_shows_the_tagged_jobs_in_place_and_a_jobs_tag_links_to_them(ui, server):
    tagged = server.api.get("/v1/jobs", params={"tag": TAGGED, "limit": 100}).json()["data"]
    assert 1 < len(tagged) < TABLE_LIMIT and all(job["tags"] == [TAGGED] for job in tagged)
    page = ui.open("/")
    page.evaluate("window.zero1FirstLoad = true")
    rows = page.locator("#jobs tbody tr")
    page.get_by_label("Tag").fill(TAGGED)
    page.get_by_label("Tag").press("Enter")
    expect(page).to_have_url(re.compile(rf"/\?tag={TAGGED}$"))
    expect(rows).to_have_count(len(tagged))
    assert rows.evaluate_all("rows => rows.map(r => Number(r.dataset.id))") == [job["id"] for job in tagged]
    expect(rows.first.locator(".job-tag")).to_have_text(TAGGED)
    page.get_by_label("Status").select_option("failed")  # both filters at once
    expect(page).to_have_url(re.compile(rf"/\?status=failed&tag={TAGGED}$"))
    expect(rows).to_have_count(sum(job["status"] == "failed" for job in tagged))
    assert page.evaluate("window.zero1FirstLoad") is True, "the page reloaded"

    page = ui.open(f"/jobs/{tagged[0]['id']}")
    page.locator(".job-tags .job-tag").click()  # the job page's tag: the table of its jobs, from the first paint
    expect(page).to_have_url(re.compile(rf"/\?tag={TAGGED}$"))
    expect(page.locator("#jobs tbody tr")).to_have_count(len(tagged))
    expect(page.get_by_label("Tag")).to_have_value(TAGGED)
    ui.assert_no_console_errors()


def test_without_javascript_every_page_reads_from_the_first_paint(ui, server):
    page = ui.open("/", javascript=False)
    rows = page.locator("#jobs tbody tr")
    expect(rows).to_have_count(TABLE_LIMIT)
    expect(page.locator("#cluster")).to_contain_text("80.00 GB per GPU, simulated")
    cluster = server.api.get("/v1/cluster").json()  # where a job's data and models may lie, as the API says
    expect(page.locator('#cluster [data-field="data-roots"] code')).to_have_text(cluster["data_roots"])
    expect(page.locator('#cluster [data-field="model-roots"] code')).to_have_text(cluster["model_roots"])
    expect(page.locator(f"#job-{SEEDED_JOBS} .job-name")).to_have_text(HTML_NAME)  # escaped by the server
    page.get_by_label("Status").select_option("cancelled")
    page.get_by_role("button", name="Filter").click()  # a plain GET form
    expect(page).to_have_url(re.compile(r"/\?status=cancelled&tag=$"))  # the form sends its empty tag too
    assert set(rows.evaluate_all("rows => rows.map(r => r.dataset.status)")) == {"cancelled"}
    ui.screenshot(page, "nojs-dashboard")

    succeeded = server.api.get("/v1/jobs", params={"status": "succeeded", "limit": 1}).json()["data"][0]
    page = ui.open(f"/jobs/{succeeded['id']}", javascript=False)
    metrics = server.api.get(f"/v1/jobs/{succeeded['id']}/metrics", params={"max_points": 200}).json()["data"]
    assert int(page.locator("#loss-chart").get_attribute("data-points")) == len(metrics) > 0
    assert page.locator("#loss-chart path.line").get_attribute("d").startswith("M")
    assert int(page.locator("#loss-chart path.eval-line").get_attribute("data-points")) == sum(
        m["eval_loss"] is not None for m in metrics
    )
    for part in PARTS:
        cell = page.locator(f'#breakdown tr[data-part="{part}"] td[data-bytes]')
        assert int(cell.get_attribute("data-bytes")) == succeeded["plan"]["per_gpu"][f"{part}_bytes"]
    expect(page.locator("#cancel")).to_be_hidden()
    ui.screenshot(page, "nojs-job")

    # a seeded job evaluated every 5th step: its held-out loss is a second series, and the latest in the strip
    listed = server.api.get("/v1/jobs", params={"status": "succeeded", "limit": 50}).json()["data"]
    seeded = next(j for j in listed if j["name"].startswith("history-"))
    page = ui.open(f"/jobs/{seeded['id']}", javascript=False)
    evaluated = server.api.get(f"/v1/jobs/{seeded['id']}/metrics", params={"evaluated": True}).json()["data"]
    assert int(page.locator("#loss-chart path.eval-line").get_attribute("data-points")) == len(evaluated) == 4
    assert page.locator("#loss-chart path.eval-line").get_attribute("d").count("L") == 3
    expect(page.locator('#job-stats [data-field="eval-loss"]')).to_have_text(f"{evaluated[-1]['eval_loss']:.4g}")

    page = ui.open("/plan?source=params&num_params=7.5e9&num_gpus=64&gpu_memory_gb=80&stage=1", javascript=False)
    total = page.locator('#plan-breakdown tr[data-part="total"] td[data-bytes]')
    expect(total).to_have_attribute("data-bytes", "31406250000")  # the seed's 31.40625 GB
    expect(page.get_by_label("Layers")).to_be_visible()  # both sources show; the radio picks one
    ui.screenshot(page, "nojs-planner")
    ui.assert_no_console_errors()

    invalid = server.api.get("/plan", params={"num_params": "lots", "num_gpus": "0"})
    assert invalid.status_code == 422 and "num_gpus: Input should be greater than or equal to 1" in invalid.text
    assert server.api.get("/jobs/999999").status_code == 404


def test_readable_at_phone_width_without_horizontal_scrolling(ui, server):
    succeeded = server.api.get("/v1/jobs", params={"status": "succeeded", "limit": 1}).json()["data"][0]
    for path, name in (("/", "phone-dashboard"), (f"/jobs/{succeeded['id']}", "phone-job"), ("/plan", "phone-planner")):
        page = ui.open(path, width=375, height=740)
        page.wait_for_load_state("load")
        assert _no_horizontal_scroll(page), f"{path} scrolls sideways at 375 px"
        ui.screenshot(page, name)
    page = ui.open("/", width=375, height=740)
    first = page.locator("#jobs tbody tr").first
    assert first.bounding_box()["width"] <= 375  # each job is a card of its own
    page.keyboard.press("Tab")
    skip = page.get_by_role("link", name="Skip to content")
    expect(skip).to_be_focused()
    assert skip.bounding_box()["y"] >= 0  # the skip link shows itself when focused
    ui.assert_no_console_errors()


def test_first_paint_of_the_dashboard_is_under_200_kb_with_100_jobs(ui, server, report):
    assert len(server.api.get("/v1/jobs", params={"limit": 500}).json()["data"]) >= SEEDED_JOBS
    page = ui.new_page()
    finished = []
    page.on("requestfinished", lambda request: finished.append(request))
    page.goto("/", wait_until="load")
    expect(page.locator("#jobs tbody tr")).to_have_count(TABLE_LIMIT)
    first_paint = [r for r in finished if r.resource_type in ("document", "stylesheet", "script", "image", "font")]
    assert {r.resource_type for r in first_paint} >= {"document", "stylesheet", "script"}
    sizes = {r.url.removeprefix(server.base): r.sizes() for r in first_paint}
    total = sum(s["responseBodySize"] + s["responseHeadersSize"] for s in sizes.values())
    detail = ", ".join(f"{url} {s['responseBodySize'] + s['responseHeadersSize']:,} B" for url, s in sizes.items())
    report.lines.append(f"first paint of / with {SEEDED_JOBS}+ jobs: {total:,} bytes ({detail})")
    assert total < FIRST_PAINT_LIMIT_BYTES, detail
    ui.assert_no_console_errors()


# --------------------------------------------------------------------------- the pieces, without a browser


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (None, "—"),
        (0, "0 B"),
        (999, "999 B"),
        (1_538_048, "1.54 MB"),
        (31_406_250_000, "31.41 GB"),
        (-1_500_000_000, "-1.50 GB"),
        (2 * 10**12, "2.00 TB"),
    ],
)
def test_bytes_read_in_decimal_units_as_the_planner_counts_them(num_bytes, text):
    assert human_bytes(num_bytes) == text


def test_durations_and_significant_digits():
    assert [duration(s) for s in (None, -3, 7.9, 125, 3723)] == ["—", "0s", "7s", "2m 05s", "1h 02m 03s"]
    assert [significant(v) for v in (None, 4.15923, 1.5, 0.000012345)] == ["—", "4.159", "1.5", "1.234e-05"]


def test_the_sweep_melts_toward_the_4_psi_floor_at_stage_1():
    from service.planning.plans import make_plan, plan_public
    from service.schemas.plan_requests import PlanRequest

    cluster = ClusterCapacity(num_gpus=64, num_gpus_free=64, gpu_memory_bytes=80 * GB, simulated=True)

    def plan_at(stage: int) -> dict:
        request = PlanRequest(num_params=7_500_000_000, num_gpus=64, stage=stage)
        return plan_public(make_plan(request, cluster=cluster, overhead_bytes=0)).model_dump()

    plan = plan_at(1)
    assert charts.floor_bytes(plan["per_gpu"], stage=1) == 30 * GB  # 4Ψ
    assert charts.floor_bytes(plan_at(0)["per_gpu"], stage=0) == 120 * GB  # plain DDP shards nothing: 16Ψ
    assert charts.floor_bytes(plan_at(3)["per_gpu"], stage=3) == 0
    stage2 = plan_at(2)["per_gpu"]  # 2Ψ of weights and the gradient buckets staged at once, which no N shards
    assert stage2["buckets_bytes"] > 0 and charts.floor_bytes(stage2, stage=2) == 15 * GB + stage2["buckets_bytes"]
    chart = charts.sweep_chart(plan["sweep"], gpu_memory_bytes=80 * GB, floor_bytes=30 * GB)
    heights = [bar.height for bar in chart.bars]
    assert heights == sorted(heights, reverse=True) and [bar.fits for bar in chart.bars][:2] == [False, True]
    assert chart.bars[-1].y < chart.floor_y + 1 and chart.memory_y is not None


def test_no_bar_label_sits_on_the_memory_line_and_a_small_models_bars_read_in_its_unit():
    from service.planning.plans import make_plan, plan_public
    from service.schemas.plan_requests import PlanRequest

    cluster = ClusterCapacity(num_gpus=64, num_gpus_free=64, gpu_memory_bytes=80 * GB, simulated=True)

    def sweep(num_params: int) -> list[dict]:
        plan = make_plan(PlanRequest(num_params=num_params, num_gpus=64), cluster=cluster, overhead_bytes=0)
        return plan_public(plan).model_dump()["sweep"]

    for memory_gb in (76, 80, 90):  # the 75 GB bar at N = 2 just under, on and well below the line
        chart = charts.sweep_chart(sweep(7_500_000_000), gpu_memory_bytes=memory_gb * GB, floor_bytes=30 * GB)
        for bar in chart.bars:  # the label's box, halo included, keeps clear of the line
            top = bar.label_y - charts.VALUE_LABEL_H
            bottom = bar.label_y + 1.5
            assert not top < chart.memory_y < bottom, (memory_gb, bar)
            assert bar.label_y < bar.y  # above its bar
    assert chart.bars[1].label == "75" and chart.unit == "GB"
    small = charts.sweep_chart(sweep(1_000_000), gpu_memory_bytes=80 * GB, floor_bytes=4_000_000)
    assert small.unit == "MB" and [bar.label for bar in small.bars][:3] == ["16", "10", "7"]
    assert all(len(bar.label) <= 5 for bar in small.bars)


def test_a_line_chart_breaks_where_a_value_is_missing():
    chart = charts.line_chart([(0, 4.0), (1, None), (2, 2.0), (3, 1.0)])
    assert chart.num_points == 3 and chart.path.count("M") == 2 and chart.path.count("L") == 1
    assert chart.first == (0, 4.0) and chart.last == (3, 1.0)
    assert charts.line_chart([(0, None)]).path == ""
    flat = charts.line_chart([(5, 1.0)])  # one point sits mid-chart instead of dividing by zero
    assert flat.path == f"M{charts.LEFT + charts.PLOT_W / 2:.1f},{charts.TOP + charts.PLOT_H / 2:.1f}"


def test_a_second_series_shares_the_axes_and_draws_one_line():
    chart = charts.line_chart([(0, 4.0), (9, 1.0)], second=[(4, 6.0), (9, 2.0)])
    assert chart.y_range == (1.0, 6.0) and chart.second_points == 2
    assert chart.second_path.count("M") == 1 and chart.second_path.count("L") == 1
    top = f"{charts.TOP:.1f}"
    assert chart.second_path.split()[0].endswith(f",{top}")  # 6.0, the highest value, at the top of the plot
    assert charts.line_chart([(0, 1.0)]).second_path == ""


def test_an_elastic_jobs_world_size_is_drawn_as_steps():
    """4 -> 2 at step 10: a point at step 10 with the old N first, so the line drops straight down."""
    assert charts.steps_of([(0, 4), (5, 4), (10, 2), (12, None), (15, 2), (20, 4)]) == [
        (0, 4),
        (5, 4),
        (10, 4),
        (10, 2),
        (15, 2),
        (20, 2),
        (20, 4),
    ]
    assert charts.steps_of([]) == []


def test_the_table_puts_running_jobs_first_then_the_queue_in_order_then_the_newest():
    from types import SimpleNamespace

    jobs = [
        SimpleNamespace(id=i, status=status, queue_position=position)
        for i, status, position in (
            (1, "succeeded", None),
            (2, "queued", 2),
            (3, "running", None),
            (4, "queued", 1),
            (5, "failed", None),
            (6, "starting", None),
            (7, "restarting", None),
        )
    ]
    assert [job.id for job in sorted(jobs, key=table_order)] == [7, 3, 6, 4, 2, 5, 1]
