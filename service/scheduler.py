"""The scheduler: FIFO with gang admission, dispatch, state transitions and metrics ingestion.

One thread ticks every ZERO1_SCHEDULER_INTERVAL_S. A tick is one transaction:
it collects each active job's new metric rows and status from its supervisor,
records the transitions, and starts queued jobs in submission order while
their N GPUs are free (the head of the queue waits for its GPUs: no job
overtakes it, so none starves). Running jobs never hold more GPUs than exist.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db import Database
from service.jobs import ACTIVE, gpus_in_use, transition
from service.launcher import RayLauncher
from service.models import Job, Metric

log = logging.getLogger(__name__)

_ALL_STEPS = 2**62
_METRIC_FIELDS = ("step", "loss", "grad_norm", "loss_scale", "skipped", "step_time_s", "tokens_per_s",
                  "mem_peak_bytes", "mem_planned_bytes")  # fmt: skip


def store_metrics(session: Session, job: Job, rows: list[dict[str, Any]]) -> int:
    """Insert one attempt's rows (a row already stored is skipped), note the latest on the job;
    the number of rows given."""
    if not rows:
        return 0
    values = [{**{k: _finite(row[k]) for k in _METRIC_FIELDS}, "job_id": job.id, "attempt": job.attempt}
              for row in rows]  # fmt: skip
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    statement = dialect.insert(Metric).on_conflict_do_nothing(index_elements=["job_id", "attempt", "step"])
    session.execute(statement, values)
    last = max(values, key=lambda v: v["step"])
    if job.step is None or last["step"] >= job.step:
        job.step = last["step"]
        job.latest = {k: last[k] for k in _METRIC_FIELDS}
    return len(values)


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class Scheduler:
    def __init__(self, *, db: Database, launcher: RayLauncher, total_gpus: Callable[[], int], interval_s: float):
        self.db, self.launcher, self.total_gpus, self.interval_s = db, launcher, total_gpus, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stored: dict[int, int] = {}  # job id -> step through which its rows are now stored

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="zero1-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop ticking, then drain: store what the supervisors hold (SIGTERM ends here)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        try:
            num_rows = self.drain()
            log.info("scheduler stopped; drained %d metric rows", num_rows)
        except Exception:  # noqa: BLE001 - shutting down: the supervisors keep the rows for the next start
            log.exception("drain at shutdown failed; the supervisors keep the unstored rows")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop outlives one bad tick; the next retries
                log.exception("scheduler tick failed")

    def tick(self) -> None:
        self._stored = {}  # a tick that raised rolled back what it noted
        with self.db.session() as session:
            for job in self._active(session):
                self._advance(session, job)
            self._admit(session)
        self._discard_stored()

    def drain(self) -> int:
        """One last collection of every active job's metrics, admitting nothing; rows stored."""
        with self.db.session() as session:
            return sum(store_metrics(session, job, self._poll(job)["metrics"]) for job in self._active(session))

    def _stored_through(self, job: Job, step: int | None) -> None:
        """Note that once this transaction commits, the rows of `job` through `step` are stored."""
        if step is not None:
            self._stored[job.id] = max(step, self._stored.get(job.id, step))

    def _discard_stored(self) -> None:
        """After a commit: the pruned checkpoints' rows now in the database are not needed for a
        relaunch; delete them (never before the commit: a stop in between would lose them)."""
        stored, self._stored = self._stored, {}
        for job_id, step in stored.items():
            self.launcher.discard_stored_metrics(job_id, through_step=step)

    def recover(self) -> None:
        """At start-up: adopt the supervisors that outlived the last service process, relaunch the
        active jobs whose supervisor is gone (an embedded Ray dies with the service), and end
        supervisors no active job owns. Queued jobs wait in the database as they were."""
        self._stored = {}
        with self.db.session() as session:
            jobs = {job.id: job for job in self._active(session)}
            for job_id, attempt in self.launcher.supervisors():
                job = jobs.get(job_id)
                if job is None or attempt != job.attempt:
                    log.warning("ending orphaned supervisor of job %s attempt %s", job_id, attempt)
                    self.launcher.release(job_id, attempt)
            for job in jobs.values():
                if self.launcher.exists(job.id, job.attempt):
                    log.info("job %s: re-attached to attempt %s", job.id, job.attempt)
                    continue
                cause = "the service restarted and this job's supervisor did not survive it"
                if self.launcher.settings.ray_address is None:
                    cause += " (the embedded Ray cluster stops with the service)"
                self._relaunch(session, job, cause=cause, retry=False)
        self._discard_stored()

    @staticmethod
    def _active(session: Session) -> list[Job]:
        return list(session.scalars(select(Job).where(Job.status.in_(ACTIVE)).order_by(Job.id)))

    def _advance(self, session: Session, job: Job) -> None:
        if job.cancel_requested:
            self.launcher.cancel(job.id, job.attempt)
            store_metrics(session, job, self._poll(job)["metrics"])
            transition(session, job, "cancelled", "cancelled by request: every rank stopped, GPUs freed")
            self.launcher.release(job.id, job.attempt)
            self._stored_through(job, _ALL_STEPS)  # never relaunched: its saved rows are not needed
            return
        state = self._poll(job)
        before = job.step
        store_metrics(session, job, state["metrics"])
        every = job.spec.get("checkpoint_every") or 0
        if every and job.step is not None and (before is None or (job.step + 1) // every > (before + 1) // every):
            self._stored_through(job, job.step)  # a checkpoint interval's rows stored: once an interval
        status = state["status"]
        if job.status in ("starting", "restarting") and status in ("running", "succeeded"):
            transition(session, job, "running", _running_reason(job, nodes=len(set(state["nodes"]))))
        if status == "succeeded":
            transition(session, job, "succeeded", f"all {job.num_gpus} ranks finished step {job.steps - 1}")
            self.launcher.release(job.id, job.attempt)
            self._stored_through(job, _ALL_STEPS)
        elif status in ("failed", "lost"):
            self._on_failure(session, job, state["error"])

    def _on_failure(self, session: Session, job: Job, error: dict[str, Any] | None) -> None:
        """Retry from the last checkpoint while max_retries allows, else fail with the cause."""
        max_retries = job.spec.get("max_retries", 0)
        cause = _failure_reason(error)
        if job.num_retries >= max_retries:
            job.error = error
            spent = f" after {job.num_retries} of max_retries {max_retries}" if max_retries else ""
            transition(session, job, "failed", f"{cause}{spent}")
            self.launcher.release(job.id, job.attempt)
            self._stored_through(job, _ALL_STEPS)
            return
        job.num_retries += 1
        self._relaunch(session, job, cause=f"{cause}; retry {job.num_retries} of {max_retries}", retry=True)

    def _relaunch(self, session: Session, job: Job, *, cause: str, retry: bool) -> None:
        """A new attempt from the latest complete checkpoint; rows past it are superseded."""
        self.launcher.release(job.id, job.attempt)
        resume = self.launcher.resume_step(job.id)
        # rows up to the checkpoint that never reached the database (Ray stopped with the service)
        # were saved with the checkpoint: store them, or the surviving curve would have a gap
        saved = self.launcher.checkpointed_metrics(job.id, after_step=-1 if job.step is None else job.step)
        store_metrics(session, job, [row for row in saved if row["step"] < resume])
        self._stored_through(job, resume - 1)
        supersede_after(session, job, resume_step=resume)
        where = f"checkpoint step {resume - 1}" if resume else "the start (no checkpoint yet)"
        if job.status != "restarting":
            transition(session, job, "restarting", f"{cause}: attempt {job.attempt + 1} resumes from {where}")
        job.attempt += 1
        session.flush()
        try:
            self.launcher.launch(job)
        except Exception as exc:  # noqa: BLE001 - a relaunch Ray refuses fails this job alone
            log.exception("job %s: relaunch failed", job.id)
            job.error = {"rank": None, "node_id": None, "exception": type(exc).__name__, "message": str(exc)}
            transition(session, job, "failed", f"relaunch failed: {type(exc).__name__}: {exc}")
        if not retry:
            log.info("job %s: %s; relaunched as attempt %s", job.id, cause, job.attempt)

    def _poll(self, job: Job) -> dict[str, Any]:
        return self.launcher.poll(job.id, job.attempt, after_step=-1 if job.step is None else job.step)

    def _admit(self, session: Session) -> None:
        free = self.total_gpus() - gpus_in_use(session)
        head = select(Job).where(Job.status == "queued").order_by(Job.id).limit(1)
        while (job := session.scalar(head)) is not None:  # only the head is read: the queue may be long
            if job.num_gpus > free:
                return  # strict FIFO: the head waits for its GPUs
            transition(session, job, "starting", f"{job.num_gpus} GPUs free: placing {job.num_gpus} ranks")
            session.flush()
            try:
                self.launcher.launch(job)
            except Exception as exc:  # noqa: BLE001 - a job Ray refuses fails alone; the queue goes on
                log.exception("job %s: dispatch failed", job.id)
                job.error = {"rank": None, "node_id": None, "exception": type(exc).__name__, "message": str(exc)}
                transition(session, job, "failed", f"dispatch to Ray failed: {type(exc).__name__}: {exc}")
                continue
            free -= job.num_gpus


def supersede_after(session: Session, job: Job, *, resume_step: int) -> None:
    """Mark the rows a relaunch will redo (step >= resume_step) superseded; the job's step and
    latest row fall back to the surviving curve's last."""
    session.execute(
        update(Metric)
        .where(Metric.job_id == job.id, Metric.step >= resume_step, Metric.superseded.is_(False))
        .values(superseded=True)
    )
    last = session.scalar(
        select(Metric).where(Metric.job_id == job.id, Metric.superseded.is_(False))
        .order_by(Metric.step.desc()).limit(1)
    )  # fmt: skip
    job.step = None if last is None else last.step
    job.latest = None if last is None else {k: getattr(last, k) for k in _METRIC_FIELDS}


def _running_reason(job: Job, *, nodes: int) -> str:
    if job.status == "restarting":
        return f"attempt {job.attempt}: {job.num_gpus} ranks placed on {nodes} node(s), resumed"
    return f"{job.num_gpus} ranks placed on {nodes} node(s) and training"


def _failure_reason(error: dict[str, Any] | None) -> str:
    if not error:
        return "failed"
    where = f"rank {error['rank']} on node {error['node_id']}: " if error.get("rank") is not None else ""
    return f"{where}{error.get('exception')}: {error.get('message')}"
