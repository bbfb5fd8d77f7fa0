"""The scheduler under races and faults: a cancel racing a start, one job's error, a stalled or
dead supervisor, a start that never finishes, a reused job id, a scheduler that stops ticking.

Each test injects its fault for real (two sessions on one row, an I/O error raised where the
checkpoint is read, a supervisor that does not answer) and checks one consistent outcome.

Packages: service.scheduling, service.intake.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from fastapi.testclient import TestClient
from sqlalchemy import select

from service.errors import ServiceError
from service.intake import admission, submission
from service.main import create_app
from service.planning.capacity import ClusterCapacity
from service.scheduling import job_states
from service.scheduling.ray_launcher import RayLauncher, _in_protocol, supervisor_name
from service.scheduling.scheduler import Scheduler
from service.schemas.fields import TERMINAL
from service.schemas.requests import JobSpec
from service.store import job_repository
from service.store.db import Database, upgrade
from service.store.job_storage import JobStorage, checkpoint_dirname
from service.store.tables import Job, JobEvent
from workers.memory.model import GB
from workers.records import AttemptPoll, AttemptStatus, MetricRow

from conftest import end_supervisors, make_settings, serve
from figures import record
from helpers import job_body, wait_for

CLUSTER = ClusterCapacity(num_gpus=4, num_gpus_free=4, gpu_memory_bytes=80 * GB, simulated=True)


def queue_job(db: Database, **overrides) -> int:
    """A queued job stored as POST /v1/jobs stores it; its id."""
    spec = JobSpec.model_validate(job_body(**overrides))
    plan = admission.admit(spec, cluster=CLUSTER, overhead_bytes=GB)
    with db.session() as session:
        job, _ = submission.submit_job(session, spec=spec, plan=plan, idempotency_key=None)
        return job.id


def statuses(db: Database, job_id: int) -> tuple[str, list[str]]:
    """The job's status and the to_status of each of its events, in order."""
    with db.session() as session:
        job = session.get(Job, job_id)
        events = session.scalars(select(JobEvent.to_status).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
        return job.status, list(events)


# --------------------------------------------------------------------------- a cancel races a start


def test_a_cancel_committed_first_makes_the_racing_start_lose(database):
    job_id = queue_job(database)
    with database.session() as scheduler:
        job = scheduler.get(Job, job_id)  # the scheduler read the head of the queue: queued
        with database.session() as api:
            job_states.cancel_job(api, job_id)  # the API cancels and commits first
        assert not job_states.transition(scheduler, job, "starting", "placing")
        assert job.status == "cancelled"  # refreshed to what the winner wrote
    assert statuses(database, job_id) == ("cancelled", ["queued", "cancelled"])
    record("cancel commits before a racing start", faults=1, jobs_accepted=1, jobs_stored=1)


def test_a_start_committed_first_turns_the_racing_cancel_into_a_stop_request(database):
    job_id = queue_job(database)
    with database.session() as api:
        assert api.get(Job, job_id).status == "queued"  # the API read the job: queued
        with database.session() as scheduler:
            assert job_states.transition(scheduler, scheduler.get(Job, job_id), "starting", "placing")
        job = job_states.cancel_job(api, job_id)  # the start committed first: the job is stopped, not overwritten
        assert (job.status, job.cancel_requested) == ("starting", True)
    assert statuses(database, job_id) == ("starting", ["queued", "starting"])
    with database.session() as session:
        assert session.get(Job, job_id).cancel_requested
    record("start commits before a racing cancel", faults=1, jobs_accepted=1, jobs_stored=1)


def test_cancelling_a_job_that_ended_since_it_was_read_is_a_409(database):
    job_id = queue_job(database)
    with database.session() as session:
        job = session.get(Job, job_id)
        job_states.transition(session, job, "starting", "placing")
        job_states.transition(session, job, "running", "training")
    with database.session() as api:
        api.get(Job, job_id)  # read while running
        with database.session() as scheduler:
            job_states.transition(scheduler, scheduler.get(Job, job_id), "succeeded", "done")
        with pytest.raises(ServiceError, match="already succeeded") as raised:
            job_states.cancel_job(api, job_id)
        assert raised.value.status_code == 409
    with database.session() as session:
        assert not session.get(Job, job_id).cancel_requested


# --------------------------------------------------------------------------- the service's scheduler


def _job(client: TestClient, job_id: int) -> dict:
    return client.get(f"/v1/jobs/{job_id}").json()


def _gpus_free() -> int:
    return round(ray.available_resources().get("GPU", 0))


def test_a_cancel_during_dispatch_ends_cancelled_with_no_supervisor_and_no_gpu_held(app):
    """The cancel lands after the scheduler committed `starting` and before Ray launched the job:
    the job ends cancelled, its supervisor is gone, and the GPUs it held are free and uncounted."""
    client, settings = app
    runtime = client.app.state.runtime
    launch = runtime.launcher.launch
    cancelled_in_launch = []

    def cancel_then_launch(job: Job) -> None:
        with runtime.db.session() as session:  # as POST /v1/jobs/{id}/cancel does, mid-dispatch
            cancelled_in_launch.append(job_states.cancel_job(session, job.id).cancel_requested)
        launch(job)

    runtime.launcher.launch = cancel_then_launch
    try:
        job_id = client.post("/v1/jobs", json=job_body(steps=100_000)).json()["id"]
        done = wait_for(lambda: _job(client, job_id), lambda j: j["status"] in TERMINAL, what="the job to end")
    finally:
        runtime.launcher.launch = launch
    assert cancelled_in_launch == [True]  # the cancel saw `starting` and asked for a stop
    assert done["status"] == "cancelled", done
    events = client.get(f"/v1/jobs/{job_id}/events").json()["data"]
    assert [e["to_status"] for e in events] == ["queued", "starting", "cancelled"]
    wait_for(
        runtime.launcher.supervisors,
        lambda alive: all(job != job_id for job, _ in alive),
        what="the job's supervisor to end",
    )
    with runtime.db.session() as session:
        assert job_repository.gpus_in_use(session) == 0
    # the GPUs are free for real: a job of all 4 starts
    full = client.post("/v1/jobs", json=job_body(num_gpus=4, steps=3)).json()["id"]
    wait_for(lambda: _job(client, full), lambda j: j["status"] == "succeeded", what="a 4-GPU job to succeed")
    record("cancel during dispatch", faults=1, jobs_accepted=2, jobs_stored=2)


def test_the_scheduler_frees_a_placement_group_its_killed_supervisor_left(ray_cluster, tmp_path):
    """A supervisor killed between asking Ray for its group and recording it leaves a group that
    Ray frees only when the service exits. The scheduler's sweep finds it by its name (an attempt
    of this deployment that is not active) and frees its GPUs."""
    from ray.util.placement_group import placement_group

    from service.scheduling.ray_launcher import placement_group_name

    settings = make_settings(tmp_path, placement_sweep_interval_s=0.5)  # the default 10 s, here waited
    name = placement_group_name(settings.ray_namespace, 999, 0)
    states = lambda: [e["state"] for e in ray.util.placement_group_table().values() if e["name"] == name]
    with serve(settings):
        left = placement_group([{"GPU": 1, "CPU": 0.5}] * 2, name=name)
        ray.get(left.ready(), timeout=30)  # placed: its 2 GPUs are held (Ray's resource view shows it later)
        wait_for(
            states, lambda found: found == ["REMOVED"], what="the sweep to remove the orphaned group", timeout_s=60
        )
        wait_for(_gpus_free, lambda free: free == 4, what="the orphaned group's 2 GPUs back", timeout_s=60)


def test_releasing_an_ended_attempt_frees_its_group_quietly_and_a_sweep_warns(ray_cluster, tmp_path, caplog):
    """An attempt that ended (a succeeded job's) is released with its group: routine, not a warning
    (one followed every job that succeeded, issue 32); a group the sweep finds left behind is one."""
    import logging

    from ray.util.placement_group import placement_group

    from service.scheduling.ray_launcher import placement_group_name

    settings = make_settings(tmp_path)
    launcher = RayLauncher(settings, storage=JobStorage(settings))
    namespace = launcher.settings.ray_namespace
    table = lambda name: [e["state"] for e in ray.util.placement_group_table().values() if e["name"] == name]
    caplog.set_level(logging.DEBUG, logger="service.scheduling.ray_launcher")
    for job_id, end in ((997, lambda: launcher.release(997, 0)), (998, lambda: launcher.sweep(set()))):
        group = placement_group([{"GPU": 1, "CPU": 0.5}], name=placement_group_name(namespace, job_id, 0))
        ray.get(group.ready(), timeout=30)
        end()
        assert table(placement_group_name(namespace, job_id, 0)) == ["REMOVED"]
    removals = [(r.levelname, r.getMessage()) for r in caplog.records if "removed placement group" in r.getMessage()]
    assert removals == [
        ("DEBUG", f"removed placement group {namespace}/zero1-job-997-a0: its attempt was released"),
        ("WARNING", f"removed placement group {namespace}/zero1-job-998-a0: its attempt is not running"),
    ]


def test_one_jobs_error_fails_it_alone_and_the_others_and_the_queue_go_on(app):
    """An I/O error while relaunching one job (its checkpoint storage fails) fails that job with
    the cause; a job running beside it and one queued behind both finish."""
    client, settings = app
    runtime = client.app.state.runtime
    read = runtime.storage.checkpointed_metrics
    victim = client.post("/v1/jobs", json=job_body(steps=100_000, checkpoint_every=5, max_retries=2)).json()["id"]
    other = client.post("/v1/jobs", json=job_body(steps=60)).json()["id"]
    queued = client.post("/v1/jobs", json=job_body(steps=3)).json()["id"]

    def storage_fails_for_victim(job: Job, *, after_step: int):
        if job.id == victim:
            raise OSError(5, "Input/output error", str(runtime.storage.checkpoint_dir(job)))
        return read(job, after_step=after_step)

    runtime.storage.checkpointed_metrics = storage_fails_for_victim
    try:
        wait_for(lambda: _job(client, victim), lambda j: (j["step"] or 0) >= 5, what="the victim training")
        supervisor = ray.get_actor(supervisor_name(victim, 0), namespace=settings.ray_namespace)
        ray.kill(ray.get(supervisor.worker.remote(1)), no_restart=True)  # its retry reads the checkpoint
        failed = wait_for(lambda: _job(client, victim), lambda j: j["status"] in TERMINAL, what="the victim")
        ends = {
            j: wait_for(lambda j=j: _job(client, j), lambda x: x["status"] in TERMINAL, what=f"job {j}")
            for j in (other, queued)
        }
    finally:
        runtime.storage.checkpointed_metrics = read
    assert failed["status"] == "failed" and failed["error"]["exception"] == "OSError", failed
    assert "Input/output error" in failed["error"]["message"]
    assert [e["status"] for e in ends.values()] == ["succeeded", "succeeded"]
    assert ends[other]["step"] == 59
    assert client.get("/healthz").json()["status"] == "ok"
    record("one job's storage fails", faults=2, jobs_accepted=3, jobs_stored=3)


def test_healthz_says_degraded_while_the_scheduler_completes_no_tick(ray_cluster, tmp_path):
    settings = make_settings(tmp_path, scheduler_stale_s=0.5, scheduler_idle_interval_s=0.1)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        scheduler = client.app.state.runtime.scheduler
        # ok once a tick has completed (the first may take longer than 0.5 s on a loaded machine)
        wait_for(lambda: client.get("/healthz"), lambda r: r.status_code == 200, what="healthz ok")

        def database_unreachable():
            raise OSError("could not connect to the database")

        scheduler.db.session = database_unreachable  # every tick's first query raises (healthz asks none)
        try:
            r = wait_for(lambda: client.get("/healthz"), lambda r: r.status_code == 503, what="healthz 503")
        finally:
            del scheduler.db.session
        assert r.json()["status"] == "degraded" and r.json()["scheduler_tick_age_s"] > 0.5
        wait_for(lambda: client.get("/healthz"), lambda r: r.status_code == 200, what="healthz ok again")


# --------------------------------------------------------------------------- supervisors that stall or never start


@ray.remote(num_cpus=0, max_concurrency=4)
class StandInSupervisor:
    """Answers poll() as a supervisor would, with `status` (a dict instead where `status` is "dict":
    a supervisor of another protocol), or not at all until released."""

    def __init__(self, status: str) -> None:
        self.status = status
        self.answering = threading.Event()
        self.answering.set()

    def stall(self) -> None:
        self.answering.clear()

    def resume(self) -> None:
        self.answering.set()

    def poll(self, after_step: int = -1, log_acks: dict | None = None) -> AttemptPoll | dict:
        self.answering.wait()
        if self.status == "dict":
            return {"status": "running"}
        return AttemptPoll(status=AttemptStatus(self.status))

    def ping(self) -> str:
        return self.status


def _answers(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return False
    return True


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def bare(ray_cluster, tmp_path) -> Iterator[tuple[Scheduler, Database, object, FakeClock]]:
    """A scheduler of its own (not ticking by itself) on a fresh database, with a fake clock."""
    settings = make_settings(tmp_path, ray_rpc_timeout_s=0.5)
    upgrade(settings.database_url)
    db = Database(settings.database_url)
    clock = FakeClock()
    storage = JobStorage(settings)
    scheduler = Scheduler(
        db=db,
        launcher=RayLauncher(settings, storage=storage),
        storage=storage,
        total_gpus=lambda: 0,
        interval_s=1,
        start_timeout_s=settings.start_timeout_s,
        clock=clock,
    )
    try:
        yield scheduler, db, settings, clock
    finally:
        db.dispose()
        end_supervisors(settings.ray_namespace)


def _as(db: Database, job_id: int, *path: str) -> None:
    with db.session() as session:
        job = session.get(Job, job_id)
        for status in path:
            assert job_states.transition(session, job, status, "set up by the test")


def _stand_in(settings, job_id: int, status: str):
    """The stand-in, once it answers (its process started: a first poll then never times out)."""
    supervisor = StandInSupervisor.options(
        name=supervisor_name(job_id, 0), namespace=settings.ray_namespace, lifetime="detached"
    ).remote(status)
    assert ray.get(supervisor.ping.remote(), timeout=60) == status
    return supervisor


def _dead(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        pass
    return False


def test_a_supervisor_that_does_not_answer_in_time_is_asked_again_not_taken_for_dead(bare):
    scheduler, db, settings, _ = bare
    job_id = queue_job(db)
    _as(db, job_id, "starting", "running")
    supervisor = _stand_in(settings, job_id, "running")
    ray.get(supervisor.stall.remote())

    scheduler.tick()  # no answer within ray_rpc_timeout_s (0.5 s): a stall, not a death
    assert statuses(db, job_id) == ("running", ["queued", "starting", "running"])
    assert ray.get(supervisor.ping.remote()) == "running"  # not killed

    ray.get(supervisor.resume.remote())
    scheduler.tick()
    assert statuses(db, job_id)[0] == "running"

    ray.kill(supervisor, no_restart=True)  # a death is a death, once Ray has seen it
    wait_for(lambda: _dead(supervisor), bool, what="Ray to report the killed supervisor dead")

    def tick() -> tuple[str, list[str]]:
        scheduler.tick()
        return statuses(db, job_id)

    # a poll in flight may still time out ("unknown") on a slow machine; never anything but running
    status, events = wait_for(tick, lambda seen: seen[0] != "running", what="the death to be seen")
    assert (status, events[-1]) == ("failed", "failed")
    with db.session() as session:
        error = session.get(Job, job_id).error
    assert error["exception"] == "SupervisorLost" and "died" in error["message"], error
    record("a supervisor stalls past the RPC timeout", faults=1, jobs_accepted=1, jobs_stored=1)


def test_a_job_starting_past_its_deadline_fails_with_the_cause_and_its_supervisor_ends(bare):
    scheduler, db, settings, clock = bare
    job_id = queue_job(db)
    _as(db, job_id, "starting")
    supervisor = _stand_in(settings, job_id, "starting")  # placed nothing, says "starting" forever

    scheduler.tick()
    clock.now += settings.start_timeout_s  # exactly the deadline: not past it
    scheduler.tick()
    assert statuses(db, job_id)[0] == "starting"
    clock.now += 1
    scheduler.tick()
    assert statuses(db, job_id) == ("failed", ["queued", "starting", "failed"])
    with db.session() as session:
        error = session.get(Job, job_id).error
    assert error["exception"] == "StartTimeout"
    assert f"did not start within {settings.start_timeout_s:g} s" in error["message"]
    # released (ray.kill takes effect a moment later): a placement group it held goes with it
    wait_for(lambda: _answers(supervisor), lambda answers: not answers, what="the supervisor to end", timeout_s=30)
    record("a start that never finishes", faults=1, jobs_accepted=1, jobs_stored=1)


ROW = MetricRow(
    step=3,
    loss=1.0,
    grad_norm=1.0,
    loss_scale=1.0,
    skipped=False,
    step_time_s=0.1,
    tokens_per_s=1.0,
    mem_peak_bytes=(1,),
    mem_planned_bytes=1,
)


def test_a_poll_in_the_protocol_passes_as_it_is():
    for status in ("starting", "running", "succeeded", "stopped", "failed"):
        answer = AttemptPoll(status=AttemptStatus(status), metrics=(ROW,), nodes=("n0",))
        assert _in_protocol(answer) is answer


def test_a_poll_outside_the_protocol_is_a_failure_that_keeps_its_rows():
    cancelled = _in_protocol(AttemptPoll(status=AttemptStatus.CANCELLED, metrics=(ROW,), nodes=("n0",)))
    assert (cancelled.status, cancelled.metrics, cancelled.nodes) == (AttemptStatus.FAILED, (ROW,), ("n0",))
    assert cancelled.error.exception == "SupervisorError"
    assert "reported status 'cancelled', which the scheduler does not expect" in cancelled.error.message
    other = _in_protocol({"status": "running"})  # a supervisor of another protocol: a dict
    assert (other.status, other.metrics) == (AttemptStatus.FAILED, ())
    assert "reported a dict where an AttemptPoll belongs" in other.error.message


@pytest.mark.parametrize(("answer", "said"), [("cancelled", "status 'cancelled'"), ("dict", "a dict")])
def test_a_supervisor_outside_the_protocol_fails_its_job_and_ends(bare, answer, said):
    """A supervisor cancelled behind the service's back, or one that answers in another shape: the
    job fails with the cause (no retry left) and the supervisor is released, its GPUs freed."""
    scheduler, db, settings, _ = bare
    job_id = queue_job(db)
    _as(db, job_id, "starting", "running")
    supervisor = _stand_in(settings, job_id, answer)

    scheduler.tick()
    assert statuses(db, job_id) == ("failed", ["queued", "starting", "running", "failed"])
    with db.session() as session:
        error = session.get(Job, job_id).error
    assert error["exception"] == "SupervisorError" and f"reported {said}" in error["message"], error
    wait_for(lambda: _answers(supervisor), lambda answers: not answers, what="the supervisor to end", timeout_s=30)


# --------------------------------------------------------------------------- a job id used again


def test_a_new_job_with_a_reused_id_trains_from_scratch_in_a_directory_of_its_own(ray_cluster, tmp_path):
    """A database restored from an older backup hands out job id 1 again: the new job 1 must not
    resume the old job 1's checkpoint, nor take its rows into its curve."""
    checkpoints = tmp_path / "checkpoints"
    body = job_body(steps=20, checkpoint_every=5)
    runs = []
    for database in ("before.db", "restored.db"):
        settings = make_settings(
            tmp_path, database_url=f"sqlite:///{tmp_path / database}", checkpoint_uri=str(checkpoints)
        )
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            job_id = client.post("/v1/jobs", json=body).json()["id"]
            done = wait_for(lambda: _job(client, job_id), lambda j: j["status"] in TERMINAL, what="the job")
            curve = client.get(f"/v1/jobs/{job_id}/metrics").json()["data"]
            with client.app.state.runtime.db.session() as session:
                run_id = session.get(Job, job_id).run_id
        runs.append((job_id, done, curve, run_id))
    (first_id, _, first_curve, first_run), (again_id, again, again_curve, again_run) = runs
    assert first_id == again_id == 1 and first_run != again_run
    assert again["status"] == "succeeded" and again["attempt"] == 0
    assert [m["step"] for m in again_curve] == list(range(20)) and {m["attempt"] for m in again_curve} == {0}
    assert again_curve[0]["loss"] == first_curve[0]["loss"]  # the same seed from scratch, not a resumed model
    # each in its own directory; a finished job keeps its final checkpoint only (ZERO1_CHECKPOINT_KEEP_FINISHED=1)
    # and its final model
    for run_id in (first_run, again_run):
        directory = checkpoints / checkpoint_dirname(1, run_id)
        assert sorted(p.name for p in directory.iterdir()) == ["final", "step-000000019"]
    record(
        "a job id used again after a restore",
        faults=1,
        jobs_accepted=2,
        jobs_stored=2,
        rows_expected=20,
        rows_stored=len(again_curve),
    )


def test_a_finished_job_keeps_no_checkpoint_but_its_final_model_with_keep_finished_0(ray_cluster, tmp_path):
    settings = make_settings(tmp_path, checkpoint_keep_finished=0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        job_id = client.post("/v1/jobs", json=job_body(steps=6, checkpoint_every=2)).json()["id"]
        wait_for(lambda: _job(client, job_id), lambda j: j["status"] == "succeeded", what="the job")
        with client.app.state.runtime.db.session() as session:
            directory = client.app.state.runtime.storage.checkpoint_dir(session.get(Job, job_id))
    assert isinstance(directory, Path) and [p.name for p in directory.iterdir()] == ["final"]


def test_an_idle_tick_asks_the_database_two_questions_and_a_queued_job_is_still_admitted(tmp_path):
    """With nothing queued a tick neither admits nor grows (two queries: the active jobs, any queued; the
    first tick after a start also looks for a running sweep); a job submitted meanwhile is started by
    the next tick."""
    from sqlalchemy import event

    from conftest import serve_on_fakes

    with serve_on_fakes(make_settings(tmp_path, scheduler_interval_s=60)) as client:
        scheduler = client.app.state.runtime.scheduler
        scheduler.tick()  # the first: no sweep running, none to advance until one is created
        statements: list[str] = []
        count = lambda *args: statements.append(args[2])  # before_cursor_execute(conn, cursor, statement, ...)
        event.listen(scheduler.db.engine, "before_cursor_execute", count)
        try:
            scheduler.tick()
            idle = len(statements)
            job_id = client.post("/v1/jobs", json=job_body()).json()["id"]
            statements.clear()
            scheduler.tick()
            busy = len(statements)
        finally:
            event.remove(scheduler.db.engine, "before_cursor_execute", count)
        assert idle == 2, statements
        assert busy > idle  # the queue is read and its head started
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] in ("starting", "running")


class _RecordedEvent(threading.Event):
    """A threading.Event that records how each wait on it ended: True woken (set), False timed out."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0
        self.ends: list[bool] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1
        woken = super().wait(timeout)
        self.ends.append(woken)
        return woken


def test_an_idle_scheduler_waits_its_idle_interval_and_a_submit_wakes_it(tmp_path):
    """With nothing active nor queued the scheduler waits ZERO1_SCHEDULER_IDLE_INTERVAL_S (a minute here)
    between ticks. A POST wakes it: the idle wait under way ends woken, not timed out, and the job
    submitted starts; a GET does not wake it. Asserted as an order of events, not a time."""
    from conftest import serve_on_fakes

    settings = make_settings(tmp_path, scheduler_interval_s=0.01, scheduler_idle_interval_s=60, scheduler_stale_s=600)
    with serve_on_fakes(settings) as client:
        scheduler = client.app.state.runtime.scheduler
        woken: list[str] = []
        wake = scheduler.wake
        scheduler.wake = lambda: (woken.append("woken"), wake())
        recorded, started = _RecordedEvent(), scheduler._wake
        scheduler._wake = recorded
        started.set()  # the loop leaves its wait on the first event; it waits on the recorded one from now on
        wait_for(lambda: recorded.waiting and scheduler._idle, bool, what="an idle wait on the recorded event")
        assert client.get("/v1/jobs").status_code == 200
        assert woken == []
        job_id = client.post("/v1/jobs", json=job_body()).json()["id"]
        assert woken == ["woken"]
        wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"], lambda s: s == "running", what="the job")
        assert recorded.ends[0] is True, recorded.ends  # the idle wait the POST found ended by the wake
        assert not scheduler._idle  # a job is active: it ticks every interval_s again
