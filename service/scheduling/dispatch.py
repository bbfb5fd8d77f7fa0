"""Between the database and the queue's policy (service/scheduling/queue_policy.py): the decision on the
snapshot a tick reads (service/scheduling/snapshot.py) carried out, a start committed, and the stops
the scheduler has asked for and waits on.

A stop is a preemption (the victim goes back to the queue, or shrinks) or a suspend: the victim's
ranks agree on a stop at their next step boundary, write a checkpoint at that step and exit (the
supervisor's status "stopped"); one that has not within ZERO1_PREEMPT_GRACE_S is killed, and
resumes from its last checkpoint. A stop asked is stored with its job (Job.stop) until it is done, so
that a restart meanwhile carries it out: a victim back to the queue, never relaunched at its full N.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.scheduling import dependencies, estimates
from service.scheduling.elastic import growable
from service.scheduling.job_states import transition
from service.scheduling.queue_policy import Decision, Holding, Preempt, Start, Waiting, decide, decide_fifo
from service.scheduling.snapshot import holding, waiting, with_loss_facts
from service.schemas.fields import ACTIVE
from service.store.db import Database
from service.store.job_repository import job_world_sizes, stored_step
from service.store.job_storage import JobStorage
from service.store.metric_rows import store_metrics, supersede_after
from service.store.tables import Job
from service.telemetry import Telemetry

if TYPE_CHECKING:
    from service.scheduling.ray_launcher import RayLauncher

log = logging.getLogger(__name__)


def commit_start(session: Session, start: Start, *, sizes_note: bool = True) -> Job | None:
    """The start of a queued job at `start.n` GPUs recorded (a compare-and-set from queued); the
    job, or None if it is no longer queued (cancelled or suspended since the snapshot)."""
    job = session.get(Job, start.job_id)
    if job is None or job.status != "queued":
        return None
    sizes = job_world_sizes(job)
    note = f" (elastic: it runs at N in {sizes})" if sizes_note and len(sizes) > 1 else ""
    how = " as borrowed (past its owner's GPU quota, on idle GPUs)" if start.borrowed else ""
    if start.backfilled:
        how += " (backfilled: a job ahead of it waits for more GPUs and may take these back)"
    if not transition(
        session, job, "starting", f"{start.n} GPUs free: placing {start.n} ranks{note}{how}", gpus=start.n
    ):
        return None
    job.world_size = start.n
    job.borrowed = start.borrowed
    job.backfilled = start.backfilled
    return job


def _decide(queue: Iterable[Waiting], held: list[Holding], in_flight: dict[int, Preempt], **rules: object) -> Decision:
    return decide(queue, held, in_flight=in_flight, **rules)


@dataclass(frozen=True, slots=True)
class Settled:
    """What a job's transaction decided, for the Ray and file work done after it commits."""

    stored_through: int | None = None
    """Rows through this step are stored once committed: their pruned checkpoints may go."""
    ended: bool = False
    """The job reached a terminal state: release its supervisor, retire its checkpoints."""
    relaunch: bool = False
    """A new attempt was recorded: release the old supervisor, launch the new one."""
    release: bool = False
    """The attempt ended and the job waits (queued or suspended): release its supervisor."""


def resume_point(session: Session, job: Job, *, storage: JobStorage) -> tuple[int, str]:
    """The step the job's next attempt starts at (after its latest complete checkpoint) and where
    that is, in words; the rows up to it stored, those past it superseded."""
    resume = storage.resume_step(job)
    # rows up to the checkpoint that never reached the database (Ray stopped with the service)
    # were saved with the checkpoint: store them, or the surviving curve would have a gap
    saved = storage.checkpointed_metrics(job, after_step=stored_step(job))
    store_metrics(session, job, [row for row in saved if row.step < resume])
    supersede_after(session, job, resume_step=resume)
    return resume, (f"checkpoint step {resume - 1}" if resume else "the start (no checkpoint yet)")


@dataclass(frozen=True, slots=True)
class Reasons:
    """Why the queued jobs wait, as of the scheduler's last admission."""

    by_job: dict[int, str] = field(default_factory=dict)
    """Those the policy looked at."""
    behind: str | None = None
    """The rest: behind the first that cannot start."""

    def of(self, job_id: int) -> str:
        return self.by_job.get(job_id) or self.behind or "waiting for the scheduler's next tick"


StopKind = Literal["preempt", "suspend", "stop_early"]


@dataclass(frozen=True, slots=True)
class Stop:
    """A stop the scheduler asked of one attempt, and waits on."""

    kind: StopKind
    attempt: int
    asked_at: float
    """clock() when it was asked."""
    preempt: Preempt | None = None
    """What a preemption takes (None for a suspend)."""

    def to_json(self) -> dict:
        """As Job.stop stores it (asked_at, a clock() reading, dies with the process)."""
        return {
            "kind": self.kind,
            "attempt": self.attempt,
            "preempt": None if self.preempt is None else asdict(self.preempt),
        }

    @classmethod
    def of_json(cls, stored: dict, *, asked_at: float) -> Stop:
        """A stop stored before a restart, its grace counted again from `asked_at`."""
        preempt = None if stored.get("preempt") is None else Preempt(**stored["preempt"])
        return cls(kind=stored["kind"], attempt=stored["attempt"], asked_at=asked_at, preempt=preempt)

    def cause(self) -> str:
        if self.kind == "stop_early":
            return "stopped early by its sweep"
        if self.preempt is None:
            return "suspended by request"
        return f"preempted by job {self.preempt.by} (priority {self.preempt.by_priority})"


class Stops:
    """The stops asked and not yet done, by job id."""

    def __init__(self) -> None:
        self._stops: dict[int, Stop] = {}

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._stops

    def ask(self, job_id: int, stop: Stop) -> None:
        self._stops[job_id] = stop

    def load(self, jobs: Iterable[Job], *, now: float) -> None:
        """The stops stored with `jobs` (after a restart) for their current attempts, asked at `now`."""
        for job in jobs:
            if job.stop is not None and job.stop.get("attempt") == job.attempt:
                self._stops[job.id] = Stop.of_json(job.stop, asked_at=now)

    def pop(self, job_id: int, attempt: int) -> Stop | None:
        """The stop asked of this attempt, forgotten; None if none was."""
        stop = self._stops.get(job_id)
        if stop is None or stop.attempt != attempt:
            return None
        return self._stops.pop(job_id)

    def keep(self, attempts: set[tuple[int, int]]) -> None:
        """Forget the stops of attempts no longer active (ended, or moved on)."""
        self._stops = {k: s for k, s in self._stops.items() if (k, s.attempt) in attempts}

    def preemptions(self) -> dict[int, Preempt]:
        """Victim id -> the preemption in flight (for the policy: GPUs that are coming)."""
        # a copy first: the API's estimates read it from a thread of their own while the tick asks stops
        return {k: s.preempt for k, s in list(self._stops.items()) if s.preempt is not None}

    def pop_overdue(self, job_id: int, attempt: int, *, now: float, grace_s: float) -> Stop | None:
        """The stop asked of this attempt more than `grace_s` ago, forgotten; None if there is none."""
        stop = self._stops.get(job_id)
        if stop is None or stop.attempt != attempt or now - stop.asked_at <= grace_s:
            return None
        return self._stops.pop(job_id)


class Dispatcher:
    """The queue's side of a tick: starts and stops decided by the policy, and growth."""

    def __init__(
        self,
        *,
        db: Database,
        launcher: RayLauncher,
        total_gpus: Callable[[], int],
        clock: Callable[[], float],
        telemetry: Telemetry,
        grow_interval_s: float,
    ) -> None:
        self.db = db
        self.launcher = launcher
        self.total_gpus = total_gpus
        self.clock = clock
        self.telemetry = telemetry
        self.grow_interval_s = grow_interval_s
        self.stops = Stops()
        self.reasons = Reasons()
        self._started_at: dict[int, float] = {}  # job -> clock() of its attempt's start or last resize
        self._growing: set[tuple[int, int]] = set()  # (job, attempt) asked to stop at a checkpoint to grow

    def started(self, job_id: int) -> None:
        """The job's attempt started (or resized) now: its age, for growth and preemption, counts from here."""
        self._started_at[job_id] = self.clock()

    def age_s(self, job_id: int) -> float:
        """Seconds since the job's attempt started or resized (since this process first saw it, after a restart)."""
        now = self.clock()
        return now - self._started_at.setdefault(job_id, now)

    def keep(self, attempts: set[tuple[int, int]]) -> None:
        """Forget what concerns attempts no longer active."""
        self._growing &= attempts
        self.stops.keep(attempts)

    def admit(self, *, launch: Callable[[Job], None]) -> None:
        """Start what the queue's policy starts, each start committed (a compare-and-set from
        queued) before `launch` asks Ray for it; ask the stops it decides."""
        settings = self.launcher.settings
        fifo = settings.queue_policy == "fifo"
        with self.db.session() as session:
            for job_id in dependencies.cancel_unreachable(session):
                log.info("job %s: cancelled, a job it depends on failed or was cancelled", job_id)
        policy = self.policy()
        with self.db.session() as session:
            held = holding(session, age_s=self.age_s)
            decision = policy(waiting(session, fifo=fifo), held, self.stops.preemptions())
            if decision.preempts and settings.preempt_victims == "least_loss":  # chosen again, knowing their losses
                decision = policy(waiting(session, fifo=fifo), with_loss_facts(session, held), self.stops.preemptions())
        for start in decision.starts:
            with self.db.session() as session:
                job = commit_start(session, start)
            if job is not None:  # else cancelled or suspended since it was read
                self.telemetry.queue_waited((job.started_at - job.created_at).total_seconds())
                self.started(job.id)
                launch(job)
        with self.db.session() as session:  # as the starts left them
            unmet = dependencies.waiting_reasons(session)
        self.reasons = Reasons({**decision.reasons, **unmet}, decision.behind)
        if decision.preempts:
            with self.db.session() as session:
                victims = {job.id: job for job in session.scalars(select(Job).where(Job.status == "running"))}
            now = self.clock()
            for preempt in decision.preempts:
                if (victim := victims.get(preempt.victim)) is not None:
                    self.ask_stop(victim, Stop(kind="preempt", attempt=victim.attempt, asked_at=now, preempt=preempt))

    def policy(self) -> estimates.Policy:
        """The queue's policy as the settings configure it: (queue, holding, preemptions in flight) -> Decision."""
        settings = self.launcher.settings
        if settings.queue_policy == "fifo":
            return lambda queue, held, in_flight: decide_fifo(queue, held, total=self.total_gpus())
        return partial(
            _decide,
            total=self.total_gpus(),
            quota=settings.gpu_quota,
            borrowing=settings.quota_borrowing,
            min_runtime_s=settings.preempt_min_runtime_s,
            victims=settings.preempt_victims,
            grace_s=settings.preempt_grace_s,
        )

    def estimate_starts(self, session: Session, *, limit: int) -> dict[int, float | None]:
        """Seconds from now until each of the first `limit` queued jobs starts, as the policy replayed on
        the snapshot estimates it (service/scheduling/estimates.py); None where unknown. Jobs waiting on
        dependencies are not in the queue the policy reads: they have none."""
        settings = self.launcher.settings
        fifo = settings.queue_policy == "fifo"
        held = with_loss_facts(session, holding(session, age_s=self.age_s))
        queue = list(islice(waiting(session, fifo=fifo, paced=True), limit))
        return estimates.starts(
            queue,
            held,
            policy=self.policy(),
            in_flight=self.stops.preemptions(),
            min_runtime_s=0.0 if fifo else settings.preempt_min_runtime_s,
            order=(lambda w: (w.id,)) if fifo else (lambda w: (-w.priority, w.id)),
        )

    def ask_stop(self, job: Job, stop: Stop) -> None:
        """Ask the attempt's ranks to stop at their next step with a checkpoint; remembered (and
        stored with the job, for a restart) once the supervisor took it, else asked again next tick."""
        if self.launcher.request_stop(job.id, job.attempt, now=True):
            with self.db.session() as session:  # that attempt's only: one that moved on is not stopped
                stored = update(Job).where(Job.id == job.id, Job.attempt == job.attempt, Job.status.in_(ACTIVE))
                session.execute(stored.values(stop=stop.to_json()), execution_options={"synchronize_session": False})
            self.stops.ask(job.id, stop)
            log.info("job %s: asked to stop at its next step (%s)", job.id, stop.cause())

    def grow(self) -> None:
        """Ask each running elastic job that may grow (elastic.growable) to stop at its next
        checkpoint; it stops ("stopped") and is relaunched at the larger N."""
        with self.db.session() as session:
            candidates = growable(session, total=self.total_gpus(), quota=self.launcher.settings.gpu_quota)
        for job, target in candidates:
            if (job.id, job.attempt) in self._growing or job.id in self.stops:
                continue
            if self.age_s(job.id) < self.grow_interval_s:
                continue
            if self.launcher.request_stop(job.id, job.attempt):
                log.info("job %s: growing %s -> %s at its next checkpoint", job.id, job.world_size, target)
                self._growing.add((job.id, job.attempt))
