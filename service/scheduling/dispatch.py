"""Between the database and the queue's policy (service/scheduling/queue_policy.py): the snapshot a tick
decides on, a start committed, and the stops the scheduler has asked for and waits on.

A stop is a preemption (the victim goes back to the queue, or shrinks) or a suspend: the victim's
ranks agree on a stop at their next step boundary, write a checkpoint at that step and exit (the
supervisor's status "stopped"); one that has not within ZERO1_PREEMPT_GRACE_S is killed, and
resumes from its last checkpoint. A stop asked is stored with its job (Job.stop) until it is done, so
that a restart meanwhile carries it out: a victim back to the queue, never relaunched at its full N.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Literal

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from service.scheduling import dependencies, estimates
from service.scheduling.elastic import growable
from service.scheduling.job_states import transition
from service.scheduling.queue_policy import Decision, Holding, Preempt, Start, Waiting, decide, decide_fifo
from service.schemas.fields import ACTIVE
from service.schemas.requests import world_sizes
from service.store.db import Database
from service.store.job_repository import job_world_sizes, queue_order, stored_step
from service.store.job_storage import JobStorage
from service.store.metric_rows import store_metrics, supersede_after
from service.store.tables import Job, JobEvent, Metric
from service.telemetry import Telemetry

if TYPE_CHECKING:
    from service.scheduling.ray_launcher import RayLauncher

log = logging.getLogger(__name__)

_QUEUE_BATCH = 256
"""Queued jobs read at a time: a tick reads the queue only as far as its policy looks."""


def waiting(session: Session, *, fifo: bool = False, paced: bool = False) -> Iterator[Waiting]:
    """The queued jobs in the queue's order (submission order for `fifo`), read lazily; those whose
    dependencies have not all succeeded left out. `paced`: with the steps each has left and its step's
    GPU-seconds (for estimates; a tick's policy needs neither)."""
    # the numbers of the spec and the latest row needed, read by the database: not every row's whole spec decoded
    micro = Job.spec["micro_batch_size"].as_integer()
    batch = Job.spec["global_batch_size"].as_integer()
    columns = [Job.id, Job.priority, Job.owner, Job.num_gpus, Job.min_gpus, micro, batch]
    if paced:
        columns += [Job.steps, Job.step, Job.latest["step_time_s"].as_float(), Job.latest["world_size"].as_integer()]
    queued = select(*columns).where(Job.status == "queued", dependencies.all_succeeded())
    query = queued.order_by(*queue_order(fifo=fifo))
    for job_id, priority, owner, num_gpus, min_gpus, micro, batch, *pace in session.execute(
        query.execution_options(yield_per=_QUEUE_BATCH)
    ):
        if min_gpus is None or min_gpus == num_gpus:
            sizes = [num_gpus]  # not elastic: no arithmetic
        else:
            micro = micro or 1
            sizes = world_sizes(
                min_gpus=min_gpus, num_gpus=num_gpus, micro_batch_size=micro, batch_size=batch or micro * num_gpus
            )
        job = Waiting(id=job_id, priority=priority, owner=owner, sizes=tuple(sizes))
        if pace:
            steps, step, step_time_s, ran_at = pace
            steps_left = steps - (-1 if step is None else step) - 1
            step_gpu_s = _step_gpu_s(step_time_s, ran_at=ran_at, default_n=num_gpus)
            job = replace(job, steps_left=steps_left, step_gpu_s=step_gpu_s)
        yield job


def _step_gpu_s(step_time_s: float | None, *, ran_at: int | None, default_n: int) -> float | None:
    """A step's GPU-seconds from a row's step time and the N it ran at (rows stored before world_size
    was kept: `default_n`)."""
    return None if step_time_s is None else step_time_s * (ran_at or default_n)


def holding(session: Session, *, age_s: Callable[[int], float]) -> list[Holding]:
    """The active jobs, each with its age (`age_s(job id)`: seconds since its attempt started or resized)."""
    jobs = session.scalars(select(Job).where(Job.status.in_(ACTIVE)).order_by(Job.id))
    return [
        Holding(
            id=job.id,
            priority=job.priority,
            owner=job.owner,
            gpus=job.world_size or job.num_gpus,
            sizes=tuple(job_world_sizes(job)),
            running=job.status == "running" and not (job.cancel_requested or job.suspend_requested),
            age_s=age_s(job.id),
            borrowed=job.borrowed,
            backfilled=job.backfilled,
            step=job.step,
            steps=job.steps,
            step_gpu_s=_step_gpu_s(
                (job.latest or {}).get("step_time_s"),
                ran_at=(job.latest or {}).get("world_size"),
                default_n=job.world_size or job.num_gpus,
            ),
            checkpoint_every=job.spec.get("checkpoint_every") or 0,
            ending=bool(job.cancel_requested or job.suspend_requested or job.stop_early),
        )
        for job in jobs
    ]


def with_loss_facts(session: Session, held: list[Holding]) -> list[Holding]:
    """`held` with what a stop of each would lose (queue_policy.stop_loss_gpu_s), from what the database
    stores: its newest checkpoint's step (the last periodic one by its steps, or the one its attempt
    resumed from, the step before its first row), the seconds its last periodic checkpoint held it up
    (that row's checkpoint_blocked_s) and its last start's (its last starting or restarting event to
    the running one after it). Three queries, read only when victims are to be chosen or starts
    estimated."""
    if not held:
        return held
    ids = [h.id for h in held]
    attempt_first = dict(
        session.execute(
            select(Metric.job_id, func.min(Metric.step))
            .join(Job, (Job.id == Metric.job_id) & (Job.attempt == Metric.attempt))
            .where(Metric.job_id.in_(ids))
            .group_by(Metric.job_id)
        ).all()
    )
    periodic = {h.id: _periodic_step(h) for h in held}
    at_steps = [and_(Metric.job_id == i, Metric.step == step) for i, step in periodic.items() if step is not None]
    blocked = {}
    if at_steps:
        rows = session.execute(
            select(Metric.job_id, Metric.checkpoint_blocked_s).where(or_(*at_steps), Metric.superseded.is_(False))
        )
        blocked = {job_id: seconds for job_id, seconds in rows if seconds is not None}
    starts: dict[int, dict[str, datetime]] = defaultdict(dict)
    for job_id, to_status, at in session.execute(
        select(JobEvent.job_id, JobEvent.to_status, func.max(JobEvent.at))
        .where(JobEvent.job_id.in_(ids), JobEvent.to_status.in_(("starting", "restarting", "running")))
        .group_by(JobEvent.job_id, JobEvent.to_status)
    ):
        starts[job_id][to_status] = at
    return [
        replace(
            h,
            checkpoint_step=_newest_checkpoint(h, periodic=periodic[h.id], first=attempt_first.get(h.id)),
            checkpoint_s=blocked.get(h.id, 0.0),
            restart_s=_restart_s(starts.get(h.id, {})),
        )
        for h in held
    ]


def _periodic_step(h: Holding) -> int | None:
    """The last step through `h.step` after which a periodic checkpoint falls (None: none yet)."""
    if not h.checkpoint_every or h.step is None or h.step + 1 < h.checkpoint_every:
        return None
    return (h.step + 1) // h.checkpoint_every * h.checkpoint_every - 1


def _newest_checkpoint(h: Holding, *, periodic: int | None, first: int | None) -> int | None:
    """The later of its last periodic checkpoint and the one its attempt resumed from (the step before
    the attempt's first row; before that row, its last stored step: a resume keeps the rows up to its
    checkpoint)."""
    resumed = first - 1 if first is not None else h.step
    found = [step for step in (periodic, resumed) if step is not None and step >= 0]
    return max(found, default=None)


def _restart_s(events: dict[str, datetime]) -> float:
    """Seconds from its last start (starting or restarting) to the running after it; 0 when unknown."""
    running = events.get("running")
    began = max((events[k] for k in ("starting", "restarting") if k in events), default=None)
    if running is None or began is None or running < began:
        return 0.0
    return (running - began).total_seconds()


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
