"""Issue 40's fairness and trust seams around the scheduler and the login: quotas hold for every N the
scheduler picks (a start, a retry, a relaunch after a restart, a growth); a stop (a preemption, a
suspend) asked before a restart is carried out after it, never a relaunch at full size; the lockout
believes X-Forwarded-For only from ZERO1_TRUSTED_PROXIES and never refuses a valid token it has seen
from that address; MLflow's credentials in the tracking URI are never shown nor logged, and each
owner's runs go to an experiment of their own.

The scheduler's tests drive the real Scheduler and its database through a restart (a second
Scheduler on the same database, as `zero1 serve` starting again builds one) with a fast lane of fakes
for Ray (FakeRay: each launched attempt "runs" until the test says otherwise). The attacks then run
against a real `zero1 serve` with ZERO1_RUN_AS (tests/served.py), stopped and started again on the same
state for the restart.

Packages: service.scheduling, service.auth, service.lockout, service.cli, service.tracking.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from test_mlflow import PASSWORD, MlflowServer, the_run

from service.auth import credential
from service.intake import admission, submission
from service.lockout import KNOWN_S, MAX_FAILURES, LoginLockout
from service.planning.capacity import ClusterCapacity
from service.scheduling import job_states
from service.scheduling.scheduler import Scheduler
from service.schemas.requests import JobSpec
from service.settings import Settings
from service.store.db import Database
from service.store.job_storage import JobStorage
from service.store.tables import Job, JobEvent
from workers.memory.model import GB
from workers.records import AttemptPoll, AttemptStatus, RankError

from conftest import make_settings
from helpers import TERMINAL, job_body, wait_for
from marks import starts
from served import ALICE, BOB, ROOT, TOKENS, Served

CLUSTER = ClusterCapacity(num_gpus=4, num_gpus_free=4, gpu_memory_bytes=80 * GB, simulated=True)
ELASTIC = {"num_gpus": 2, "min_gpus": 1, "micro_batch_size": 2, "global_batch_size": 8}
"""Runs at N in [1, 2]."""


class FakeRay:
    """The launcher as the scheduler calls it, without Ray: an attempt launched is "running" until the
    test sets another status; a stop asked now leaves it running (its ranks mid-step), a stop asked at
    the next checkpoint (a growth) stops it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.attempts: dict[tuple[int, int], str] = {}
        self.launched: list[tuple[int, int, int]] = []  # (job, attempt, N) in order

    def launch(self, job: Job) -> None:
        self.attempts[(job.id, job.attempt)] = "running"
        self.launched.append((job.id, job.attempt, job.world_size))

    def poll_many(self, attempts: list) -> dict[tuple[int, int], AttemptPoll]:
        return {(job_id, attempt): self._state(job_id, attempt) for job_id, attempt, _, _ in attempts}

    def poll(self, job_id: int, attempt: int, **_: Any) -> AttemptPoll:
        return self._state(job_id, attempt)

    def _state(self, job_id: int, attempt: int) -> AttemptPoll:
        status = AttemptStatus(self.attempts.get((job_id, attempt), "lost"))
        failed = status in (AttemptStatus.LOST, AttemptStatus.FAILED)
        error = RankError(exception="SupervisorLost", message="gone") if failed else None
        return AttemptPoll(status=status, nodes=("node-0",), error=error)

    def request_stop(self, job_id: int, attempt: int, *, now: bool = False) -> bool:
        if not now:  # a growth: it stops at its next checkpoint, here at once
            self.attempts[(job_id, attempt)] = "stopped"
        return (job_id, attempt) in self.attempts

    def cancel(self, job_id: int, attempt: int) -> None:
        self.attempts[(job_id, attempt)] = "stopped"

    def release(self, job_id: int, attempt: int) -> None:
        self.attempts.pop((job_id, attempt), None)

    def exists(self, job_id: int, attempt: int) -> bool:
        return (job_id, attempt) in self.attempts

    def supervisors(self) -> list[tuple[int, int]]:
        return list(self.attempts)

    def sweep(self, attempts: set) -> int:
        return 0

    def gpus_free_to(self, job_id: int, attempt: int) -> int | None:
        return None


def scheduler(db: Database, ray: FakeRay, *, total_gpus: int) -> Scheduler:
    """The service's scheduler on `db`, as `zero1 serve` builds one at start (recover() not yet called),
    its jobs' files on the real storage of `ray`'s settings (a tmp dir: no checkpoint in it, so a
    relaunch resumes at step 0)."""
    storage = JobStorage(ray.settings)
    return Scheduler(
        db=db, launcher=ray, storage=storage, total_gpus=lambda: total_gpus, interval_s=3600, grow_interval_s=0
    )


def queue_job(db: Database, *, owner: str, **overrides) -> int:
    """A queued job of `owner`, stored as POST /v1/jobs stores it; its id."""
    spec = JobSpec.model_validate(job_body(**overrides))
    plan = admission.admit(spec, cluster=CLUSTER, overhead_bytes=GB)
    with db.session() as session:
        job, _ = submission.submit_job(
            session, spec=spec, plan=plan, idempotency_key=None, owner=owner, priority=spec.priority or 50
        )
        return job.id


def job_row(db: Database, job_id: int) -> Job:
    with db.session() as session:
        return session.get(Job, job_id)


def reasons(db: Database, job_id: int) -> list[str]:
    with db.session() as session:
        return list(session.scalars(select(JobEvent.reason).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def ticks(sched: Scheduler, count: int = 2) -> None:
    for _ in range(count):
        sched.tick()


# --------------------------------------------------------------------------- quotas hold for every N


@pytest.fixture
def quota_one(tmp_path) -> Settings:
    """Every owner may hold 1 GPU, and nobody borrows past it (the issue's ZERO1_GPU_QUOTAS=*=1)."""
    return make_settings(tmp_path, gpu_quotas="*=1", quota_borrowing=False, preempt_min_runtime_s=0)


def test_an_elastic_job_relaunched_after_a_restart_stays_within_its_quota_and_the_in_quota_job_runs(
    database, quota_one
):
    alice = queue_job(database, owner="alice", steps=100_000, **ELASTIC)
    before = scheduler(database, FakeRay(quota_one), total_gpus=2)
    ticks(before)
    assert (job_row(database, alice).status, job_row(database, alice).world_size) == ("running", 1)
    ray = FakeRay(quota_one)  # the embedded Ray stopped with the service: no supervisor survived
    after = scheduler(database, ray, total_gpus=2)
    after.recover()
    assert job_row(database, alice).world_size == 1, reasons(database, alice)
    assert not any("resized" in reason for reason in reasons(database, alice))
    bob = queue_job(database, owner="bob", num_gpus=1, steps=100_000)
    ticks(after)
    assert job_row(database, bob).status == "running", after.queue_reasons().of(bob)
    assert sorted(n for _, _, n in ray.launched) == [1, 1]


def test_a_retry_of_an_elastic_job_stays_within_its_quota(database, quota_one):
    alice = queue_job(database, owner="alice", steps=100_000, max_retries=2, **ELASTIC)
    ray = FakeRay(quota_one)
    sched = scheduler(database, ray, total_gpus=2)
    ticks(sched)
    ray.attempts[(alice, 0)] = "failed"  # a rank died: the retry picks its N again
    ticks(sched)
    job = job_row(database, alice)
    assert (job.attempt, job.num_retries, job.world_size) == (1, 1, 1), reasons(database, alice)
    assert ray.launched == [(alice, 0, 1), (alice, 1, 1)]


def test_a_growth_stays_within_its_quota(database, tmp_path):
    settings = make_settings(tmp_path, gpu_quotas="*=2", quota_borrowing=False)
    body = {**ELASTIC, "num_gpus": 4, "global_batch_size": 16}  # N in [1, 2, 4]
    queue_job(database, owner="bob", num_gpus=2, steps=100_000)
    alice = queue_job(database, owner="alice", steps=100_000, checkpoint_every=10, **body)
    ray = FakeRay(settings)
    sched = scheduler(database, ray, total_gpus=6)
    ticks(sched)  # bob's job takes 2, alice's elastic starts at her quota's 2 of the 4 free
    assert job_row(database, alice).world_size == 2
    with database.session() as session:  # as if she had started at 1 (the GPUs were taken then)
        session.get(Job, alice).world_size = 1
    ticks(sched, 3)  # grows at its next checkpoint: to 2, her quota, never to the 4 that are free
    job = job_row(database, alice)
    assert (job.status, job.attempt, job.world_size) == ("running", 1, 2), reasons(database, alice)


def test_a_relaunch_past_a_quota_lowered_since_goes_back_to_the_queue(database, tmp_path, quota_one):
    generous = make_settings(tmp_path, gpu_quotas="*=2", quota_borrowing=False)
    alice = queue_job(database, owner="alice", num_gpus=2, steps=100_000)
    ticks(scheduler(database, FakeRay(generous), total_gpus=2))
    after = scheduler(database, FakeRay(quota_one), total_gpus=2)  # restarted with *=1
    after.recover()
    job = job_row(database, alice)
    assert job.status == "queued", reasons(database, alice)
    assert reasons(database, alice)[-1].endswith(
        "past its owner's GPU quota: no checkpoint yet: it starts again from step 0"
    )


# --------------------------------------------------------------------------- stops survive a restart


@pytest.fixture
def preempting(tmp_path) -> Settings:
    return make_settings(tmp_path, preempt_min_runtime_s=0, preempt_grace_s=3600)


@pytest.mark.parametrize("supervisor", ["lost with the embedded Ray", "survived on a cluster"])
def test_a_restart_mid_preemption_sends_the_victim_back_to_the_queue(database, preempting, supervisor):
    victim = queue_job(database, owner="alice", num_gpus=2, steps=100_000, priority=10)
    ray = FakeRay(preempting)
    before = scheduler(database, ray, total_gpus=2)
    ticks(before)
    urgent = queue_job(database, owner="bob", num_gpus=2, steps=100_000, priority=90)
    ticks(before)  # the victim is asked to stop; its ranks are mid-step when the service stops
    assert job_row(database, victim).stop["preempt"]["by"] == urgent
    if supervisor == "lost with the embedded Ray":
        ray = FakeRay(preempting)
    after = scheduler(database, ray, total_gpus=2)
    after.recover()
    if supervisor == "survived on a cluster":
        ray.attempts[(victim, 0)] = "stopped"  # the ranks stop at their step, as asked before the restart
    ticks(after)
    job = job_row(database, victim)
    assert (job.status, job.stop) == ("queued", None), reasons(database, victim)
    assert reasons(database, victim)[-1].startswith(f"preempted by job {urgent} (priority 90): ")
    ticks(after)
    assert job_row(database, urgent).status == "running", after.queue_reasons().of(urgent)
    assert [(job_id, n) for job_id, _, n in ray.launched if job_id == victim] == (
        [(victim, 2)] if supervisor == "survived on a cluster" else []
    )


def test_a_restart_mid_suspend_suspends_the_job(database, preempting):
    job_id = queue_job(database, owner="alice", num_gpus=2, steps=100_000)
    ray = FakeRay(preempting)
    before = scheduler(database, ray, total_gpus=2)
    ticks(before)
    with database.session() as session:
        job_states.flag_active(session, session.get(Job, job_id), "suspend_requested")
    ticks(before)
    after = scheduler(database, FakeRay(preempting), total_gpus=2)
    after.recover()
    assert job_row(database, job_id).status == "suspended", reasons(database, job_id)


# --------------------------------------------------------------------------- the lockout's address


def test_a_locked_address_refuses_a_token_it_has_not_seen_succeed_there_and_admits_one_it_has():
    """The lockout alone: a guesser behind an address locks out the tokens never used from it (a
    guess that happens to be valid included: no oracle), never a user already working there; each
    address apart."""
    now_s = [1000.0]
    lockout = LoginLockout(max_failures=3, window_s=60, clock=lambda: now_s[0])
    working = credential("bob's token")
    fresh = credential("alice's token")
    lockout.record_success("192.0.2.1", working)
    for _ in range(3):
        lockout.record_failure("192.0.2.1")
    assert lockout.retry_after_s("192.0.2.1") == 60
    assert lockout.retry_after_s("192.0.2.1", credential=fresh) == 60
    assert lockout.retry_after_s("192.0.2.1", credential=working) == 0
    assert lockout.retry_after_s("192.0.2.2", credential=fresh) == 0  # another address: its own count
    assert lockout.retry_after_s("192.0.2.2") == 0
    now_s[0] += KNOWN_S  # a day without success from there: it is a stranger again
    for _ in range(3):
        lockout.record_failure("192.0.2.1")
    assert lockout.retry_after_s("192.0.2.1", credential=working) == 60


RUN_AS = "alice=2001:2001,bob=2002:2002,*=30000-30009"
TWO = {"alice": "bob", "bob": "alice"}
"""Two owners, each with the other."""


class Restartable:
    """The served service of this module, stopped and started again on its state by the restart test."""

    def __init__(self, state: Path, *, mlflow: MlflowServer, **env: str) -> None:
        self.state = state
        self.env = env
        self.mlflow = mlflow
        """The MLflow server the service exports to (the MLflow test stops it)."""
        self.service = Served(state, **env)

    def restart(self, **env: str) -> Served:
        self.service.stop()
        self.service = Served(self.state, **self.env, **env)
        return self.service


@pytest.fixture(scope="module")
@starts("ray", "slow")
def served(searchable, tmp_path_factory) -> Iterator[Restartable]:
    """`zero1 serve` with ZERO1_RUN_AS, every owner's quota 1 GPU of 2 and no borrowing, exporting to
    MLflow through a URI with the service's credentials; each user has used its token once from
    loopback (they work there), as a deployment's users have. The MLflow server starts while the
    service does (its exporter retries until the server answers): the two start-ups overlap."""
    mlflow = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    mlflow.launch()
    state = Path(tempfile.mkdtemp(prefix="zero1-fairness-"))
    holder = None
    try:
        holder = Restartable(
            state,
            mlflow=mlflow,
            ZERO1_RUN_AS=RUN_AS,
            ZERO1_GPU_QUOTAS="*=1",
            ZERO1_QUOTA_BORROWING="false",
            ZERO1_MLFLOW_TRACKING_URI=mlflow.secret_uri,
            ZERO1_MLFLOW_INTERVAL_S="0.2",
            ZERO1_MLFLOW_MAX_BACKOFF_S="1",
            ZERO1_PREEMPT_MIN_RUNTIME_S="0",  # a victim may be preempted as soon as it trains
            ZERO1_PREEMPT_GRACE_S="600",  # and is not killed before the restart
        )
        mlflow.wait_ready()
        for token in TOKENS.values():
            assert holder.service.request("GET", "/v1/jobs", token).status_code == 200
        yield holder
    finally:
        if holder is not None:
            holder.service.stop()
        if mlflow.process.poll() is None:
            mlflow.stop()
        subprocess.run(["rm", "-rf", str(state)], check=False)


def _as(service: Served, token: str, *, forwarded_for: str | None = None) -> int:
    """GET /v1/jobs with `token` (and an X-Forwarded-For naming `forwarded_for`): the status."""
    headers = {"Authorization": f"Bearer {token}"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return httpx.get(service.base + "/v1/jobs", headers=headers, timeout=30).status_code


def test_x_forwarded_for_from_loopback_is_not_believed_and_a_guesser_locks_no_working_user_out(served):
    """The issue's attack on `zero1 serve`, no ZERO1_TRUSTED_PROXIES: 40 wrong tokens each naming
    another address in X-Forwarded-For are counted against the connection's address (10 x 401, then
    429); 10 more naming bob's address (as if his proxy had sent them) do not lock bob out there; and
    the guesser, behind the same address as every user, locks out none of those already working."""
    service = served.service
    wrong = [f"guess-{n:02d}-{'x' * 24}" for n in range(40)]
    rotating = [_as(service, token, forwarded_for=f"203.0.113.{n}") for n, token in enumerate(wrong)]
    assert rotating == [401] * MAX_FAILURES + [429] * (40 - MAX_FAILURES)
    assert {_as(service, token, forwarded_for="198.51.100.20") for token in wrong[:10]} == {429}
    assert _as(service, BOB, forwarded_for="198.51.100.20") == 200
    assert _as(service, ALICE) == 200 and _as(service, ROOT) == 200
    assert _as(service, wrong[0]) == 429  # and the guessing is still bounded


def _job(service: Served, job_id: int, token: str) -> dict:
    return service.request("GET", f"/v1/jobs/{job_id}", token).json()


def _wait_job(service: Served, job_id: int, token: str, predicate, what: str) -> dict:
    return wait_for(lambda: _job(service, job_id, token), predicate, what=what, timeout_s=240)


def test_after_a_restart_an_elastic_job_comes_back_within_its_quota_and_the_in_quota_job_runs(served):
    """The issue's run: ZERO1_GPU_QUOTAS=*=1, borrowing off, 2 GPUs; alice's elastic job (N in 1..2)
    runs at 1; the service restarts (its embedded Ray with it); her job comes back at 1, not
    `resized 1 -> 2`, and bob's 1-GPU job, within his quota, runs beside it."""
    service = served.service
    body = job_body(name="elastic", steps=1_000_000, **ELASTIC)
    alice = service.request("POST", "/v1/jobs", ALICE, json=body).json()["id"]
    running = _wait_job(service, alice, ALICE, lambda j: j["status"] in ("running", *TERMINAL), "alice's job running")
    assert (running["status"], running["world_size"]) == ("running", 1)
    service = served.restart(ZERO1_TRUSTED_PROXIES="127.0.0.1")  # the proxy test below uses the header
    back = _wait_job(
        service, alice, ALICE, lambda j: j["status"] in ("running", *TERMINAL) and j["attempt"] == 1, "the relaunch"
    )
    assert (back["status"], back["world_size"]) == ("running", 1)
    events = service.request("GET", f"/v1/jobs/{alice}/events", ALICE).json()["data"]
    assert not any("resized" in event["reason"] for event in events), events
    bob = service.request("POST", "/v1/jobs", BOB, json=job_body(name="in quota", num_gpus=1, steps=1_000_000))
    bob_id = bob.json()["id"]
    try:
        ran = _wait_job(service, bob_id, BOB, lambda j: j["status"] in ("running", *TERMINAL), "bob's job running")
        assert ran["status"] == "running", ran
    finally:
        for job_id, token in ((alice, ALICE), (bob_id, BOB)):
            service.request("POST", f"/v1/jobs/{job_id}/cancel", token)
        for job_id, token in ((alice, ALICE), (bob_id, BOB)):
            service.wait(job_id, token)


def test_with_trusted_proxies_the_header_names_the_client(served):
    """ZERO1_TRUSTED_PROXIES=127.0.0.1 (the restart above): X-Forwarded-For from loopback is the
    client. 10 wrong tokens from 198.51.100.7 lock that address out (bob's valid token too: he never
    used it from there, and the address is the real client's), and no other."""
    service = served.service
    wrong = [f"guess-{n:02d}-{'y' * 24}" for n in range(MAX_FAILURES)]
    assert [_as(service, token, forwarded_for="198.51.100.7") for token in wrong] == [401] * MAX_FAILURES
    assert _as(service, wrong[0], forwarded_for="198.51.100.7") == 429
    assert _as(service, BOB, forwarded_for="198.51.100.7") == 429
    assert _as(service, wrong[0], forwarded_for="198.51.100.8") == 401
    assert _as(service, BOB, forwarded_for="198.51.100.8") == 200


def test_mlflow_credentials_are_never_shown_nor_logged_and_each_owner_has_an_experiment(served):
    """The issue's MLflow run, on `zero1 serve` whose tracking URI holds the service's credentials:
    alice's and bob's jobs link their runs (API, job page) without them, go to zero1/alice and
    zero1/bob, and the service's log, with MLflow down (its errors name the URL), never holds them."""
    service = served.service
    mlflow_server = served.mlflow
    body = job_body(name="tracked", num_gpus=1, steps=3)
    owned = {owner: service.request("POST", "/v1/jobs", TOKENS[owner], json=body).json()["id"] for owner in TWO}
    for owner, job_id in owned.items():
        assert service.wait(job_id, TOKENS[owner])["status"] == "succeeded"
    for owner, job_id in owned.items():
        token = TOKENS[owner]
        linked = wait_for(lambda: _job(service, job_id, token), lambda j: j["mlflow"], what=f"{owner}'s run")
        url = linked["mlflow"]["url"]
        detail = service.request("GET", f"/v1/jobs/{job_id}", token).text
        page = service.request("GET", f"/jobs/{job_id}", token).text
        assert url.startswith(f"{mlflow_server.uri}/#/experiments/") and url in page
        assert PASSWORD not in detail + page
        run = the_run(mlflow_server, job_id, experiment=f"zero1/{owner}")
        assert run is not None and run.info.run_id == linked["mlflow"]["run_id"]
        assert the_run(mlflow_server, job_id, experiment=f"zero1/{TWO[owner]}") is None
    logged_before = len(service.log.read_text(errors="replace"))  # what the exporter said while MLflow was up
    mlflow_server.stop()
    waiting = service.request("POST", "/v1/jobs", ALICE, json=job_body(name="mlflow down", num_gpus=1, steps=3)).json()
    try:
        wait_for(
            lambda: service.log.read_text(errors="replace")[logged_before:],
            lambda log: f"127.0.0.1:{mlflow_server.port}/api" in log,  # an MLflow error, with the URL it called
            what="the exporter's warning with MLflow down",
            timeout_s=60,
        )
        assert PASSWORD not in service.log.read_text(errors="replace")
    finally:
        service.wait(waiting["id"], ALICE)


GATED = """
import os
import time

import torch
from torch import nn


class Gated(nn.Module):
    \"\"\"Waits in forward while the gate file names fewer calls than it has made: held mid-step.\"\"\"

    def __init__(self, gate):
        super().__init__()
        self.gate, self.calls = gate, 0
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids, labels):
        if not isinstance(input_ids, torch._subclasses.FakeTensor):  # not at plan time
            self.calls += 1
            while os.path.exists(self.gate) and self.calls > int(open(self.gate).read() or 0):
                time.sleep(0.02)
        logits = self.head(self.embed(input_ids))
        return nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))


def build(gate):
    return Gated(gate)
"""


def test_a_restart_mid_preemption_on_zero1_serve_sends_the_victim_back_to_the_queue(served, tmp_path):
    """alice's job (priority 10) is held mid-step when root's priority-90 job asks it to stop; the
    service restarts before it could: the victim goes back to the queue, as asked before the restart
    (not relaunched at its full N), and root's job runs."""
    service = served.service
    gates = Path(tempfile.mkdtemp(prefix="zero1-gate-"))
    gates.chmod(0o755)  # the victim's uid reads the gate
    gate = gates / "calls"
    gate.write_text("1")  # its first step trains; its second waits in forward
    gate.chmod(0o644)
    bundle = tmp_path / "gated"
    bundle.mkdir()
    (bundle / "gated.py").write_text(GATED)
    code = service.upload(bundle, ALICE)
    model = {"kind": "python", "entrypoint": "gated:build", "args": {"gate": str(gate)}}
    body = job_body(name="victim", num_gpus=1, steps=1_000_000, priority=10, model=model, seq_len=8, code=code)
    victim = service.request("POST", "/v1/jobs", ALICE, json=body | {"data": {"kind": "synthetic"}}).json()["id"]
    filler = service.request("POST", "/v1/jobs", BOB, json=job_body(name="filler", num_gpus=1, steps=1_000_000))
    started = {victim: ALICE, filler.json()["id"]: BOB}
    try:
        _wait_job(service, victim, ALICE, lambda j: j["status"] in TERMINAL or j["step"] is not None, "held")
        urgent = service.request(
            "POST", "/v1/jobs", ROOT, json=job_body(name="urgent", num_gpus=1, steps=3, priority=90)
        )
        urgent_id = urgent.json()["id"]
        started[urgent_id] = ROOT
        wait_for(
            lambda: service.request("GET", "/v1/queue", ROOT).json()["data"],
            lambda queue: any(e["reason"].startswith(f"preempting job {victim} ") for e in queue),
            what="the stop asked of the victim",
        )
        service = served.restart(ZERO1_TRUSTED_PROXIES="127.0.0.1")
        back = _wait_job(service, victim, ALICE, lambda j: j["attempt"] >= 1 or j["status"] in TERMINAL, "after")
        assert back["status"] == "queued", back
        events = service.request("GET", f"/v1/jobs/{victim}/events", ALICE).json()["data"]
        assert events[-1]["reason"].startswith(f"preempted by job {urgent_id} (priority 90): "), events[-1]
        assert "the service restarted" in events[-1]["reason"]
        ran = _wait_job(service, urgent_id, ROOT, lambda j: j["status"] in ("running", *TERMINAL), "urgent running")
        assert ran["status"] in ("running", "succeeded"), ran
    finally:
        gate.unlink()
        for job_id, token in started.items():
            served.service.request("POST", f"/v1/jobs/{job_id}/cancel", token)
        for job_id, token in started.items():
            served.service.wait(job_id, token)
        subprocess.run(["rm", "-rf", str(gates)], check=False)
