"""What a job's transaction records of its attempt's news: the metric rows and log lines a poll
brought, the move to running once every rank started, and, when the attempt is over, what becomes
of the job: ended (succeeded, failed, cancelled), relaunched from its latest complete checkpoint (a
retry, a resize), or waiting again, holding no GPU (back in the queue, or suspended).

Every method here takes the job's session and only writes through it; what is to happen after the
commit (release a supervisor, launch the next attempt, drop stored rows' files) is returned as a
Settled, which the scheduler (service/scheduling/scheduler.py) carries out between transactions. No
Ray call is made here except asking the launcher which GPUs Ray sees free for a relaunch's N.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from service.scheduling import elastic
from service.scheduling import health as rollback_policy
from service.scheduling.dispatch import Dispatcher, Settled, Stop, resume_point
from service.scheduling.failure import AttemptFailure, FailureAction, FailurePolicy, Replan
from service.scheduling.job_states import running_reason, stage_change, transition
from service.scheduling.usage import row_gpu_seconds
from service.schemas.requests import JobSpec
from service.store.job_storage import JobStorage
from service.store.log_lines import store_logs
from service.store.metric_rows import store_metrics
from service.store.tables import Job
from service.telemetry import Telemetry
from workers.config import HealthConfig
from workers.records import AttemptPoll, AttemptStatus, Divergence, RankError

if TYPE_CHECKING:
    from service.scheduling.ray_launcher import RayLauncher

log = logging.getLogger(__name__)

_ALL_STEPS = 2**62
_UNDER_WAY = (AttemptStatus.RUNNING, AttemptStatus.SUCCEEDED, AttemptStatus.STOPPED)
"""The statuses that say an attempt's ranks all started."""


class Outcomes:
    """A job's writes for the scheduler's tick, in the job's own transaction."""

    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        launcher: RayLauncher,
        storage: JobStorage,
        total_gpus: Callable[[], int],
        telemetry: Telemetry,
    ) -> None:
        self.dispatcher = dispatcher
        self.stops = dispatcher.stops
        self.launcher = launcher
        self.storage = storage
        self.total_gpus = total_gpus
        self.telemetry = telemetry
        self.log_max_bytes = launcher.settings.log_max_bytes

    def ingest(self, session: Session, job: Job, state: AttemptPoll) -> int:
        """Store a poll's metric rows and log lines; the number of rows."""
        num_lines = store_logs(session, job, list(state.logs), dropped=state.log_dropped, max_bytes=self.log_max_bytes)
        num_rows = store_metrics(session, job, list(state.metrics))
        trained = sum(row_gpu_seconds(row, job) for row in state.metrics)
        self.telemetry.ingested_on_commit(
            session,
            num_rows=num_rows,
            num_lines=num_lines,
            owner=job.owner,
            priority_class=job.priority,
            training_gpu_s=trained,
        )
        return num_rows

    def progress(
        self, session: Session, job: Job, state: AttemptPoll, *, replan: Replan | None = None
    ) -> Settled | None:
        """A poll's rows and lines stored, the move to running, and the end its status says, if any
        (an out-of-memory failure's `replan` from the scheduler's Replanner)."""
        before = job.step
        self.ingest(session, job, state)
        stored_through = None
        if job.step is not None and job.step != before:
            every = JobSpec.model_validate(job.spec).checkpoint_every
            if every and (before is None or (job.step + 1) // every > (before + 1) // every):
                stored_through = job.step  # a checkpoint interval's rows stored: once an interval
        status = state.status
        if job.status in ("starting", "restarting") and status in _UNDER_WAY:
            transition(session, job, "running", running_reason(job, nodes=len(set(state.nodes))))
        if status == AttemptStatus.STOPPED:  # as asked: no retry spent
            stop = self.stops.pop(job.id, job.attempt)
            return self.carry_out(session, job, stop=stop, cause="GPUs free and no job queued")
        if status == AttemptStatus.SUCCEEDED:
            return self.end(
                session, job, "succeeded", f"all {job.world_size or job.num_gpus} ranks finished step {job.steps - 1}"
            )
        if status in (AttemptStatus.FAILED, AttemptStatus.LOST):
            return self._on_failure(session, job, state.error, replan=replan)
        return Settled(stored_through=stored_through)

    def end(
        self,
        session: Session,
        job: Job,
        status: str,
        reason: str,
        *,
        error: RankError | None = None,
        state: AttemptPoll | None = None,
    ) -> Settled | None:
        """A terminal transition, after storing what a last poll (`state`) brought; None if the job
        changed status under us (nothing to do after)."""
        if state is not None:
            self.ingest(session, job, state)
        if error is not None:
            job.error = error.to_json()
        if not transition(session, job, status, reason):
            return None
        return Settled(stored_through=_ALL_STEPS, ended=True)  # never relaunched: no saved row is needed

    def carry_out(
        self, session: Session, job: Job, *, stop: Stop | None = None, cause: str, how: str | None = None
    ) -> Settled | None:
        """The attempt is over: as `stop` asked (queued, smaller, suspended), else relaunched for `cause`."""
        tail = f"; {cause}" if stop is not None and how is not None else ""  # killed, or lost to a restart
        if job.stop_early:  # its sweep's early stopping ended it: final, whatever else was asked
            return self.end(session, job, "stopped_early", f"{job.stop_early}{tail}")
        if job.suspend_requested or (stop is not None and stop.kind == "suspend"):  # a suspend wins
            self.telemetry.preempted(how or "suspended")
            return self._wait_again(session, job, "suspended", cause="suspended by request", tail=tail)
        if stop is None or stop.preempt is None:
            return self._record_relaunch(session, job, cause=cause, grown=how is None)
        self.telemetry.preempted(how or ("shrunk" if stop.preempt.to_n else "checkpointed"))
        if stop.preempt.to_n:
            return self._record_relaunch(session, job, cause=stop.cause() + tail, size=stop.preempt.to_n, grown=True)
        return self._wait_again(session, job, "queued", cause=stop.cause(), tail=tail)

    def _on_failure(
        self, session: Session, job: Job, error: RankError | None, *, replan: Replan | None = None
    ) -> Settled | None:
        """Carry out the failure policy's decision (service/scheduling/failure.py): retry from the
        last checkpoint at the N it names (at an out-of-memory replan's configuration: its spec and
        plan the job's from now on), back to the queue past the owner's quota, or fail. A diverged run
        of a job with max_rollbacks is the rollback policy's instead (_roll_back)."""
        if error is not None and error.divergence is not None:
            health = JobSpec.model_validate(job.spec).health.to_spec()
            if health.max_rollbacks:
                return self._roll_back(session, job, error, divergence=error.divergence, health=health)
        policy = FailurePolicy(max_retries=JobSpec.model_validate(job.spec).max_retries)
        failure = AttemptFailure(
            error=error, num_retries=job.num_retries, relaunch_size=self._relaunch_size(session, job), replan=replan
        )
        decision = policy.make_decision(failure)
        if decision.action == FailureAction.FAIL:
            return self.end(session, job, "failed", f"{decision.reason}{decision.tail}", error=error)
        if decision.replan is not None:  # a smaller micro-batch (or more checkpointing, a later stage): same N
            job.spec = decision.replan.spec.model_dump(mode="json")
            job.plan = decision.replan.plan.model_dump(mode="json")
        job.num_retries = decision.num_retries
        if decision.action == FailureAction.REQUEUE:  # its owner's quota no longer holds its fewest GPUs
            return self._wait_again(session, job, "queued", cause=decision.reason)
        return self._record_relaunch(session, job, cause=decision.reason, tail=decision.tail, size=decision.size)

    def _roll_back(
        self, session: Session, job: Job, error: RankError, *, divergence: Divergence, health: HealthConfig
    ) -> Settled | None:
        """Carry out the rollback policy's decision (service/scheduling/health.py): relaunch from the
        newest complete checkpoint before the event, its later ones deleted, past the batches that led
        to it; no retry spent. Past max_rollbacks the job fails."""
        decision = rollback_policy.decide(
            divergence,
            health=health,
            num_rollbacks=len(job.rollbacks or []),
            checkpoint_step=self.storage.checkpoint_before(job, step=divergence.step),
        )
        if decision.rollback is None:
            return self.end(session, job, "failed", decision.reason, error=error)
        self.storage.discard_checkpoints_from(job, step=divergence.step)
        job.rollbacks = [*(job.rollbacks or []), decision.rollback.to_json()]
        return self._record_relaunch(session, job, cause=decision.reason)

    def _relaunch_size(self, session: Session, job: Job, *, grown: bool = False) -> int | None:
        """The N the job's next attempt runs at (elastic.relaunch_size); None past its owner's quota."""
        # a growth was decided on free GPUs; Ray's view may not yet show the stopped attempt's as free
        ray_free = (lambda: None) if grown else (lambda: self.launcher.gpus_free_to(job.id, job.attempt))
        quota = self.launcher.settings.gpu_quota
        return elastic.relaunch_size(session, job, total=self.total_gpus(), ray_free=ray_free, quota=quota)

    def _record_relaunch(
        self, session: Session, job: Job, *, cause: str, tail: str = "", grown: bool = False, size: int | None = None
    ) -> Settled | None:
        """A new attempt from the latest complete checkpoint (at N = `size`, else as
        elastic.relaunch_size decides); rows past it are superseded. The launch itself comes
        after the commit: a service that stops in between relaunches it."""
        resume, where = resume_point(session, job, storage=self.storage)
        old = job.world_size or job.num_gpus
        new = size or self._relaunch_size(session, job, grown=grown)
        if new is None:  # its owner's quota no longer holds its fewest GPUs: the queue's policy decides
            return self._wait_again(session, job, "queued", cause=f"{cause}; past its owner's GPU quota")
        if new != old:
            cause = f"resized {old} -> {new}{stage_change(job, old, new)}: {cause}"
        if job.status != "restarting" and not transition(
            session, job, "restarting", f"{cause}: attempt {job.attempt + 1} resumes from {where}{tail}", gpus=new
        ):
            return None
        job.attempt += 1
        job.world_size = new
        job.stop = None
        self.dispatcher.started(job.id)
        log.info("job %s: %s; attempt %s resumes from %s", job.id, cause, job.attempt, where)
        return Settled(stored_through=resume - 1, relaunch=True)

    def _wait_again(self, session: Session, job: Job, status: str, *, cause: str, tail: str = "") -> Settled | None:
        """The attempt is over and the job waits, holding no GPU: back in the queue (preempted:
        its place is its priority and submission; no retry spent) or suspended. Its next attempt
        resumes from its latest complete checkpoint."""
        resume, where = resume_point(session, job, storage=self.storage)
        at = f"checkpoint at step {resume - 1}" if resume else "no checkpoint yet: it starts again from step 0"
        if not transition(session, job, status, f"{cause}: {at}{tail}"):
            return None
        job.attempt += 1
        job.borrowed = job.backfilled = job.suspend_requested = False
        job.stop = None
        log.info("job %s: %s; attempt %s will resume from %s", job.id, cause, job.attempt, where)
        return Settled(stored_through=resume - 1, release=True)
