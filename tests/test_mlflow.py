"""MLflow: with ZERO1_MLFLOW_TRACKING_URI set, each job becomes a run on a real `mlflow server` (a
subprocess on loopback with its own SQLite store and artifacts directory): its rows' points at their
steps, its spec as params, its status, final/'s files; with the server stopped mid-job the job
succeeds and the run catches up once the server is back; a batch sent again after a crash is stored
once; the job's API detail and page link the run. The tracking URI carries the service's credentials
(user:password@): no URL shown (the API, the job page) nor line logged holds them; each owner's runs
go to an experiment of its own.

Packages: service.tracking, service.store, service.api, service.dashboard, service.settings, service.scheduling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.intake import admission
from service.intake.submission import submit_job
from service.planning.capacity import ClusterCapacity
from service.schemas.requests import JobSpec
from service.settings import Settings
from service.store.db import Database, upgrade
from service.store.job_storage import JobStorage
from service.store.tables import Job, MlflowRun
from service.tracking import runs
from service.tracking.exporter import Exporter
from service.tracking.mlflow_client import MissingPackage, Mlflow
from service.tracking.uris import scrubbed
from workers.memory.model import GB

from conftest import make_settings, serve
from helpers import TERMINAL, free_port, job_body, wait_for, wait_job

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # nothing leaves the machine
MLFLOW = str(Path(sys.executable).with_name("mlflow"))
EXPERIMENT = "zero1-tests"
ANONYMOUS_EXPERIMENT = f"{EXPERIMENT}/{runs.ANONYMOUS}"
"""Where the tracked app's jobs go: auth is off, so they have no owner."""
PASSWORD = "pa55-w0rd-of-the-service"
CLUSTER = ClusterCapacity(num_gpus=4, num_gpus_free=4, gpu_memory_bytes=80 * GB, simulated=True)
STEPS_DOWN = 200
"""Enough that the job is still running when it is suspended, after its first 5 steps."""


class MlflowServer:
    """`mlflow server` on 127.0.0.1:port with a SQLite store and an artifacts directory in `root`,
    stopped and started again on the same port and store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.secret_uri = f"http://zero1-service:{PASSWORD}@127.0.0.1:{self.port}"
        """The URI with credentials, as a deployment behind MLflow's basic auth sets it (this server
        checks none, and MLflow's client sends them)."""
        self.process: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it and wait until /health answers; the time it answered (time.monotonic())."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start it without waiting: a caller may start something else meanwhile, then wait_ready()."""
        command = [
            MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]  # fmt: skip
        log = (self.root / "server.log").open("ab")
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
        self.process = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)

    def wait_ready(self) -> float:
        """Wait until the launched server's /health answers; the time it answered (time.monotonic())."""
        return wait_for(
            self._health, lambda at: at is not None, what=f"{self.uri}/health", timeout_s=120, interval_s=0.1
        )

    def _health(self) -> float | None:
        assert self.process.poll() is None, f"mlflow server exited: {(self.root / 'server.log').read_text()[-3000:]}"
        try:
            return time.monotonic() if httpx.get(f"{self.uri}/health", timeout=2).status_code == 200 else None
        except httpx.TransportError:
            return None

    def stop(self) -> None:
        """Stop it (its uvicorn child too) and wait until the port refuses connections."""
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        wait_for(self._refused, bool, what="the mlflow server's port to close", timeout_s=30)

    def _refused(self) -> bool:
        try:
            httpx.get(f"{self.uri}/health", timeout=1)
        except httpx.TransportError:
            return True
        with contextlib.suppress(ProcessLookupError):  # a child still bound: end the whole group
            os.killpg(self.process.pid, signal.SIGKILL)
        return False


def tracked_settings(directory: Path, mlflow_server: MlflowServer, experiment: str = EXPERIMENT) -> Settings:
    """An app's settings that export to the server: a short interval and backoff, so that tests wait little.
    Each app's database numbers its jobs from 1: two apps on one server need experiments of their own."""
    return make_settings(
        directory,
        mlflow_tracking_uri=mlflow_server.secret_uri,
        mlflow_experiment=experiment,
        mlflow_interval_s=0.2,
        mlflow_max_backoff_s=2,
        public_url="https://zero1.example.com/",
    )


@pytest.fixture(scope="module")
def tracked(ray_cluster, mlflow_server, tmp_path_factory):
    """The app exporting to the server, per module."""
    settings = tracked_settings(tmp_path_factory.mktemp("tracked"), mlflow_server)
    with serve(settings) as client:
        yield client, settings


def mlflow_client(server: MlflowServer):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=server.uri)


def the_run(server: MlflowServer, job_id: int, *, experiment: str = ANONYMOUS_EXPERIMENT):
    """The job's run, found by its tag in `experiment`; None before it exists (or while the server is down)."""
    client = mlflow_client(server)
    experiment = client.get_experiment_by_name(experiment)
    if experiment is None:
        return None
    found = client.search_runs([experiment.experiment_id], filter_string=f"tags.`zero1.job_id` = '{job_id}'")
    assert len(found) <= 1, f"job {job_id} has {len(found)} runs"
    return found[0] if found else None


def history(server: MlflowServer, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow_client(server).get_metric_history(run_id, key))


def rows_of(client, job_id: int) -> list[dict]:
    return client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 10_000}).json()["data"]


def caught_up(server: MlflowServer, client, job_id: int, *, experiment: str = ANONYMOUS_EXPERIMENT):
    """The run once it is terminated with every row's loss; None until then."""
    run = the_run(server, job_id, experiment=experiment)
    if run is None or run.info.status == "RUNNING":
        return None
    rows = rows_of(client, job_id)
    if len(history(server, run.info.run_id, "loss")) != len(rows):
        return None
    return run


def test_a_jobs_run_holds_its_rows_params_status_and_final_files(tracked, mlflow_server):
    client, settings = tracked
    body = job_body(steps=12, eval_every=4, checkpoint_every=6, name="tracked")
    job = client.post("/v1/jobs", json=body).json()
    done = wait_job(client, job["id"], lambda j: j["status"] in TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    run = wait_for(
        lambda: caught_up(mlflow_server, client, job["id"]), bool, what="the run", timeout_s=60, interval_s=0.5
    )
    rows = rows_of(client, job["id"])
    assert len(rows) == 12
    run_id = run.info.run_id
    assert history(mlflow_server, run_id, "loss") == [(r["step"], r["loss"]) for r in rows]
    assert history(mlflow_server, run_id, "lr") == [(r["step"], r["lr"]) for r in rows]
    assert history(mlflow_server, run_id, "tokens_per_s") == [(r["step"], r["tokens_per_s"]) for r in rows]
    assert history(mlflow_server, run_id, "eval_loss") == [
        (r["step"], r["eval_loss"]) for r in rows if r["eval_loss"] is not None
    ]
    assert history(mlflow_server, run_id, "mem_peak_bytes") == [(r["step"], max(r["mem_peak_bytes"])) for r in rows]
    params = run.data.params
    assert params["optimizer.lr"] == "0.003" and params["num_gpus"] == "2" and params["model.kind"] == "gpt"
    assert params["steps"] == "12" and params["optimizer.betas"] == "[0.9, 0.95]"
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    tags = run.data.tags
    assert tags["zero1.status"] == "succeeded" and tags["zero1.job_id"] == str(job["id"])
    assert tags["zero1.url"] == f"https://zero1.example.com/jobs/{job['id']}"
    artifacts = client.get(f"/v1/jobs/{job['id']}/artifacts").json()["data"]
    assert artifacts, "a succeeded job has final/ files"
    sent = {Path(f.path).name: f.file_size for f in mlflow_client(mlflow_server).list_artifacts(run_id, "final")}
    assert sent == {a["name"]: a["bytes"] for a in artifacts}
    detail = client.get(f"/v1/jobs/{job['id']}").json()["mlflow"]
    assert detail["run_id"] == run_id and detail["exported_step"] == 11
    assert detail["url"] == f"{mlflow_server.uri}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    page = client.get(f"/jobs/{job['id']}")
    assert page.status_code == 200 and f'href="{detail["url"]}"' in page.text
    shown = client.get(f"/v1/jobs/{job['id']}").text + page.text + client.get("/v1/jobs").text
    assert PASSWORD not in shown and "zero1-service" not in shown


def test_with_mlflow_down_mid_job_the_job_succeeds_and_the_run_catches_up(tracked, mlflow_server, caplog):
    """Suspending the job is the gate: it stops at a known step with its points in MLflow; the
    server stops; the job resumes and succeeds with MLflow down; the server starts again on the same
    port and store, and the run catches up within a minute."""
    client, _ = tracked
    job_id = client.post("/v1/jobs", json=job_body(steps=STEPS_DOWN, name="down")).json()["id"]
    wait_job(client, job_id, lambda j: j["status"] in TERMINAL or (j["step"] or 0) >= 5, what="its first steps")
    suspend = client.post(f"/v1/jobs/{job_id}/suspend")
    assert suspend.status_code == 202, suspend.text
    suspended = wait_job(client, job_id, lambda j: j["status"] in ("suspended", *TERMINAL), what="suspended")
    assert suspended["status"] == "suspended", suspended["error"]
    before = wait_for(  # the run holds every row so far, and knows the job is suspended
        lambda: the_run(mlflow_server, job_id),
        lambda run: (
            run is not None
            and run.data.tags["zero1.status"] == "suspended"
            and len(history(mlflow_server, run.info.run_id, "loss")) == len(rows_of(client, job_id))
        ),
        what="the suspended job's run",
        interval_s=0.5,
    )
    caplog.set_level(logging.INFO)
    mlflow_server.stop()
    stopped_at = time.monotonic()
    assert client.post(f"/v1/jobs/{job_id}/resume").status_code == 202
    done = wait_job(client, job_id, lambda j: j["status"] in TERMINAL, what="the job's end with MLflow down")
    assert done["status"] == "succeeded", done["error"]
    job_s = time.monotonic() - stopped_at
    behind = client.get(f"/v1/jobs/{job_id}").json()["mlflow"]
    assert behind["run_id"] == before.info.run_id
    assert behind["exported_step"] < STEPS_DOWN - 1  # it could not export while the server was down
    assert client.get(f"/jobs/{job_id}").status_code == 200
    back_at = mlflow_server.start()
    run = wait_for(  # polled twice a second: a one-worker server is the exporter's too
        lambda: caught_up(mlflow_server, client, job_id),
        bool,
        what="the run's catching up",
        timeout_s=60,
        interval_s=0.5,
    )
    catch_up_s = time.monotonic() - back_at
    rows = rows_of(client, job_id)
    assert len(rows) == STEPS_DOWN and run.info.status == "FINISHED"
    down = [r.getMessage() for r in caplog.records if r.name.startswith("service.tracking")]
    assert any(f"127.0.0.1:{mlflow_server.port}" in line for line in down), down  # MLflow's errors name the URL
    assert PASSWORD not in caplog.text and "zero1-service@" not in caplog.text
    assert history(mlflow_server, run.info.run_id, "loss") == [(r["step"], r["loss"]) for r in rows]
    print(
        f"\nmlflow down for {job_s:.1f} s (resume to success); exported through step {behind['exported_step']} "
        f"before; caught up {len(rows)} loss points and the status {catch_up_s:.1f} s after the server answered"
    )


def test_a_batch_sent_again_after_a_crash_is_stored_once(ray_cluster, mlflow_server, tmp_path):
    """A service that died after MLflow took a batch and before its cursor moved sends the batch
    again at its kept timestamp: the server stores each point once. The service that ran the job has
    stopped, its exporter with it, before the cursor goes back: only the restarted one sends again.
    Its app's experiment is its own: the module's app has a job 1 too."""
    settings = tracked_settings(tmp_path, mlflow_server, experiment=f"{EXPERIMENT}-resent")
    experiment = f"{EXPERIMENT}-resent/{runs.ANONYMOUS}"
    with serve(settings) as client:
        job_id = client.post("/v1/jobs", json=job_body(steps=8, name="resent")).json()["id"]
        assert wait_job(client, job_id, lambda j: j["status"] in TERMINAL)["status"] == "succeeded"
        wait_for(
            lambda: caught_up(mlflow_server, client, job_id, experiment=experiment),
            bool,
            what="the run",
            timeout_s=60,
            interval_s=0.5,
        )
        rows = rows_of(client, job_id)
    database = Database(settings.database_url)
    try:
        with database.session() as session:
            run_id = session.get(MlflowRun, job_id).run_id
        points = mlflow_client(mlflow_server).get_metric_history(run_id, "loss")
        last_batch = max(points, key=lambda m: m.step).timestamp
        first_step = min(m.step for m in points if m.timestamp == last_batch)
        with database.session() as session:  # as if that batch's cursor move had never been committed
            cursor = session.get(MlflowRun, job_id)
            cursor.step = first_step - 1
            cursor.batch_time_ms = last_batch
            cursor.done = False
        exporter = Exporter(db=database, settings=settings, storage=JobStorage(settings))
        assert exporter.run_once() is False
        with database.session() as session:
            assert (session.get(MlflowRun, job_id).step, session.get(MlflowRun, job_id).done) == (7, True)
    finally:
        database.dispose()
    assert history(mlflow_server, run_id, "loss") == [(r["step"], r["loss"]) for r in rows]


def test_each_owners_runs_go_to_an_experiment_of_their_own_linked_without_the_credentials(mlflow_server, tmp_path):
    """Two owners' jobs: alice's run in zero1-owners/alice, bob's in zero1-owners/bob (the server's
    per-experiment permissions can then keep each to those allowed); the link the API shows of each
    holds no credential."""
    settings = make_settings(tmp_path, mlflow_tracking_uri=mlflow_server.secret_uri, mlflow_experiment="zero1-owners")
    upgrade(settings.database_url)
    database = Database(settings.database_url)
    spec = JobSpec.model_validate(job_body(name="owned"))
    plan = admission.admit(spec, cluster=CLUSTER, overhead_bytes=GB)
    try:
        with database.session() as session:
            owned = {
                owner: submit_job(session, spec=spec, plan=plan, idempotency_key=None, owner=owner)[0].id
                for owner in ("alice", "bob")
            }
        Exporter(db=database, settings=settings, storage=JobStorage(settings)).run_once()
        with database.session() as session:
            links = {owner: runs.run_link(session, session.get(Job, i), settings) for owner, i in owned.items()}
    finally:
        database.dispose()
    for owner, job_id in owned.items():
        other = "bob" if owner == "alice" else "alice"
        run = the_run(mlflow_server, job_id, experiment=f"zero1-owners/{owner}")
        assert run is not None and run.data.tags["zero1.owner"] == owner
        assert the_run(mlflow_server, job_id, experiment=f"zero1-owners/{other}") is None
        assert links[owner].url == f"{mlflow_server.uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert links["alice"].experiment_id != links["bob"].experiment_id


def test_the_uri_without_the_client_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(MissingPackage, match=r"pip install 'zero1\[mlflow\]'"):
        Mlflow("http://127.0.0.1:1")


def test_a_spec_flattens_to_params():
    spec = {"model": {"kind": "gpt", "n_layer": 2}, "num_gpus": 2, "code": None, "optimizer": {"betas": [0.9, 0.95]}}
    assert runs.flat_params(spec) == {
        "model.kind": "gpt",
        "model.n_layer": "2",
        "num_gpus": "2",
        "optimizer.betas": "[0.9, 0.95]",
    }
    assert runs.run_url("databricks", experiment_id="1", run_id="r") is None
    assert runs.run_url("https://u:p%40ss@mlflow.example:5000/", experiment_id="1", run_id="r") == (
        "https://mlflow.example:5000/#/experiments/1/runs/r"
    )
    said = "API request to https://u:p%40ss@mlflow.example:5000/api failed: p@ss"
    assert scrubbed(said, uri="https://u:p%40ss@mlflow.example:5000/") == (
        "API request to https://mlflow.example:5000/api failed: ***"
    )
