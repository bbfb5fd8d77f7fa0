"""Faults: a rank dies, the service is stopped (SIGTERM, SIGKILL), Ray dies with it.

Each test injects the fault for real (ray.kill of a rank's actor, a signal to a
`zero1 serve` process) and then checks the promises of docs/guarantees.md:
the job ends where an uninterrupted run ends, no accepted job is lost, and every
metric row is stored exactly once on the surviving curve.

Packages: service.scheduling, workers.runtime.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import ray
import torch
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from service.main import create_app
from service.scheduling.ray_launcher import supervisor_name
from workers.training.reader import read_shard

from conftest import make_settings
from figures import record
from helpers import COSINE, free_port, job_body, job_checkpoint_dir, wait_for

ZERO1 = str(Path(sys.executable).with_name("zero1"))


def kill_rank(namespace: str, job_id: int, attempt: int, rank: int) -> None:
    supervisor = ray.get_actor(supervisor_name(job_id, attempt), namespace=namespace)
    ray.kill(ray.get(supervisor.worker.remote(rank)), no_restart=True)


def final_shards(database_url: str, checkpoints: Path, job_id: int, *, step: int) -> list[dict]:
    directory = job_checkpoint_dir(database_url, checkpoints, job_id) / f"step-{step:09d}"
    assert (directory / "complete.json").is_file(), f"no complete checkpoint at {directory}"
    return [read_shard(path) for path in sorted(directory.glob("rank-*.safetensors"))]


def assert_same_state(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


def metric_rows(database_url: str, job_id: int) -> list[tuple[int, int, bool]]:
    """(attempt, step, superseded) of every stored row of the job."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            query = text("SELECT attempt, step, superseded FROM metrics WHERE job_id = :id ORDER BY id")
            return [(a, s, bool(x)) for a, s, x in connection.execute(query, {"id": job_id})]
    finally:
        engine.dispose()


def jobs_stored(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT count(*) FROM jobs")).scalar_one()
    finally:
        engine.dispose()


def surviving_steps(database_url: str, job_id: int) -> int:
    """How many distinct steps the job's surviving curve has (a gap or a duplicate shows elsewhere)."""
    return len({step for _, step, superseded in metric_rows(database_url, job_id) if not superseded})


def transitions(events: list[dict]) -> list[str]:
    return [e["to_status"] for e in events]


# --------------------------------------------------------------------------- a rank dies


def test_a_killed_rank_is_retried_from_its_checkpoint_and_ends_where_an_uninterrupted_run_ends(app):
    client, settings = app
    # the database trails the ranks by up to a second of rows (their batches): killing at step
    # 105 leaves rows after the checkpoint of step 99 stored and the next checkpoint far off
    steps = 300
    every = 100
    body = job_body(steps=steps, checkpoint_every=every, max_retries=2, optimizer=COSINE)
    victim = client.post("/v1/jobs", json={**body, "name": "killed"}).json()["id"]
    reference = client.post("/v1/jobs", json={**body, "name": "uninterrupted"}).json()["id"]
    job = lambda job_id: client.get(f"/v1/jobs/{job_id}").json()

    # past the checkpoint of step 99 and short of the next: the retry redoes steps 100..
    wait_for(lambda: job(victim), lambda j: (j["step"] or 0) >= every + 5, what="step 105")
    kill_rank(settings.ray_namespace, victim, attempt=0, rank=1)

    done = wait_for(lambda: job(victim), lambda j: j["status"] in ("succeeded", "failed"), what="the end")
    assert done["status"] == "succeeded", done
    assert done["attempt"] == done["num_retries"] == 1 and done["error"] is None and done["step"] == steps - 1
    events = client.get(f"/v1/jobs/{victim}/events").json()["data"]
    assert transitions(events) == ["queued", "starting", "running", "restarting", "running", "succeeded"]
    restart = events[3]["reason"]
    assert "rank 1 on node " in restart and "retry 1 of 2" in restart, restart
    resumed = int(restart.split("resumes from checkpoint step ")[1]) + 1
    assert resumed == every

    # the surviving curve: every step once, attempt 0 up to the checkpoint, attempt 1 after it
    curve = client.get(f"/v1/jobs/{victim}/metrics", params={"limit": 10_000}).json()["data"]
    assert [m["step"] for m in curve] == list(range(steps))
    assert {m["attempt"] for m in curve if m["step"] < resumed} == {0}
    assert {m["attempt"] for m in curve if m["step"] >= resumed} == {1}
    # the failed attempt's rows past the checkpoint are kept, marked superseded
    rows = metric_rows(settings.database_url, victim)
    superseded = [(a, s) for a, s, x in rows if x]
    assert superseded and all(a == 0 and s >= resumed for a, s in superseded)
    assert len(rows) == steps + len(superseded) == len(set((a, s) for a, s, _ in rows))

    wait_for(lambda: job(reference), lambda j: j["status"] == "succeeded", what="the reference run")
    killed, clean = (
        final_shards(settings.database_url, Path(settings.checkpoint_uri), j, step=steps - 1)
        for j in (victim, reference)
    )
    assert len(killed) == len(clean) == 2
    assert_same_state(killed, clean)  # bit for bit: parameters, moments and step counts
    straight = client.get(f"/v1/jobs/{reference}/metrics", params={"limit": 10_000}).json()["data"]
    assert [(m["lr"], m["loss"]) for m in curve] == [(m["lr"], m["loss"]) for m in straight]  # the cosine's rates too
    assert curve[0]["lr"] == 0.003 / 20 and curve[-1]["lr"] < 0.0004
    record(
        "a rank killed, retried",
        faults=1,
        jobs_accepted=2,
        jobs_stored=jobs_stored(settings.database_url),
        rows_expected=steps,
        rows_stored=surviving_steps(settings.database_url, victim),
    )


def test_a_job_out_of_retries_fails_with_the_rank_node_and_cause(app):
    client, settings = app
    body = job_body(steps=100_000, checkpoint_every=50, max_retries=1)
    job_id = client.post("/v1/jobs", json=body).json()["id"]
    job = lambda: client.get(f"/v1/jobs/{job_id}").json()

    wait_for(job, lambda j: j["status"] == "running" and (j["step"] or 0) >= 5, what="attempt 0 training")
    kill_rank(settings.ray_namespace, job_id, attempt=0, rank=0)
    wait_for(job, lambda j: j["attempt"] == 1 and j["status"] == "running", what="attempt 1 running")
    node = ray.get(ray.get_actor(supervisor_name(job_id, 1), namespace=settings.ray_namespace).poll.remote()).nodes[1]
    kill_rank(settings.ray_namespace, job_id, attempt=1, rank=1)

    failed = wait_for(job, lambda j: j["status"] == "failed", what="the job to fail")
    assert failed["error"]["rank"] == 1 and failed["error"]["node_id"] == node
    assert failed["error"]["exception"].endswith("Error") and failed["error"]["message"]
    events = client.get(f"/v1/jobs/{job_id}/events").json()["data"]
    assert transitions(events) == ["queued", "starting", "running", "restarting", "running", "failed"]
    assert f"rank 1 on node {node}: {failed['error']['exception']}" in events[-1]["reason"]
    assert events[-1]["reason"].endswith("after 1 of max_retries 1")
    reached = 0 if failed["step"] is None else failed["step"] + 1  # attempt 1 may die before its first row
    rows = assert_every_step_once(settings.database_url, job_id, steps=reached)
    record(
        "ranks killed past max_retries",
        faults=2,
        jobs_accepted=1,
        jobs_stored=jobs_stored(settings.database_url),
        rows_expected=reached,
        rows_stored=len({s for _, s, x in rows if not x}),
    )
    # the failed attempt's ranks and placement group go: Ray frees their GPUs
    wait_for(
        lambda: client.get("/v1/cluster").json(),
        lambda c: c["num_gpus_free"] == c["num_gpus"],
        what="every GPU free again",
        timeout_s=60,
    )


# --------------------------------------------------------------------------- the service stops


class Service:
    """`zero1 serve` as a child process, with its log in a file."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.database_url = f"sqlite:///{tmp_path / 'zero1.db'}"
        self.checkpoints = tmp_path / "checkpoints"
        self.log_path = tmp_path / "serve.log"
        self.env = {
            **os.environ,
            "ZERO1_DATABASE_URL": self.database_url,
            "ZERO1_CHECKPOINT_URI": str(self.checkpoints),
            "ZERO1_CPUS_PER_WORKER": "0.5",
            "ZERO1_SCHEDULER_INTERVAL_S": "0.05",
            **env,
        }
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [ZERO1, "serve", "--port", str(self.port)], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 120
        while True:  # until it accepts connections, with a deadline
            assert self.process.poll() is None, self.log()
            try:
                httpx.get(f"{self.base}/healthz", timeout=2).raise_for_status()
                return
            except httpx.TransportError:
                assert time.monotonic() < deadline, "zero1 serve did not start within 120 s\n" + self.log()
                time.sleep(0.1)

    def stop(self, sig: signal.Signals) -> int:
        self.process.send_signal(sig)
        return self.process.wait(timeout=120)

    def log(self) -> str:
        return self.log_path.read_text()

    def get(self, path: str, **params) -> dict:
        return httpx.get(f"{self.base}{path}", params=params, timeout=30).json()

    def post(self, path: str, body: dict) -> dict:
        response = httpx.post(f"{self.base}{path}", json=body, timeout=30)
        assert response.status_code == 201, response.text
        return response.json()


@contextmanager
def service(tmp_path: Path, **env: str) -> Iterator[Service]:
    svc = Service(tmp_path, **env)
    svc.start()
    try:
        yield svc
    finally:
        if svc.process.poll() is None:
            svc.stop(signal.SIGTERM)


def newest_checkpoint(svc: Service, job_id: int) -> int:
    markers = list(job_checkpoint_dir(svc.database_url, svc.checkpoints, job_id).glob("step-*/complete.json"))
    return max((int(m.parent.name.removeprefix("step-")) for m in markers), default=-1)


def assert_every_step_once(database_url: str, job_id: int, *, steps: int) -> list[tuple[int, int, bool]]:
    """The surviving curve has steps 0..steps-1, each once; all rows stored, as (attempt, step, superseded)."""
    rows = metric_rows(database_url, job_id)
    surviving = Counter(step for _, step, superseded in rows if not superseded)
    assert sorted(surviving) == list(range(steps)) and all(n == 1 for n in surviving.values()), surviving
    return rows


def logged_steps(svc: Service, job_id: int) -> list[int]:
    """The steps of rank 0's step lines in the job's logs, in order, every page."""
    steps = []
    after = 0
    while page := svc.get(f"/v1/jobs/{job_id}/logs", rank=0, after=after, limit=10_000):
        if not page["data"]:
            return steps
        steps += [
            int(x["line"].split("step ")[1].split("/")[0]) for x in page["data"] if "zero1.train: step " in x["line"]
        ]
        after = page["next"]
    raise AssertionError("GET /logs answered nothing")


def test_a_service_on_an_external_ray_reattaches_after_sigterm_and_sigkill(ray_cluster, tmp_path):
    """Jobs keep training while the control plane is down; on restart it re-attaches to their
    supervisors, the rows made meanwhile arrive, nothing is stored twice, queued jobs survive."""
    namespace = f"zero1-restart-{os.getpid()}"
    svc = Service(tmp_path, ZERO1_RAY_ADDRESS=ray_cluster.address, ZERO1_RAY_NAMESPACE=namespace)
    svc.start()
    try:  # the long job runs until cancelled: however fast this machine is, it is still training
        running = svc.post("/v1/jobs", job_body(name="long", steps=100_000, checkpoint_every=10))["id"]
        queued = svc.post("/v1/jobs", job_body(name="waits", steps=20, num_gpus=4))["id"]
        wait_for(lambda: svc.get(f"/v1/jobs/{running}"), lambda j: (j["step"] or 0) >= 50, what="step 50")
        assert svc.get(f"/v1/jobs/{queued}")["status"] == "queued"

        for sig in (signal.SIGTERM, signal.SIGKILL):
            stored = svc.get(f"/v1/jobs/{running}")["step"]
            code = svc.stop(sig)
            # uvicorn shuts down gracefully on SIGTERM, then re-raises it: the status says why it stopped
            assert code == -sig, svc.log()
            # training goes on without the service: a newer checkpoint appears meanwhile
            mark = newest_checkpoint(svc, running)
            wait_for(
                lambda: {"newest": newest_checkpoint(svc, running)},
                lambda c: c["newest"] > mark + 20,
                what="training to go on while the service is down",
            )
            svc.start()
            after = wait_for(
                lambda: svc.get(f"/v1/jobs/{running}"),
                lambda j: j["step"] > mark + 20,
                what="the rows made while the service was down",
            )
            assert after["status"] == "running" and after["attempt"] == 0 and after["step"] >= stored
        assert "scheduler stopped; drained" in svc.log()
        assert svc.log().count("re-attached to attempt 0") == 2
        # rank 0 logs a line per step: those written through both restarts all arrive, each once
        logged = wait_for(
            lambda: {"steps": logged_steps(svc, running)},
            lambda got: len(got["steps"]) > after["step"],
            what="the log lines of the steps made across the restarts",
        )["steps"]
        assert logged == list(range(len(logged))), logged  # none lost, none twice, in order

        assert httpx.post(f"{svc.base}/v1/jobs/{running}/cancel", timeout=30).status_code == 202
        done = wait_for(
            lambda: svc.get(f"/v1/jobs/{running}"), lambda j: j["status"] == "cancelled", what="the long job to stop"
        )
        assert done["attempt"] == 0
        events = svc.get(f"/v1/jobs/{running}/events")["data"]
        assert transitions(events) == ["queued", "starting", "running", "cancelled"]
        rows = assert_every_step_once(svc.database_url, running, steps=done["step"] + 1)
        assert len(rows) == done["step"] + 1  # no row stored twice, none superseded
        waited = wait_for(
            lambda: svc.get(f"/v1/jobs/{queued}"),
            lambda j: j["status"] == "succeeded",
            what="the queued job to run after the restarts",
        )
        assert waited["attempt"] == 0
        record(
            "service SIGTERM + SIGKILL, external Ray",
            faults=2,
            jobs_accepted=2,
            jobs_stored=jobs_stored(svc.database_url),
            rows_expected=done["step"] + 1 + 20,
            rows_stored=len(rows) + surviving_steps(svc.database_url, queued),
        )
    finally:
        if svc.process.poll() is None:
            svc.stop(signal.SIGTERM)


@pytest.mark.ray  # a `zero1 serve` with its embedded Ray
@pytest.mark.slow
def test_an_embedded_ray_job_resumes_from_its_checkpoint_when_the_service_restarts(tmp_path):
    """The embedded Ray stops with the service, on SIGTERM (drained) and on SIGKILL alike; each
    time the running job comes back as a new attempt from its last checkpoint (not a retry:
    max_retries 0), and its curve has every step once. One service, stopped both ways in turn."""
    svc = Service(tmp_path, ZERO1_SIMULATED_GPUS="4", ZERO1_RAY_NAMESPACE="zero1")
    steps = 400
    every = 20
    svc.start()
    try:
        job_id = svc.post("/v1/jobs", job_body(steps=steps, checkpoint_every=every))["id"]
        queued = svc.post("/v1/jobs", job_body(name="waits", steps=10, num_gpus=4))["id"]
        resumed = 0
        for attempt, sig in enumerate((signal.SIGTERM, signal.SIGKILL), start=1):
            job = wait_for(
                lambda: svc.get(f"/v1/jobs/{job_id}"),
                lambda j: j["attempt"] == attempt - 1 and (j["step"] or 0) >= resumed + every + 10,
                what=f"a checkpoint of attempt {attempt - 1}",
            )
            assert job["status"] == "running", job  # still training when the service stops
            svc.stop(sig)
            stopped_at = newest_checkpoint(svc, job_id)
            assert stopped_at >= resumed + every - 1
            svc.start()
            wait_for(
                lambda: svc.get(f"/v1/jobs/{job_id}"), lambda j: j["attempt"] == attempt, what=f"attempt {attempt}"
            )
            events = svc.get(f"/v1/jobs/{job_id}/events")["data"]
            reason = [e["reason"] for e in events if e["to_status"] == "restarting"][-1]
            assert "the service restarted" in reason and "embedded Ray" in reason, reason
            resumed = int(reason.split("resumes from checkpoint step ")[1]) + 1
            assert resumed >= stopped_at + 1
        assert "scheduler stopped; drained" in svc.log()  # the SIGTERM's
        done = wait_for(
            lambda: svc.get(f"/v1/jobs/{job_id}"),
            lambda j: j["status"] in ("succeeded", "failed"),
            what="the resumed job to finish",
            timeout_s=300,
        )
        assert done["status"] == "succeeded" and done["attempt"] == 2 and done["num_retries"] == 0, done
        events = svc.get(f"/v1/jobs/{job_id}/events")["data"]
        restarted = ["restarting", "running"]
        assert transitions(events) == ["queued", "starting", "running", *restarted, *restarted, "succeeded"]
        rows = assert_every_step_once(svc.database_url, job_id, steps=steps)
        assert {a for a, s, x in rows if not x and s >= resumed} == {2}
        waited = wait_for(
            lambda: svc.get(f"/v1/jobs/{queued}"), lambda j: j["status"] == "succeeded", what="the queued job"
        )
        assert waited["attempt"] == 0
        # finished: the rows of pruned checkpoints went once stored, and of the complete ones
        # only the final one stays (ZERO1_CHECKPOINT_KEEP_FINISHED=1), whole, beside the final model
        directory = job_checkpoint_dir(svc.database_url, svc.checkpoints, job_id)
        last = f"step-{steps - 1:09d}"
        wait_for(
            lambda: sorted(p.name for p in directory.iterdir()),
            lambda left: left == ["final", last],
            what="the finished job's checkpoints retired to the final one",
            timeout_s=30,
        )
        assert sorted(p.parent.name for p in directory.glob("step-*/rank-*.safetensors")) == [last] * 2
        record(
            "service SIGTERM, then SIGKILL, embedded Ray",
            faults=2,
            jobs_accepted=2,
            jobs_stored=jobs_stored(svc.database_url),
            rows_expected=steps + 10,
            rows_stored=surviving_steps(svc.database_url, job_id) + surviving_steps(svc.database_url, queued),
        )
    finally:
        if svc.process.poll() is None:
            svc.stop(signal.SIGTERM)


def test_a_removed_node_fails_its_ranks_and_the_job_resumes_on_the_nodes_left(app, ray_cluster):
    """The session's two nodes are held by a placeholder, so the job lands on a third node;
    removing that node kills its ranks, and the retry runs where GPUs are left."""
    from ray.util.placement_group import placement_group, remove_placement_group

    client, settings = app
    placeholder = placement_group([{"GPU": 1, "CPU": 0.5}] * 4)
    node = None
    try:  # whatever fails here, the session's cluster gets its GPUs back for the tests after this one
        assert ray.get(placeholder.ready(), timeout=60)
        node = ray_cluster.add_node(num_cpus=2, num_gpus=2)
        job_id = client.post("/v1/jobs", json=job_body(steps=100_000, checkpoint_every=10, max_retries=1)).json()["id"]
        job = lambda: client.get(f"/v1/jobs/{job_id}").json()
        wait_for(job, lambda j: (j["step"] or 0) >= 15, what="training on the third node")
        supervisor = ray.get_actor(supervisor_name(job_id, 0), namespace=settings.ray_namespace)
        assert set(ray.get(supervisor.poll.remote()).nodes) == {node.node_id}
    finally:
        if node is not None:
            ray_cluster.remove_node(node)
        remove_placement_group(placeholder)

    resumed = wait_for(
        job, lambda j: j["attempt"] == 1 and j["status"] in ("running", "failed"), what="the retry on the nodes left"
    )
    assert resumed["status"] == "running", resumed
    restart = client.get(f"/v1/jobs/{job_id}/events").json()["data"][3]
    # the ranks on the removed node died; the supervisor too when Ray placed it there (head affinity is soft)
    assert restart["to_status"] == "restarting", restart
    assert f"on node {node.node_id}" in restart["reason"] or "SupervisorLost" in restart["reason"], restart
    supervisor = ray.get_actor(supervisor_name(job_id, 1), namespace=settings.ray_namespace)
    assert node.node_id not in ray.get(supervisor.poll.remote()).nodes
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    last = wait_for(job, lambda j: j["status"] == "cancelled", what="the cancel")["step"]
    assert_every_step_once(settings.database_url, job_id, steps=last + 1)
    record(
        "a node removed, retried",
        faults=1,
        jobs_accepted=1,
        jobs_stored=jobs_stored(settings.database_url),
        rows_expected=last + 1,
        rows_stored=surviving_steps(settings.database_url, job_id),
    )


def test_an_elastic_job_continues_on_the_node_left_instead_of_waiting(app, ray_cluster):
    """As above, but 2 of the session's GPUs stay held by another workload and the job is elastic
    (4 GPUs, at least 2): it starts on 4 across the session's free 2 and a third node's 2; when
    that node goes, its retry resumes at once on the 2 GPUs left, where a 4-rank job would wait."""
    from ray.util.placement_group import placement_group, remove_placement_group

    client, settings = app
    placeholder = placement_group([{"GPU": 1, "CPU": 0.5}] * 2)
    node = None
    try:
        assert ray.get(placeholder.ready(), timeout=60)
        node = ray_cluster.add_node(num_cpus=2, num_gpus=2)
        wait_for(lambda: client.get("/v1/cluster").json()["num_gpus"], lambda n: n == 6, what="the third node")
        body = job_body(steps=100_000, checkpoint_every=10, max_retries=1, num_gpus=4, min_gpus=2)
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        job = lambda: client.get(f"/v1/jobs/{job_id}").json()
        started = wait_for(job, lambda j: (j["step"] or 0) >= 15, what="training on 4 GPUs over two nodes")
        assert started["world_size"] == 4
        supervisor = ray.get_actor(supervisor_name(job_id, 0), namespace=settings.ray_namespace)
        assert node.node_id in ray.get(supervisor.poll.remote()).nodes
        ray_cluster.remove_node(node)
        node = None
        resumed = wait_for(
            job, lambda j: j["attempt"] == 1 and j["status"] in ("running", "failed"), what="the retry on 2 GPUs"
        )
        assert resumed["status"] == "running" and resumed["world_size"] == 2, resumed
        restart = [e for e in client.get(f"/v1/jobs/{job_id}/events").json()["data"] if e["to_status"] == "restarting"]
        assert restart[0]["reason"].startswith("resized 4 -> 2: "), restart
        moved = wait_for(job, lambda j: j["step"] >= resumed["step"] + 5, what="steps on the node left")
        assert moved["world_size"] == 2 and moved["latest"]["world_size"] == 2
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        wait_for(job, lambda j: j["status"] == "cancelled", what="the cancel")
    finally:
        if node is not None:
            ray_cluster.remove_node(node)
        remove_placement_group(placeholder)


def test_shutdown_drains_the_rows_the_supervisors_hold(ray_cluster, tmp_path):
    """Rows a supervisor holds when the service stops are stored before it exits (SIGTERM runs
    the same lifespan shutdown): the scheduler's loop is stopped first, so only the drain can."""
    settings = make_settings(tmp_path)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        job_id = client.post("/v1/jobs", json=job_body(steps=100_000)).json()["id"]
        wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json(), lambda j: (j["step"] or 0) >= 5, what="step 5")
        scheduler = client.app.state.runtime.scheduler
        scheduler._stop.set()  # the loop ends; from here only the shutdown's drain stores rows
        scheduler._thread.join(timeout=60)
        stored = client.get(f"/v1/jobs/{job_id}").json()["step"]
        supervisor = ray.get_actor(supervisor_name(job_id, 0), namespace=settings.ray_namespace)
        held = wait_for(
            lambda: ray.get(supervisor.poll.remote(stored)),
            lambda s: len(s.metrics) >= 20,
            what="rows the database does not have",
        )
        held_steps = [row.step for row in held.metrics]
        assert held_steps[0] == stored + 1
    try:
        rows = metric_rows(settings.database_url, job_id)
        steps = sorted(step for _, step, _ in rows)
        assert steps[: stored + 1 + len(held_steps)] == list(range(stored + 1 + len(held_steps)))
        assert len(steps) == len(set(steps))
        record(
            "shutdown drain",
            faults=1,
            jobs_accepted=1,
            jobs_stored=jobs_stored(settings.database_url),
            rows_expected=stored + 1 + len(held_steps),
            rows_stored=len(steps),
        )
    finally:
        ray.kill(supervisor, no_restart=True)
