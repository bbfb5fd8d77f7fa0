"""The scheduler: the tick, each attempt watched (start timeout, cancel, a stop past its grace),
recovery at start-up, and the Ray and file work each job's transaction decided.

One thread ticks every ZERO1_SCHEDULER_INTERVAL_S while a job is active or queued, and every
ZERO1_SCHEDULER_IDLE_INTERVAL_S while none is; a request that may change a job (any API call but a
read) wakes it at once (wake()). A tick asks every active job's supervisor
for its news at once (Ray, outside any transaction), then settles each job in a transaction of
its own: its new metric rows and its transition, or what becomes of it once its attempt is over
(service/scheduling/outcomes.py records both). An error while settling one job fails that
job alone; the others and the queue go on. Then the queue's policy (service/scheduling/queue_policy.py)
starts queued jobs by priority, then submission, with backfill and quotas, and asks lower jobs to
stop for the first that cannot start (preemption: they checkpoint at their next step and return
to the queue, or shrink). Running jobs never hold more GPUs than exist.

Ray is called between transactions, not inside one, so a slow Ray holds no database lock (the one
exception: a relaunch's N reads Ray's free GPUs, service/scheduling/outcomes.py).
Every status change is a compare-and-set (service.scheduling.job_states.transition), so a cancel that races a
start ends in one state: cancelled before the start commits, or flagged and stopped after.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.scheduling.dispatch import Dispatcher, Reasons, Settled, Stop
from service.scheduling.failure import Replan
from service.scheduling.job_states import still_active
from service.scheduling.outcomes import Outcomes
from service.scheduling.ray_launcher import RayLauncher
from service.schemas.fields import ACTIVE
from service.store.artifacts import record_final
from service.store.db import Database
from service.store.job_repository import any_queued, poll_acks
from service.store.job_storage import JobStorage
from service.store.tables import Job, utcnow
from service.telemetry import Telemetry
from workers.records import AttemptPoll, AttemptStatus, RankError

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        *,
        db: Database,
        launcher: RayLauncher,
        storage: JobStorage,
        total_gpus: Callable[[], int],
        interval_s: float,
        idle_interval_s: float | None = None,
        start_timeout_s: float = 300.0,
        grow_interval_s: float = 300.0,
        sweep_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        telemetry: Telemetry | None = None,
        advance_sweeps: Callable[[Session], bool] | None = None,
        replan: Callable[[Job, RankError], Replan] | None = None,
    ) -> None:
        self.db = db
        self.launcher = launcher
        self.total_gpus = total_gpus
        self.interval_s = interval_s
        self.idle_interval_s = interval_s if idle_interval_s is None else max(interval_s, idle_interval_s)
        """The wait between ticks while no job is active or queued; wake() ends it at once."""
        self.start_timeout_s = start_timeout_s
        self.grow_interval_s = grow_interval_s
        self.clock = clock
        self.storage = storage  # where each job's checkpoints are: resumes, stored rows' files, retiring
        self.sweep_interval_s = sweep_interval_s  # how often a tick frees groups no active attempt owns
        self.telemetry = telemetry or Telemetry()  # a registry of its own where no app's is given (tests)
        self.dispatcher = Dispatcher(
            db=db,
            launcher=launcher,
            total_gpus=total_gpus,
            clock=clock,
            telemetry=self.telemetry,
            grow_interval_s=grow_interval_s,
        )
        self.stops = self.dispatcher.stops
        self.outcomes = Outcomes(
            dispatcher=self.dispatcher,
            launcher=launcher,
            storage=storage,
            total_gpus=total_gpus,
            telemetry=self.telemetry,
        )
        self.last_tick_at: float | None = None
        """clock() when the last tick completed (when the scheduler started, before the first)."""
        self._starting_since: dict[tuple[int, int], float] = {}  # (job, attempt) -> clock() first seen starting
        self._swept_at = -float("inf")
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._idle = False  # the last tick found no job active nor queued
        self.advance_sweeps = advance_sweeps
        """Each tick, before it admits: submit the running sweeps' next trials and stop those early stopping
        judges behind (service.experiments.sweeps.advance); whether a sweep still runs. None: no sweeps."""
        self._sweeping = True  # a sweep may be running: the first tick looks (sweep_created() sets it again)
        self.replan = replan
        """An out-of-memory attempt's job at its next configuration, or why none (service.intake.replans's
        Replanner); None: such a failure is retried as any other."""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.last_tick_at = self.clock()  # the age counts from here until the first tick completes
        self._thread = threading.Thread(target=self._loop, name="zero1-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop ticking, then drain: store what the supervisors hold (SIGTERM ends here)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        try:
            num_rows = self.drain()
            log.info("scheduler stopped; drained %d metric rows", num_rows)
        except Exception:
            log.exception("drain at shutdown failed; the supervisors keep the unstored rows")

    def queue_reasons(self) -> Reasons:
        """Why the queued jobs wait, as of the last tick."""
        return self.dispatcher.reasons

    def estimated_starts(self, session: Session, *, limit: int) -> dict[int, datetime | None]:
        """When each of the first `limit` queued jobs is estimated to start, the policy replayed forward
        on the database as it is now (Dispatcher.estimate_starts); None where unknown, and for every job
        if the estimate fails (logged: the queue is still listed)."""
        now = utcnow()
        try:
            seconds = self.dispatcher.estimate_starts(session, limit=limit)
        except Exception:
            log.exception("could not estimate the queued jobs' starts")
            return {}
        return {job_id: None if s is None else now + timedelta(seconds=s) for job_id, s in seconds.items()}

    def tick_age_s(self) -> float | None:
        """Seconds since the last tick completed (or since start, before the first); None if never started."""
        return None if self.last_tick_at is None else self.clock() - self.last_tick_at

    def sweep_created(self) -> None:
        """A sweep was stored: the next tick submits its first trials (and each tick after, until every
        running sweep has ended)."""
        self._sweeping = True
        self.wake()

    def wake(self) -> None:
        """Tick now, not at the end of an idle wait: something that may change a job has happened (a
        submit, a cancel, a resume). While jobs are active the next tick is at most interval_s away."""
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.idle_interval_s if self._idle else self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:
                log.exception("scheduler tick failed")

    def tick(self) -> None:
        """Settle every active job, each alone, then admit from the queue."""
        started = time.perf_counter()
        jobs = self._active()
        if self.clock() - self._swept_at >= self.sweep_interval_s:  # before this tick launches anything
            self._sweep({(job.id, job.attempt) for job in jobs})
        states = self.launcher.poll_many([poll_acks(job) for job in jobs])
        attempts = set(states)
        self._starting_since = {key: at for key, at in self._starting_since.items() if key in attempts}
        self.dispatcher.keep(attempts)
        for job in jobs:
            self._isolated(job, lambda job=job: self._advance(job, states[(job.id, job.attempt)]))
        # a database that cannot be reached raises here: the tick does not count. With nothing
        # queued there is nothing to start nor to preempt for, and with no elastic job running none
        # to grow: an idle service's tick is two queries, not seven (it ticks 5 times a second)
        with self.db.session() as session:
            if self._sweeping and self.advance_sweeps is not None:  # queued before this tick admits
                self._sweeping = self.advance_sweeps(session)
            queued = any_queued(session)
        self._idle = not jobs and not queued  # nothing to watch nor to start: wait for wake() or idle_interval_s
        if queued:
            self.dispatcher.admit(launch=lambda job: self._launch(job, what="dispatch"))
        else:
            self.dispatcher.reasons = Reasons()
            if any(job.min_gpus is not None and job.min_gpus < job.num_gpus for job in jobs):
                self.dispatcher.grow()
        self.last_tick_at = self.clock()
        self.telemetry.tick_took(time.perf_counter() - started)  # a tick that completes

    def drain(self) -> int:
        """One last collection of every active job's metrics and log lines, admitting nothing; rows stored."""
        jobs = self._active()
        states = self.launcher.poll_many([poll_acks(job) for job in jobs])
        stored = 0
        for job in jobs:
            with self.db.session() as session:
                if (fresh := still_active(session, job)) is not None:
                    stored += self.outcomes.ingest(session, fresh, states[(job.id, job.attempt)])
        return stored

    def _sweep(self, attempts: set[tuple[int, int]]) -> None:
        """Free the placement groups no active attempt owns; a Ray that does not answer is asked next time."""
        self._swept_at = self.clock()
        try:
            self.launcher.sweep(attempts)
        except Exception:
            log.exception("could not look for orphaned placement groups")

    def recover(self) -> None:
        """At start-up: adopt the supervisors that outlived the last service process, relaunch the
        active jobs whose supervisor is gone (an embedded Ray dies with the service) or carry out
        the stop they were asked (persisted: a preempted victim goes back to the queue), and end
        supervisors and placement groups no active job owns. Queued jobs wait as they were."""
        jobs = {job.id: job for job in self._active()}
        self.stops.load(jobs.values(), now=self.clock())  # a stop asked before the restart is still asked
        for job_id, attempt in self.launcher.supervisors():
            job = jobs.get(job_id)
            if job is None or attempt != job.attempt:
                log.warning("ending orphaned supervisor of job %s attempt %s", job_id, attempt)
                self.launcher.release(job_id, attempt)
        self._sweep({(job.id, job.attempt) for job in jobs.values()})
        for job in jobs.values():
            if self.launcher.exists(job.id, job.attempt):
                log.info("job %s: re-attached to attempt %s", job.id, job.attempt)
                continue
            cause = "the service restarted and this job's supervisor did not survive it"
            if self.launcher.settings.ray_address is None:
                cause += " (the embedded Ray cluster stops with the service)"
            self._isolated(job, lambda job=job, cause=cause: self._settle(job, self._recovering(cause)))

    def _recovering(self, cause: str) -> Callable[[Session, Job], Settled | None]:
        """For a job whose attempt the restart lost: the stop asked of it carried out, else relaunched."""
        return lambda session, job: self.outcomes.carry_out(
            session, job, stop=self.stops.pop(job.id, job.attempt), cause=cause, how="killed"
        )

    # ----------------------------------------------------------------------- one job

    def _active(self) -> list[Job]:
        """The active jobs as they are now; detached, to be read between transactions."""
        with self.db.session() as session:
            return list(session.scalars(select(Job).where(Job.status.in_(ACTIVE)).order_by(Job.id)))

    def _isolated(self, job: Job, work: Callable[[], None]) -> None:
        """Run one job's work; whatever it raises fails that job alone, with the cause."""
        try:
            work()
        except Exception as exc:
            log.exception("job %s: failing it alone", job.id)
            self._fail_alone(job, exc)

    def _fail_alone(self, job: Job, exc: Exception) -> None:
        error = RankError.of(exc)
        reason = f"the scheduler could not handle this job: {type(exc).__name__}: {exc}"
        try:
            self._settle(job, lambda session, fresh: self.outcomes.end(session, fresh, "failed", reason, error=error))
        except Exception:
            log.exception("job %s: could not record its failure", job.id)

    def _settle(self, job: Job, write: Callable[[Session, Job], Settled | None]) -> None:
        """write(session, job) in a transaction of its own, on the job as it is now (skipped if it
        has ended or moved to another attempt since it was read); then the Ray and file work it
        decided, after the commit."""
        with self.db.session() as session:
            fresh = still_active(session, job)
            if fresh is None:
                return
            settled = write(session, fresh)
        if settled is None:
            return
        if settled.stored_through is not None:
            self.storage.discard_stored_metrics(fresh, through_step=settled.stored_through)
        if settled.ended:
            if fresh.started_at is not None and fresh.finished_at is not None:
                self.telemetry.job_ended(
                    fresh.status, duration_s=(fresh.finished_at - fresh.started_at).total_seconds()
                )
            self.launcher.release(job.id, job.attempt)
            self.storage.retire(fresh)
        if settled.relaunch or settled.release:
            self.launcher.release(job.id, job.attempt)
        if settled.relaunch:
            self._launch(fresh, what="relaunch")

    def _advance(self, job: Job, state: AttemptPoll) -> None:
        if state.status in (AttemptStatus.STARTING, AttemptStatus.RUNNING) and self._kill_if_overdue(job):
            return  # an attempt that has stopped (or ended) since is settled as it ended
        if job.cancel_requested:
            self.launcher.cancel(job.id, job.attempt)
            _, _, after, acks = poll_acks(job)
            state = self.launcher.poll(job.id, job.attempt, after_step=after, log_acks=acks)  # up to the stop
            reason = "cancelled by request: every rank stopped, GPUs freed"
            self._settle(
                job, lambda session, fresh: self.outcomes.end(session, fresh, "cancelled", reason, state=state)
            )
            return
        if state.status == AttemptStatus.UNKNOWN:  # no answer in time: ask again next tick, never take it for dead
            return
        if (job.stop_early or job.suspend_requested) and job.id not in self.stops:
            kind = "stop_early" if job.stop_early else "suspend"
            self.dispatcher.ask_stop(job, Stop(kind=kind, attempt=job.attempt, asked_at=self.clock()))
        if job.status == "running" and state.status == AttemptStatus.RUNNING and not (state.metrics or state.logs):
            return  # nothing new: no transaction
        if state.status == AttemptStatus.STARTING and self._start_overdue(job):
            state = replace(state, status=AttemptStatus.FAILED, error=start_timeout(job, self.start_timeout_s))
        if state.status == AttemptStatus.SUCCEEDED:  # final/ read, checked and recorded before the job ends
            record_final(self.db, job, job_dir=self.storage.checkpoint_dir(job))
        replan = self._replan(job, state.error) if state.status in (AttemptStatus.FAILED, AttemptStatus.LOST) else None
        self._settle(job, lambda session, fresh: self.outcomes.progress(session, fresh, state, replan=replan))

    def _replan(self, job: Job, error: RankError | None) -> Replan | None:
        """An out-of-memory failure's next configuration, planned before the job's transaction (its traces
        are Ray tasks); None for any other failure, or where planning failed (logged: the failure policy
        then decides as for any failure)."""
        if self.replan is None or error is None or not error.is_oom:
            return None
        try:
            return self.replan(job, error)
        except Exception:
            log.exception("job %s: could not plan it again after it ran out of memory", job.id)
            return None

    def _start_overdue(self, job: Job) -> bool:
        """Whether this attempt has been starting for longer than start_timeout_s (counted from
        the first tick that saw it starting: a service restart starts the count again)."""
        since = self._starting_since.setdefault((job.id, job.attempt), self.clock())
        return self.clock() - since > self.start_timeout_s

    def _kill_if_overdue(self, job: Job) -> bool:
        """A stop not done within ZERO1_PREEMPT_GRACE_S: kill the ranks; the job resumes from its
        last complete checkpoint (back in the queue, smaller, or suspended, as asked)."""
        grace = self.launcher.settings.preempt_grace_s
        if (stop := self.stops.pop_overdue(job.id, job.attempt, now=self.clock(), grace_s=grace)) is None:
            return False
        self.launcher.cancel(job.id, job.attempt)
        _, _, after, acks = poll_acks(job)
        state = self.launcher.poll(job.id, job.attempt, after_step=after, log_acks=acks)
        cause = f"its ranks did not stop within {grace:g} s (ZERO1_PREEMPT_GRACE_S) and were killed"

        def write(session: Session, fresh: Job) -> Settled | None:
            self.outcomes.ingest(session, fresh, state)
            return self.outcomes.carry_out(session, fresh, stop=stop, cause=cause, how="killed")

        self._settle(job, write)
        return True

    def _launch(self, job: Job, *, what: str) -> None:
        """Start the job's current attempt on Ray; a launch Ray refuses fails this job alone."""
        try:
            self.launcher.launch(job)
        except Exception as exc:
            log.exception("job %s: %s failed", job.id, what)
            error = RankError.of(exc)
            reason = f"{'dispatch to Ray' if what == 'dispatch' else what} failed: {type(exc).__name__}: {exc}"
            self._settle(job, lambda session, fresh: self.outcomes.end(session, fresh, "failed", reason, error=error))


def start_timeout(job: Job, timeout_s: float) -> RankError:
    why = f"did not start within {timeout_s:g} s (ZERO1_START_TIMEOUT_S): its ranks were not all placed and running"
    return RankError(exception="StartTimeout", message=f"attempt {job.attempt} {why}")
