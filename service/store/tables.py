"""The database: jobs, their state transitions, their per-step metrics, logs and artifacts, and who uploaded
which code, and the uid each unmapped owner runs under.

The schema changes only through Alembic migrations (migrations/); a test
checks that these models and the migrations agree.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

# SQLite wants INTEGER for its auto-incrementing rowid keys; elsewhere 64 bits.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_run_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """DateTime(timezone=True) that stores UTC and always reads back an aware UTC datetime.

    SQLite has no time zones: SQLAlchemy writes the wall-clock fields and drops the
    offset, and reads back naive values. Converting to UTC first keeps the instant.
    """

    impl = DateTime
    cache_ok = True

    def __init__(self) -> None:
        super().__init__(timezone=True)

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()}: give a timezone-aware one")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: UTCDateTime()}


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_queue", "status", "priority", "id"),)  # the queue, in its order

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]]
    plan: Mapped[dict[str, Any]]
    num_gpus: Mapped[int] = mapped_column(Integer)
    """The most GPUs it runs on (all of them unless elastic)."""
    min_gpus: Mapped[int | None] = mapped_column(Integer, default=None)
    """An elastic job's fewest; null: num_gpus (also for jobs stored before elastic jobs)."""
    world_size: Mapped[int | None] = mapped_column(Integer, default=None)
    """The N its current attempt runs at; null before its first start."""
    steps: Mapped[int] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(Integer, default=None)
    """Last step with a stored metrics row."""
    latest: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    """That row, kept here so that listing jobs reads one table."""
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    """0 for the first launch, +1 for every relaunch (a retry, or a recovery after a restart)."""
    num_retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Relaunches after a worker failure; bounded by the spec's max_retries."""
    rollbacks: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    """Its rollbacks after a divergence, oldest first (service.scheduling.health.Rollback, as JSON): none
    a retry; bounded by the spec's health.max_rollbacks. Null: none."""
    error: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    suspend_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Suspend asked while it ran: the scheduler stops it at a step boundary, with a checkpoint."""
    stop_early: Mapped[str | None] = mapped_column(Text, default=None)
    """Why a sweep's early stopping ends it (the rung, its metric, the cutoff): the scheduler stops it at
    a step boundary, with a checkpoint, and it ends stopped_early."""
    priority: Mapped[int] = mapped_column(Integer, default=50, server_default="50")
    """0-100: the queue is ordered by it (highest first), then by id; a job may preempt lower ones."""
    borrowed: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Its attempt runs past its owner's GPU quota on idle GPUs: the first to be preempted."""
    backfilled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Its attempt started ahead of a waiting job of its priority or higher (backfill): that job may preempt it."""
    owner: Mapped[str | None] = mapped_column(String(200), default=None)
    run_id: Mapped[str | None] = mapped_column(String(32), default=new_run_id)
    """Random, never repeated: names the job's checkpoint directory (job ids repeat after a
    database restore). Null for jobs stored before it existed (their directory is job-<id>)."""
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True, default=None)
    request_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    log_state: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    """What its logs hold (service.store.log_lines): the bytes kept, the lines dropped past
    ZERO1_LOG_MAX_BYTES, and per rank the n of the last line of this attempt stored."""
    stop: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    """The stop the scheduler asked of its current attempt (service.scheduling.dispatch.Stop: a
    preemption or a suspend) until it is done: a restart meanwhile carries it out, never relaunches."""
    artifacts_recorded_at: Mapped[datetime | None] = mapped_column(default=None)
    """When the service read its final/ directory and recorded its artifacts (service.store.artifacts);
    null before, and for jobs that succeeded before artifacts were recorded (read on first listing)."""
    notes: Mapped[str | None] = mapped_column(Text, default=None)
    """Its owner's free text (set at submit, or by PATCH /v1/jobs/{id}); null: none."""
    tag_rows: Mapped[list[JobTag]] = relationship(order_by="JobTag.tag", cascade="all, delete-orphan")
    needs_rows: Mapped[list[JobDependency]] = relationship(
        foreign_keys="JobDependency.job_id", order_by="JobDependency.needs_id", cascade="all, delete-orphan"
    )

    @property
    def depends_on(self) -> list[int]:
        """The jobs that must succeed before it starts, by id."""
        return [row.needs_id for row in self.needs_rows]

    @property
    def tags(self) -> list[str]:
        """Its tags, in alphabetical order."""
        return [row.tag for row in self.tag_rows]


class JobDependency(Base):
    """Job `job_id` starts only once job `needs_id` has succeeded (and is cancelled if it fails or is
    cancelled): a job's depends_on, one row each."""

    __tablename__ = "job_dependencies"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    needs_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True, index=True)


class JobTag(Base):
    """One tag of a job: a job's tags are a set (PATCH /v1/jobs/{id} replaces it); the jobs of a tag are
    found by its index (GET /v1/jobs?tag=)."""

    __tablename__ = "job_tags"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)


class JobEvent(Base):
    """One state transition of a job, with its reason."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    gpus: Mapped[int | None] = mapped_column(Integer, default=None)
    """The GPUs the job holds from this event until its next (service.scheduling.usage): its attempt's N in
    starting, running and restarting, 0 in any other status; null for events stored before it was kept
    (read as the job's world_size, else num_gpus, in an active status)."""


class Metric(Base):
    """One training step of one attempt: the global values and every rank's memory."""

    __tablename__ = "metrics"
    __table_args__ = (
        Index("ix_metrics_job_attempt_step", "job_id", "attempt", "step", unique=True),
        Index("ix_metrics_job_step", "job_id", "step"),  # a job's curve, in step order
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    """Null when not finite (a diverged step); so is grad_norm (an fp16 overflow)."""
    grad_norm: Mapped[float | None] = mapped_column(Float)
    loss_scale: Mapped[float] = mapped_column(Float)
    skipped: Mapped[bool] = mapped_column(Boolean)
    step_time_s: Mapped[float] = mapped_column(Float)
    tokens_per_s: Mapped[float] = mapped_column(Float)
    mem_peak_bytes: Mapped[list[int]] = mapped_column(JSON)
    """Measured peak bytes of each rank, by rank."""
    mem_planned_bytes: Mapped[int] = mapped_column(BigInteger)
    eval_loss: Mapped[float | None] = mapped_column(Float)
    """The held-out loss on a step that evaluated; null on the others (and when not finite)."""
    world_size: Mapped[int | None] = mapped_column(Integer, default=None)
    """The N the step ran at (an elastic job's changes); null for rows stored before it was kept."""
    checkpoint_blocked_s: Mapped[float | None] = mapped_column(Float)
    """Seconds the step's checkpoint held training up; null on a step without one (and when not finite)."""
    lr: Mapped[float | None] = mapped_column(Float)
    """The learning rate the step used; null for rows stored before it was kept."""
    superseded: Mapped[bool] = mapped_column(Boolean, default=False)
    """True for rows of an attempt past the checkpoint a retry resumed from."""
    stored_at: Mapped[datetime | None] = mapped_column(default=None)
    """When the service stored the row (within a poll of its step's end; later for rows recovered from a
    checkpoint): the time GET /v1/usage counts its training at. Null for rows stored before it was kept."""


class LogLine(Base):
    """One line a rank wrote (stdout, stderr or logging), or the marker that says how many older
    lines were dropped. `id` is its place in the job's log, in the order the lines were stored."""

    __tablename__ = "logs"
    __table_args__ = (
        Index("ix_logs_job_id", "job_id", "id"),  # a job's log, in order
        Index("ix_logs_job_rank_id", "job_id", "rank", "id"),  # one rank's
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int | None] = mapped_column(Integer)
    """Null for the marker line."""
    rank: Mapped[int | None] = mapped_column(Integer)
    """Null for the marker line."""
    time: Mapped[datetime] = mapped_column(default=utcnow)
    """When the rank wrote it."""
    stream: Mapped[str] = mapped_column(String(8))
    """stdout, stderr, log (Python logging) or marker."""
    line: Mapped[str] = mapped_column(Text)


class CodeBundle(Base):
    """One uploader's record of a code bundle: the same bytes uploaded by two users are one stored zip
    (named by its digest) and two rows."""

    __tablename__ = "code_bundles"
    # unique per uploader; its first column is also the index that finds a digest's rows
    __table_args__ = (Index("ix_code_bundles_digest_uploader", "digest", "uploader", unique=True),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(String(71))
    """"sha256:<64 hex>" of the zip as uploaded."""
    uploader: Mapped[str | None] = mapped_column(String(200), default=None)
    """The token's user; null for an upload while auth was off."""
    bytes: Mapped[int] = mapped_column(BigInteger)
    files: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Artifact(Base):
    """One file of a succeeded job's final model, as the service read it when the job succeeded: only
    these names are served, and only while the file still has these bytes."""

    __tablename__ = "artifacts"
    __table_args__ = (Index("ix_artifacts_job_name", "job_id", "name", unique=True),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    """A plain file name in the job's final/ directory."""
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    """Hex digest the service computed of the file's bytes (and checked against the manifest's)."""


class MlflowRun(Base):
    """A job's MLflow run and how far the service has exported it (service.tracking): the cursor a
    restart resumes from, so no point is sent twice and none is skipped."""

    __tablename__ = "mlflow_runs"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    experiment_id: Mapped[str | None] = mapped_column(String(64), default=None)
    run_id: Mapped[str | None] = mapped_column(String(64), default=None)
    """MLflow's id of the job's run; null until the run is created."""
    step: Mapped[int | None] = mapped_column(Integer, default=None)
    """The last step whose row is exported; null before the first."""
    batch_time_ms: Mapped[int | None] = mapped_column(BigInteger, default=None)
    """The timestamp of the batch in flight, kept until MLflow took it: a batch sent again after a
    crash is the same points, which a SQL-backed tracking server stores once."""
    status: Mapped[str | None] = mapped_column(String(16), default=None)
    """The job status last set as the run's zero1.status tag."""
    artifacts_done: Mapped[bool] = mapped_column(Boolean, default=False)
    done: Mapped[bool] = mapped_column(Boolean, default=False)
    """The run is terminated with the job's final status: nothing more to export."""
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    """Why the last try failed (MLflow unreachable, a refused request); null after a success."""


class OwnerUid(Base):
    """The uid an owner that ZERO1_RUN_AS does not name runs its children under, taken once from the
    `*=LO-HI` range and kept: the same owner gets the same uid after a restart (its files stay its own),
    and no two owners share one (the unique constraint is what makes concurrent allocations safe)."""

    __tablename__ = "owner_uids"
    __table_args__ = (UniqueConstraint("uid", name="uq_owner_uids_uid"),)

    owner: Mapped[str] = mapped_column(String(200), primary_key=True)
    uid: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookCursor(Base):
    """How far the service has sent the job events, or the sweep events, to a webhook
    (service.tracking.webhooks): the last event delivered, by the URL's digest (the sweep events' by
    that of "sweeps <url>"), so a restart sends none twice and skips none."""

    __tablename__ = "webhook_cursors"

    url_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    event_id: Mapped[int] = mapped_column(BigInteger)
    """The last event handled (delivered, or refused with a 4xx); the next sent is the first after it."""


class Sweep(Base):
    """A search: a base job spec and a space over its fields, run as one job per trial (SweepTrial),
    at most max_concurrent at once, by the scheduler (service.experiments.sweeps)."""

    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str | None] = mapped_column(String(200), default=None)
    status: Mapped[str] = mapped_column(String(16), index=True)
    """running (or suspended), then succeeded (a trial succeeded), failed (none did) or cancelled."""
    spec: Mapped[dict[str, Any]]
    """The request as validated (service.schemas.sweeps.SweepSpec)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class SweepEvent(Base):
    """A sweep's end (succeeded, failed, cancelled), with its reason: what the webhook sends of sweeps, in
    this order (service.tracking.webhooks), as JobEvent is of jobs."""

    __tablename__ = "sweep_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    to_status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)


class SweepTrial(Base):
    """One trial of a sweep: its values, and its job once submitted (null while it waits its turn, and
    for a trial skipped as unfit)."""

    __tablename__ = "sweep_trials"

    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    values: Mapped[dict[str, Any]]
    """Each searched field's path -> its value in this trial."""
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), default=None, index=True)
    plan: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    """The plan it was admitted by when the sweep was planned, its job's; null for a skipped trial."""
    skipped: Mapped[str | None] = mapped_column(Text, default=None)
    """Why the trial does not run (its plan does not fit, with skip_unfit; the sweep was cancelled first)."""
    rungs: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    """Early stopping's record: each rung (a step count, as text) its job reached -> its metric there."""


class MlflowSweepRun(Base):
    """A sweep's parent MLflow run, its trials' runs nested under it (service.tracking.sweep_runs): made
    when the first trial's run is, found again by its tag after a crash between making and recording it,
    and ended once the sweep and every trial's run have."""

    __tablename__ = "mlflow_sweep_runs"

    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True)
    experiment_id: Mapped[str | None] = mapped_column(String(64), default=None)
    run_id: Mapped[str | None] = mapped_column(String(64), default=None)
    """MLflow's id of the sweep's parent run; null until the run is created."""
    done: Mapped[bool] = mapped_column(Boolean, default=False)
    """The run is ended with the sweep's status and its best trial: nothing more to export."""
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    """Why the last try failed (a refused request); null after a success."""
