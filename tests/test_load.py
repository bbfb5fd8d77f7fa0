"""Load on a real `zero1 serve` over loopback: 200 concurrent submits and 2,000 reads with bad requests mixed in.

Checked: no 5xx; every bad request gets its own 4xx; every accepted job is in the database
exactly once and each Idempotency-Key names one job; none is lost; the jobs that hold GPUs
never hold more than the cluster's 4, neither in any sample taken during the run nor at any
point of the events table replayed in time order. Afterwards every job still active is
cancelled, and the server stops on SIGTERM.

Packages: service.api, service.scheduling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from service.store.tables import Job, JobEvent

from figures import record as record_figures
from helpers import TERMINAL, free_port, wait_healthy

ZERO1 = str(Path(sys.executable).with_name("zero1"))
NUM_GPUS = 4
NUM_SUBMITS = 200
NUM_READS = 2_000
NUM_READERS = 20
NUM_REPLAYS = 20  # submits sent twice at once, same key and body: one job, one 201
ACTIVE = ("starting", "running", "restarting")
DEADLINE_S = 120


def job_body(i: int) -> dict:
    """A tiny MLP for a few steps; one in four takes 2 GPUs, the others 1, so that most wait in the queue."""
    return {
        "name": f"load-{i:03d}",
        "model": {"kind": "mlp", "sizes": [8, 16, 4]},
        "num_gpus": 2 if i % 4 == 3 else 1,
        "precision": "fp32",
        "steps": 5,
        "micro_batch_size": 2,
        "seed": i,
    }


def bad_requests(known_id: int) -> list[tuple[str, str, dict, int, str]]:
    """(method, url, httpx kwargs, expected status, what) of requests that must each get that 4xx."""
    body = job_body(0)
    raw = {"headers": {"content-type": "application/json"}}
    return [
        ("POST", "/v1/jobs", {"content": b'{"name": "x", "model": ', **raw}, 422, "malformed JSON"),
        ("POST", "/v1/jobs", {"content": b"\xff\xfe{}", **raw}, 422, "body not UTF-8"),
        ("POST", "/v1/jobs", {"json": {**body, "num_gpus": 0}}, 422, "num_gpus 0"),
        ("POST", "/v1/jobs", {"json": {**body, "steps": "five"}}, 422, "steps a string"),
        ("POST", "/v1/jobs", {"json": {**body, "num_gpus": 8}}, 422, "more GPUs than the cluster"),
        ("POST", "/v1/jobs", {"json": {k: v for k, v in body.items() if k != "model"}}, 422, "no model"),
        ("GET", f"/v1/jobs/{10**12 + known_id}", {}, 404, "unknown job"),
        ("GET", f"/v1/jobs/{10**12 + known_id}/metrics", {}, 404, "metrics of an unknown job"),
        ("POST", f"/v1/jobs/{10**12 + known_id}/cancel", {}, 404, "cancel an unknown job"),
        ("GET", "/v1/jobs/abc", {}, 422, "a job id that is no number"),
        ("GET", "/v1/jobs", {"params": {"status": "sleeping"}}, 422, "unknown status"),
        ("GET", "/v1/jobs", {"params": {"limit": 0}}, 422, "limit 0"),
        ("GET", f"/v1/jobs/{known_id}/metrics", {"params": {"max_points": 1}}, 422, "max_points 1"),
    ]


@dataclass
class Record:
    kind: str
    """submit, read, bad, sample or cancel."""
    what: str
    status: int
    latency_s: float
    expected: int | None = None


@dataclass
class Load:
    client: httpx.AsyncClient
    records: list[Record] = field(default_factory=list)
    by_key: dict[str, list[httpx.Response]] = field(default_factory=lambda: defaultdict(list))
    accepted_ids: list[int] = field(default_factory=list)
    gpu_samples: list[tuple[int, int]] = field(default_factory=list)
    """(GPUs of the jobs listed as starting/running/restarting, the cluster's num_gpus_free)."""

    async def call(self, kind: str, what: str, method: str, url: str, *, expected: int | None = None, **kwargs):
        start = time.perf_counter()
        response = await self.client.request(method, url, **kwargs)
        self.records.append(Record(kind, what, response.status_code, time.perf_counter() - start, expected))
        return response

    async def submit(self, i: int) -> None:
        key = f"load-key-{i:03d}"
        r = await self.call(
            "submit", "POST /v1/jobs", "POST", "/v1/jobs", json=job_body(i), headers={"Idempotency-Key": key}
        )
        self.by_key[key].append(r)
        if r.status_code in (200, 201):
            self.accepted_ids.append(r.json()["id"])
        if i < 10:  # the same key with another body, once the first has its answer: a 409
            other = {**job_body(i), "steps": 6}
            await self.call(
                "bad",
                "Idempotency-Key reused with another body",
                "POST",
                "/v1/jobs",
                expected=409,
                json=other,
                headers={"Idempotency-Key": key},
            )

    async def reader(self, worker: int, num_reads: int) -> None:
        rng = random.Random(worker)
        for n in range(num_reads):
            job_id = rng.choice(self.accepted_ids) if self.accepted_ids else None
            choice = rng.randrange(4) if job_id is not None else 0
            if choice == 0:
                await self.call("read", "GET /v1/cluster", "GET", "/v1/cluster", expected=200)
            elif choice == 1:
                params = {"limit": 20} if rng.random() < 0.5 else {"limit": 20, "status": ["queued", "running"]}
                await self.call("read", "GET /v1/jobs", "GET", "/v1/jobs", expected=200, params=params)
            elif choice == 2:
                await self.call("read", "GET /v1/jobs/{id}", "GET", f"/v1/jobs/{job_id}", expected=200)
            else:
                await self.call(
                    "read",
                    "GET /v1/jobs/{id}/metrics",
                    "GET",
                    f"/v1/jobs/{job_id}/metrics",
                    expected=200,
                    params={"max_points": 50},
                )
            if n % 10 == 5:  # a bad request after every tenth read
                bad = bad_requests(job_id or 1)
                method, url, kwargs, status, what = bad[(worker + n) % len(bad)]
                await self.call("bad", what, method, url, expected=status, **kwargs)

    async def sample_gpus(self, stop: asyncio.Event) -> None:
        """What the API says is held, while the load runs; the samples are checked afterwards."""
        while not stop.is_set():
            cluster = await self.call("sample", "GET /v1/cluster", "GET", "/v1/cluster", expected=200)
            active = await self.call(
                "sample",
                "GET /v1/jobs?status=active",
                "GET",
                "/v1/jobs",
                expected=200,
                params={"status": list(ACTIVE), "limit": 500},
            )
            held = sum(job["num_gpus"] for job in active.json()["data"])
            self.gpu_samples.append((held, cluster.json()["num_gpus_free"]))
            await asyncio.sleep(0.05)


async def run_load(base: str) -> tuple[Load, float, int]:
    """The load, then cancel_all; the seconds the load took and the requests sent in them."""
    # idle connections expire on this side first (the server keeps one 75 s: service/cli/server.py's
    # KEEP_ALIVE_S); a request sent on one the server is closing would fail with a ReadError
    limits = httpx.Limits(
        max_connections=NUM_SUBMITS + NUM_READERS + 8, max_keepalive_connections=64, keepalive_expiry=1.0
    )
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        load = Load(client)
        stop = asyncio.Event()
        sampler = asyncio.create_task(load.sample_gpus(stop))
        start = time.perf_counter()
        submits = [load.submit(i) for i in range(NUM_SUBMITS)] + [load.submit(i) for i in range(NUM_REPLAYS)]
        readers = [load.reader(w, NUM_READS // NUM_READERS) for w in range(NUM_READERS)]
        await asyncio.gather(*submits, *readers)
        elapsed_s = time.perf_counter() - start
        num_requests = len(load.records)
        await cancel_all(load)
        stop.set()
        await sampler
    return load, elapsed_s, num_requests


async def cancel_all(load: Load) -> None:
    """Cancel every job not yet finished, then poll (with a deadline) until none is queued or active."""
    unfinished = {"status": ["queued", *ACTIVE], "limit": 500}
    jobs = (await load.call("sample", "GET /v1/jobs?status=unfinished", "GET", "/v1/jobs", params=unfinished)).json()
    responses = await asyncio.gather(
        *(
            load.call("cancel", "POST /v1/jobs/{id}/cancel", "POST", f"/v1/jobs/{job['id']}/cancel")
            for job in jobs["data"]
        )
    )
    for _job, r in zip(jobs["data"], responses, strict=True):
        # 409 only for a job that finished between the listing and the cancel
        assert r.status_code == 202 or (r.status_code == 409 and "already" in r.json()["message"]), r.text
    deadline = time.monotonic() + DEADLINE_S
    while (await load.call("sample", "GET /v1/jobs?status=unfinished", "GET", "/v1/jobs", params=unfinished)).json()[
        "data"
    ]:
        assert time.monotonic() < deadline, f"jobs still unfinished {DEADLINE_S} s after they were cancelled"
        await asyncio.sleep(0.1)


def _stop(server: subprocess.Popen) -> bool:
    """SIGTERM, then wait; whatever of its process group is left after that is killed. True if it stopped."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=DEADLINE_S)
        stopped = True
    except subprocess.TimeoutExpired:
        stopped = False
    with contextlib.suppress(ProcessLookupError):  # Ray's workers of the embedded cluster, if any outlived it
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()
    return stopped


def gpus_held(session: Session) -> tuple[int, int]:
    """Replay every transition in time order: the most GPUs that starting/running/restarting jobs held
    at once, and what they hold after the last transition."""
    num_gpus = dict(session.execute(select(Job.id, Job.num_gpus)).all())
    events = session.execute(select(JobEvent.job_id, JobEvent.to_status).order_by(JobEvent.at, JobEvent.id)).all()
    status: dict[int, str] = {}
    held = peak = 0
    for job_id, to_status in events:
        was_active = status.get(job_id) in ACTIVE
        status[job_id] = to_status
        held += num_gpus[job_id] * ((to_status in ACTIVE) - was_active)
        peak = max(peak, held)
    return peak, held


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def report(load: Load, elapsed_s: float, num_requests: int, peak: int, statuses: Counter) -> None:
    by_kind: dict[str, list[Record]] = defaultdict(list)
    for record in load.records:
        by_kind[record.kind].append(record)
    print(f"\n{'requests':<10} {'count':>6} {'p50 ms':>8} {'p99 ms':>8}  status codes")
    for kind in ("submit", "read", "bad", "sample", "cancel"):
        records = by_kind[kind]
        if not records:
            continue
        ms = [r.latency_s * 1000 for r in records]
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(Counter(r.status for r in records).items()))
        print(f"{kind:<10} {len(records):>6} {percentile(ms, 50):>8.1f} {percentile(ms, 99):>8.1f}  {codes}")
    print(
        f"{'all':<10} {len(load.records):>6}  of which {num_requests} in the {elapsed_s:.1f} s of load "
        f"({num_requests / elapsed_s:.0f} requests/s), the rest cancelling and draining"
    )
    print(
        f"jobs: {sum(statuses.values())} stored, {dict(statuses)}; GPUs held at most {peak} of {NUM_GPUS} "
        f"(events), {max((held for held, _ in load.gpu_samples), default=0)} (in {len(load.gpu_samples)} samples)"
    )


@pytest.mark.ray  # a `zero1 serve` with its embedded Ray
@pytest.mark.slow
def test_load_keeps_every_job_once_and_the_gpus_within_the_cluster(tmp_path):
    port = free_port()
    database = tmp_path / "zero1.db"
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZERO1_")}  # RAY_TMPDIR stays
    env |= {
        "ZERO1_SIMULATED_GPUS": str(NUM_GPUS),
        "ZERO1_SIMULATED_GPU_MEMORY_GB": "80",
        "ZERO1_CPUS_PER_WORKER": "0.5",
        "ZERO1_SCHEDULER_INTERVAL_S": "0.05",
        "ZERO1_DATABASE_URL": f"sqlite:///{database}",
        "ZERO1_CHECKPOINT_URI": str(tmp_path / "checkpoints"),
    }
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:  # its own process group: the embedded Ray's processes go with it
        server = subprocess.Popen(
            [ZERO1, "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server=server)
        load, elapsed_s, num_requests = asyncio.run(run_load(base))
    finally:
        stopped = _stop(server)
    log = log_path.read_text()
    engine = create_engine(f"sqlite:///{database}")
    try:
        with Session(engine) as session:
            jobs = session.execute(select(Job.id, Job.idempotency_key, Job.name, Job.status)).all()
            queued_events = Counter(session.scalars(select(JobEvent.job_id).where(JobEvent.to_status == "queued")))
            peak, held_at_end = gpus_held(session)
    finally:
        engine.dispose()
    report(load, elapsed_s, num_requests, peak, Counter(job.status for job in jobs))

    assert stopped, f"zero1 serve did not stop within {DEADLINE_S} s of SIGTERM:\n{log[-3000:]}"
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status tells why it stopped
    assert server.returncode in (0, -signal.SIGTERM), log[-3000:]
    assert "Application shutdown complete" in log

    server_errors = [r for r in load.records if r.status >= 500]
    assert not server_errors, server_errors[:10]
    wrong = [r for r in load.records if r.expected is not None and r.status != r.expected]
    assert not wrong, wrong[:10]
    assert sum(r.kind == "read" for r in load.records) == NUM_READS
    assert sum(r.kind == "bad" for r in load.records) >= NUM_READS // 10

    # one job per key: a replay of the same key and body answers 200 with the job its 201 created
    assert len(load.by_key) == NUM_SUBMITS
    for key, responses in load.by_key.items():
        assert sorted(r.status_code for r in responses) in ([201], [200, 201]), (key, [r.text for r in responses])
        assert len({r.json()["id"] for r in responses}) == 1, key
    assert sorted(job.id for job in jobs) == sorted(set(load.accepted_ids))  # none lost, none extra
    assert Counter(job.idempotency_key for job in jobs) == Counter(load.by_key.keys())  # each key once
    assert sorted(job.name for job in jobs) == [f"load-{i:03d}" for i in range(NUM_SUBMITS)]
    assert queued_events == Counter({job.id: 1 for job in jobs})  # each submitted once
    assert {job.status for job in jobs} <= set(TERMINAL)

    # the GPUs: never more than the cluster's, by the events and in every sample
    assert 0 < peak <= NUM_GPUS and held_at_end == 0, (peak, held_at_end)
    assert max(held for held, _ in load.gpu_samples) <= NUM_GPUS
    assert all(0 <= free <= NUM_GPUS for _, free in load.gpu_samples)
    record_figures(
        "load: 200 submits, 2,000 reads",
        requests=len(load.records),
        jobs_accepted=len(set(load.accepted_ids)),
        jobs_stored=len(jobs),
        responses_5xx=len(server_errors),
        gpus_overcommitted=max(0, peak - NUM_GPUS),
    )
