"""Control-plane speed: the jobs API and metrics ingestion, SQLite and PostgreSQL side by side.

    .venv/bin/python benchmarks/control_plane.py   # --jobs 1000 --metric-rows 100000 --backends sqlite,postgresql

For each backend it starts the real service, `zero1 serve` on a loopback port
(an embedded Ray with 4 logical GPUs; a database of its own: a SQLite file in a
temp dir, or a fresh PostgreSQL database zero1_bench_<hex> dropped at the end),
submits a blocker job that holds all 4 GPUs, and then measures, with one
keep-alive client and sequential requests:

- POST /v1/jobs: --jobs submissions of 4-GPU jobs, which stay queued behind the blocker;
- GET /v1/jobs?limit=50 and ?status=queued&limit=50 with those jobs stored;
- service.store.metric_rows.store_metrics inserting --metric-rows rows for one queued job,
  --batch-rows a transaction as the scheduler does (written by this process,
  straight into the service's database, while the service runs);
- GET /v1/jobs/{id}/metrics?max_points=500 on that job;
- GET /healthz with those jobs stored: it touches no database, so it is the floor that
  this machine's load (Ray, the blocker, the scheduler's ticks) sets under the other rows.

Prints one table. Targets: GET /v1/jobs p99 < 50 ms; ingestion >= 5,000 rows/s.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import httpx
import psycopg
from psycopg import sql

from service.store.db import Database
from service.store.metric_rows import store_metrics
from service.store.tables import Job

POSTGRES_SERVER = "host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=5"
TINY = {"kind": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
NUM_GPUS = 4
LIST_P99_TARGET_S = 50e-3
INGEST_TARGET_ROWS_PER_S = 5_000
BACKEND_NAMES = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}


def job_body(**overrides) -> dict:
    return {
        "name": "bench",
        "model": TINY,
        "num_gpus": NUM_GPUS,
        "precision": "fp32",
        "steps": 40,
        "micro_batch_size": 4,
        **overrides,
    }


@dataclass(slots=True)
class Timed:
    """Per-call latencies of one row and the wall time of the whole loop."""

    times_s: list[float]
    wall_s: float

    @property
    def p50_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def p99_s(self) -> float:
        ordered = sorted(self.times_s)
        return ordered[int(0.99 * (len(ordered) - 1))]

    @property
    def rate(self) -> float:
        return len(self.times_s) / self.wall_s


@dataclass(slots=True)
class Result:
    """One backend's measurements."""

    database: str
    health: Timed | None = None
    submit: Timed | None = None
    list_all: Timed | None = None
    list_queued: Timed | None = None
    metrics_get: Timed | None = None
    ingest_rows: int = 0
    ingest_s: float = math.nan


def _timed(fn: Callable[[], object], *, repeat: int, warmup: int = 0) -> Timed:
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return Timed(times, time.perf_counter() - start)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- databases and the server


def _postgres_admin() -> psycopg.Connection:
    """An autocommit connection to the server (CREATE/DROP DATABASE cannot run in a transaction)."""
    return psycopg.connect(POSTGRES_SERVER, autocommit=True)


@contextmanager
def _database(backend: str, tmp: Path) -> Iterator[tuple[str, str]]:
    """(url, description) of an empty database on `backend`; a PostgreSQL one is dropped after."""
    if backend == "sqlite":
        path = tmp / "zero1.db"
        yield f"sqlite:///{path}", f"SQLite {sqlite3.sqlite_version} (file {path}, WAL)"
        return
    name = f"zero1_bench_{secrets.token_hex(6)}"
    with _postgres_admin() as admin:
        server_version = admin.execute("SHOW server_version").fetchone()[0]
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    description = f"PostgreSQL {server_version} at 127.0.0.1:5432 (database {name}, psycopg {psycopg.__version__})"
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}", description
    finally:
        with _postgres_admin() as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextmanager
def _server(url: str, tmp: Path, *, start_timeout_s: float) -> Iterator[httpx.Client]:
    """`zero1 serve` on a free loopback port with its own Ray; a client to it; SIGTERM after."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("ZERO1_")}
    env.update(
        {
            "ZERO1_DATABASE_URL": url,
            "ZERO1_CHECKPOINT_URI": str(tmp / "checkpoints"),
            "ZERO1_RAY_NAMESPACE": f"zero1-bench-{secrets.token_hex(4)}",
            "ZERO1_SIMULATED_GPUS": str(NUM_GPUS),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's nodes, GCS and actors bind 127.0.0.1
            "RAY_TMPDIR": str(tmp / "ray"),  # short: Ray's socket paths must fit 107 bytes
        }
    )
    log_path = tmp / "server.log"
    zero1 = str(Path(sys.executable).with_name("zero1"))
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [zero1, "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: Ray's processes are ended with it
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            _wait_healthy(client, server, log_path, timeout_s=start_timeout_s)
            yield client
    finally:
        _stop(server)


def _wait_healthy(client: httpx.Client, server: subprocess.Popen, log_path: Path, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:]
            why = f"exited with {server.returncode}" if server.poll() is not None else f"not healthy in {timeout_s:g} s"
            raise SystemExit(f"zero1 serve {why}; its log ends:\n{tail}")
        time.sleep(0.25)


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM (uvicorn's graceful shutdown stops the scheduler and Ray), then SIGKILL the group."""
    if server.poll() is None:
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
            print(f"  zero1 serve stopped {time.monotonic() - start:.1f} s after SIGTERM", file=sys.stderr)
        except subprocess.TimeoutExpired:
            print("  zero1 serve still up 60 s after SIGTERM: killed", file=sys.stderr)
            server.kill()
            server.wait()
    with contextlib.suppress(ProcessLookupError):  # anything of Ray's left in the server's process group
        os.killpg(server.pid, signal.SIGKILL)


# --------------------------------------------------------------------------- the measurements


def _submit(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/jobs", json=body)
    if response.status_code != 201:
        raise SystemExit(f"POST /v1/jobs: {response.status_code} {response.text}")
    return response.json()


def _wait_for_blocker(client: httpx.Client, job_id: int, *, timeout_s: float) -> dict:
    """Wait until the blocker holds the GPUs and has stored a step (its ranks' start-up is over)."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("failed", "cancelled", "succeeded"):
            raise SystemExit(f"blocker job {job_id} ended: {job['status']} {job['error']}")
        if job["status"] == "running" and job["step"] is not None:
            return job
        if time.monotonic() > deadline:
            raise SystemExit(f"blocker job {job_id} still {job['status']} at step {job['step']} after {timeout_s:g} s")
        time.sleep(0.5)


def _measure_submit(client: httpx.Client, *, num_jobs: int) -> tuple[Timed, list[int]]:
    for _ in range(20):  # warm the request path without storing: dry runs plan and admit only
        client.post("/v1/jobs", json=job_body(), params={"dry_run": "true"}).raise_for_status()
    ids: list[int] = []

    def post() -> None:
        job = _submit(client, job_body(name=f"bench-{len(ids)}"))
        assert job["status"] == "queued", job["status"]
        ids.append(job["id"])

    return _timed(post, repeat=num_jobs), ids


def _measure_get(client: httpx.Client, path: str, *, repeat: int, check: Callable[[dict], None]) -> Timed:
    check(client.get(path).raise_for_status().json())

    def get() -> None:
        client.get(path).raise_for_status()

    return _timed(get, repeat=repeat, warmup=10)


def metric_rows(num_rows: int) -> list[dict]:
    """Rows shaped like the supervisor's poll(): rank 0's values, every rank's peak memory."""
    return [
        {
            "step": step,
            "loss": 4.2 * math.exp(-step / 20_000) + 0.01 * (step % 7),
            "grad_norm": 0.5 + (step % 13) / 13,
            "loss_scale": 1.0,
            "skipped": False,
            "step_time_s": 0.05 + (step % 5) * 1e-3,
            "tokens_per_s": 10_240.0,
            "mem_peak_bytes": [3_500_000 + 4096 * rank + step % 64 for rank in range(NUM_GPUS)],
            "mem_planned_bytes": 3_600_000,
        }
        for step in range(num_rows)
    ]


def _measure_ingest(url: str, job_id: int, *, num_rows: int, batch_rows: int) -> float:
    """Seconds for store_metrics to insert `num_rows` rows, one transaction of `batch_rows` each."""
    rows = metric_rows(num_rows)
    db = Database(url)
    try:
        start = time.perf_counter()
        for first in range(0, num_rows, batch_rows):
            with db.session() as session:  # as a scheduler tick: load the job, insert, note the latest
                store_metrics(session, session.get(Job, job_id), rows[first : first + batch_rows])
        seconds = time.perf_counter() - start
        with db.session() as session:
            job = session.get(Job, job_id)
            assert job.step == num_rows - 1, f"job {job_id} step {job.step}, expected {num_rows - 1}"
        return seconds
    finally:
        db.dispose()


def _cancel_blocker(client: httpx.Client, job_id: int, *, timeout_s: float) -> None:
    client.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
    deadline = time.monotonic() + timeout_s
    while client.get(f"/v1/jobs/{job_id}").json()["status"] != "cancelled":
        if time.monotonic() > deadline:
            raise SystemExit(f"blocker job {job_id} not cancelled within {timeout_s:g} s")
        time.sleep(0.2)


def run_backend(backend: str, args: argparse.Namespace) -> Result:
    tmp = Path(tempfile.mkdtemp(prefix="zero1-bench-"))
    try:
        with _database(backend, tmp) as (url, description), _server(url, tmp, start_timeout_s=180) as client:
            result = Result(database=description)
            blocker = _submit(client, job_body(name="blocker", steps=100_000_000))
            _wait_for_blocker(client, blocker["id"], timeout_s=240)
            print(f"  {BACKEND_NAMES[backend]}: service up, blocker job {blocker['id']} running", file=sys.stderr)

            result.submit, ids = _measure_submit(client, num_jobs=args.jobs)
            # the floor, under the same load as the reads: Ray, the blocker, the scheduler's ticks
            result.health = _measure_get(client, "/healthz", repeat=args.requests, check=lambda body: None)

            def full_page(body: dict) -> None:  # the blocker and the jobs
                assert len(body["data"]) == min(50, args.jobs + 1), len(body["data"])

            def queued_page(body: dict) -> None:
                assert len(body["data"]) == min(50, args.jobs), len(body["data"])
                assert all(j["status"] == "queued" and j["queue_position"] for j in body["data"])

            result.list_all = _measure_get(client, "/v1/jobs?limit=50", repeat=args.requests, check=full_page)
            result.list_queued = _measure_get(
                client, "/v1/jobs?status=queued&limit=50", repeat=args.requests, check=queued_page
            )
            print(f"  {BACKEND_NAMES[backend]}: {args.jobs} jobs submitted and listed; ingesting", file=sys.stderr)

            job_id = ids[-1]  # newest: it heads every list page, with its `latest` row
            result.ingest_s = _measure_ingest(url, job_id, num_rows=args.metric_rows, batch_rows=args.batch_rows)
            result.ingest_rows = args.metric_rows

            def thinned(body: dict) -> None:
                steps = [m["step"] for m in body["data"]]
                assert len(steps) <= 501 and steps[-1] == args.metric_rows - 1, (len(steps), steps[-1:])

            result.metrics_get = _measure_get(
                client, f"/v1/jobs/{job_id}/metrics?max_points=500", repeat=args.metrics_requests, check=thinned
            )
            _cancel_blocker(client, blocker["id"], timeout_s=60)
            return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- the table


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


Line = tuple[str, str, Callable[[Result], str], Callable[[Result], bool] | None, str]


def _rows(args: argparse.Namespace) -> list[Line]:
    """(measurement, statistic, cell, target met?, target) for each line of the table."""
    lines = [
        (f"POST /v1/jobs ({args.jobs:,} submits)", "jobs/s", lambda r: f"{r.submit.rate:,.1f}", None, ""),
        ("", "p50", lambda r: _fmt_s(r.submit.p50_s), None, ""),
        ("", "p99", lambda r: _fmt_s(r.submit.p99_s), None, ""),
        (
            f"GET /healthz, no database: the floor ({args.requests} req)",
            "p50",
            lambda r: _fmt_s(r.health.p50_s),
            None,
            "",
        ),
        ("", "p99", lambda r: _fmt_s(r.health.p99_s), None, ""),
    ]
    for label, attr in (("GET /v1/jobs?limit=50", "list_all"), ("GET /v1/jobs?status=queued&limit=50", "list_queued")):
        lines += [
            (f"{label} ({args.requests} req)", "p50", lambda r, a=attr: _fmt_s(getattr(r, a).p50_s), None, ""),
            (
                "",
                "p99",
                lambda r, a=attr: _fmt_s(getattr(r, a).p99_s),
                lambda r, a=attr: getattr(r, a).p99_s < LIST_P99_TARGET_S,
                "p99 < 50 ms",
            ),
            ("", "req/s", lambda r, a=attr: f"{getattr(r, a).rate:,.1f}", None, ""),
        ]
    lines += [
        (
            f"GET /v1/jobs/{{id}}/metrics?max_points=500 ({args.metrics_requests} req)",
            "p50",
            lambda r: _fmt_s(r.metrics_get.p50_s),
            None,
            "",
        ),
        (f"  on a job with {args.metric_rows:,} rows", "p99", lambda r: _fmt_s(r.metrics_get.p99_s), None, ""),
        (
            f"store_metrics, {args.metric_rows:,} rows, {args.batch_rows} a transaction",
            "rows/s",
            lambda r: f"{r.ingest_rows / r.ingest_s:,.0f}",
            lambda r: r.ingest_rows / r.ingest_s >= INGEST_TARGET_ROWS_PER_S,
            ">= 5,000 rows/s",
        ),
    ]
    return lines


def print_table(results: dict[str, Result], args: argparse.Namespace) -> None:
    backends = list(results)
    header = f"{'measurement':<58}{'':<8}" + "".join(f"{BACKEND_NAMES[b]:>22}" for b in backends) + "  target"
    print(header)
    print("-" * len(header))
    for measurement, stat, cell, met, target in _rows(args):
        cells = []
        for backend in backends:
            text = cell(results[backend])
            if met is not None:
                text += " met" if met(results[backend]) else " MISSED"
            cells.append(f"{text:>22}")
        print(f"{measurement:<58}{stat:<8}{''.join(cells)}  {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs submitted (and then stored) per backend")
    parser.add_argument("--metric-rows", type=int, default=100_000, help="metric rows ingested for one job")
    parser.add_argument("--batch-rows", type=int, default=500, help="metric rows per transaction")
    parser.add_argument("--requests", type=int, default=300, help="timed requests per list row and /healthz")
    parser.add_argument("--metrics-requests", type=int, default=100, help="timed GET .../metrics requests")
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := [b for b in backends if b not in BACKEND_NAMES]:
        parser.error(f"--backends: unknown {', '.join(unknown)} (choose from {', '.join(BACKEND_NAMES)})")
    if args.jobs < 1 or args.metric_rows < 1 or args.batch_rows < 1 or args.requests < 1 or args.metrics_requests < 1:
        parser.error("--jobs, --metric-rows, --batch-rows, --requests and --metrics-requests must be >= 1")

    results = {}
    load_before = os.getloadavg()[0]
    for backend in backends:
        print(f"{BACKEND_NAMES[backend]}: starting zero1 serve ...", file=sys.stderr)
        results[backend] = run_backend(backend, args)
    load_after = os.getloadavg()[0]

    print(
        f"zero1 {version('zero1')} control plane: {NUM_GPUS} logical GPUs, a blocker job training on all of them, "
        f"{args.jobs:,} jobs queued behind it; one keep-alive httpx client, sequential requests"
    )
    print(
        f"Python {platform.python_version()}, SQLAlchemy {version('sqlalchemy')}, FastAPI {version('fastapi')}, "
        f"uvicorn {version('uvicorn')}, Ray {version('ray')}, httpx {version('httpx')}; {os.cpu_count()} CPUs, "
        f"1-minute load average {load_before:.1f} at the start and {load_after:.1f} at the end"
    )
    for backend, result in results.items():
        print(f"{BACKEND_NAMES[backend]:<11} {result.database}")
    print()
    print_table(results, args)


if __name__ == "__main__":
    main()
