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

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db import Database
from service.jobs import ACTIVE, gpus_in_use, transition
from service.launcher import RayLauncher
from service.models import Job, Metric

log = logging.getLogger(__name__)

_METRIC_FIELDS = ("step", "loss", "grad_norm", "loss_scale", "skipped", "step_time_s", "tokens_per_s",
                  "mem_peak_bytes", "mem_planned_bytes")  # fmt: skip


def store_metrics(session: Session, job: Job, rows: list[dict[str, Any]]) -> None:
    """Insert one attempt's rows (a row already stored is skipped) and note the latest on the job."""
    if not rows:
        return
    values = [{**{k: _finite(row[k]) for k in _METRIC_FIELDS}, "job_id": job.id, "attempt": job.attempt}
              for row in rows]  # fmt: skip
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    statement = dialect.insert(Metric).on_conflict_do_nothing(index_elements=["job_id", "attempt", "step"])
    session.execute(statement, values)
    last = max(values, key=lambda v: v["step"])
    if job.step is None or last["step"] >= job.step:
        job.step = last["step"]
        job.latest = {k: last[k] for k in _METRIC_FIELDS}


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class Scheduler:
    def __init__(self, *, db: Database, launcher: RayLauncher, total_gpus: Callable[[], int], interval_s: float):
        self.db, self.launcher, self.total_gpus, self.interval_s = db, launcher, total_gpus, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="zero1-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop outlives one bad tick; the next retries
                log.exception("scheduler tick failed")

    def tick(self) -> None:
        with self.db.session() as session:
            for job in list(session.scalars(select(Job).where(Job.status.in_(ACTIVE)).order_by(Job.id))):
                self._advance(session, job)
            self._admit(session)

    def _advance(self, session: Session, job: Job) -> None:
        if job.cancel_requested:
            self.launcher.cancel(job.id)
            store_metrics(session, job, self._poll(job)["metrics"])
            transition(session, job, "cancelled", "cancelled by request: every rank stopped, GPUs freed")
            self.launcher.release(job.id)
            return
        state = self._poll(job)
        store_metrics(session, job, state["metrics"])
        status = state["status"]
        if job.status == "starting" and status in ("running", "succeeded"):
            nodes = len(set(state["nodes"]))
            transition(session, job, "running", f"{job.num_gpus} ranks placed on {nodes} node(s) and training")
        if status == "succeeded":
            transition(session, job, "succeeded", f"all {job.num_gpus} ranks finished step {job.steps - 1}")
            self.launcher.release(job.id)
        elif status in ("failed", "lost"):
            job.error = state["error"]
            transition(session, job, "failed", _failure_reason(state["error"]))
            self.launcher.release(job.id)

    def _poll(self, job: Job) -> dict[str, Any]:
        return self.launcher.poll(job.id, after_step=-1 if job.step is None else job.step)

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


def _failure_reason(error: dict[str, Any] | None) -> str:
    if not error:
        return "failed"
    where = f"rank {error['rank']} on node {error['node_id']}: " if error.get("rank") is not None else ""
    return f"{where}{error.get('exception')}: {error.get('message')}"
