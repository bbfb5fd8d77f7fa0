"""Jobs: admission by the memory model, the state machine, and the queries the API makes.

Functions take the request's session and only flush; the caller commits.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from service.auth import Principal
from service.cluster import ClusterCapacity
from service.dataprep import DatasetChecker, DatasetRequest, invalid_data
from service.errors import ServiceError
from service.models import Job, JobEvent, Metric, utcnow
from service.planning import make_plan, model_shape, plan_public, workload_for
from service.responses import ArtifactPublic, EventPublic, JobPublic, MetricPublic, PlanPublic
from service.schemas import DatasetDataSpec, JobSpec, TextDataSpec
from service.tracing import Tracer
from workers import datafiles, memory
from workers.config import ModelKind
from workers.memory import GB
from workers.records import finite_or_none

if TYPE_CHECKING:
    from service.launcher import RayLauncher
    from workers.datasets import DatasetSummary

ACTIVE = ("starting", "running", "restarting")
TERMINAL = ("succeeded", "failed", "cancelled")
_TRANSITIONS = {
    "queued": {"starting", "cancelled"},
    "starting": {"running", "failed", "cancelled", "restarting"},
    "running": {"succeeded", "failed", "cancelled", "restarting"},
    "restarting": {"running", "failed", "cancelled"},
}


def transition(session: Session, job: Job, to_status: str, reason: str) -> bool:
    """Move `job` to `to_status` if it is still in the status this session read, recording the event.

    A compare-and-set: one UPDATE ... WHERE status = <the status read>. The API (cancelling a
    queued job) and the scheduler (starting it) race for the same row; the loser's UPDATE
    matches no row, and it gets False with `job` refreshed to what the winner wrote. Terminal
    states are final."""
    from_status = job.status
    assert to_status in _TRANSITIONS.get(from_status, ()), f"job {job.id}: {from_status} -> {to_status}"
    values: dict = {"status": to_status}
    if to_status == "starting" and job.started_at is None:
        values["started_at"] = utcnow()
    if to_status in TERMINAL:
        values["finished_at"] = utcnow()
    session.flush()  # a job added in this session gets its id and row first
    result = session.execute(
        update(Job).where(Job.id == job.id, Job.status == from_status).values(**values),
        execution_options={"synchronize_session": False},
    )
    if result.rowcount != 1:
        session.refresh(job)
        return False
    for key, value in values.items():
        set_committed_value(job, key, value)
    session.add(JobEvent(job_id=job.id, from_status=from_status, to_status=to_status, reason=reason))
    return True


# --------------------------------------------------------------------------- admission


def admit(spec: JobSpec, *, cluster: ClusterCapacity, overhead_bytes: int, tracer: Tracer | None = None) -> PlanPublic:
    """The plan a job is admitted by (an hf model's traced by `tracer`), or a 422 does_not_fit that
    says what would fit."""
    request = spec.plan_request().model_copy(update={"gpu_memory_gb": cluster.gpu_memory_bytes / GB})
    plan = make_plan(request, cluster=cluster, overhead_bytes=overhead_bytes, tracer=tracer)
    public = plan_public(plan, shape=model_shape(request, tracer=tracer))
    fits = {"cluster": cluster, "request": request, "overhead_bytes": overhead_bytes, "tracer": tracer}
    if spec.num_gpus > cluster.num_gpus:
        raise _does_not_fit(
            public,
            f"num_gpus ({spec.num_gpus}) exceeds the cluster's {cluster.num_gpus} GPUs" + _what_fits(plan, **fits),
        )
    if not plan.fits:
        raise _does_not_fit(
            public,
            f"the per-GPU plan at N = {spec.num_gpus} is {plan.per_gpu.total_bytes / GB:.2f} GB, above "
            f"the {plan.gpu_memory_bytes / GB:.2f} GB of each GPU" + _what_fits(plan, **fits),
        )
    return public


def check_data(spec: JobSpec, *, data_roots: Sequence[str]) -> JobSpec:
    """The spec with a text job's data.path made real (symlinks followed), or a 422 if that is outside the roots.

    The workers then read the very file that was checked, whatever their working directory.
    """
    if isinstance(spec.data, DatasetDataSpec):
        return _check_dataset_paths(spec, data=spec.data, data_roots=data_roots)
    if not isinstance(spec.data, TextDataSpec):
        return spec
    path = spec.data.path
    resolved = os.path.realpath(path)
    roots = [os.path.realpath(root) for root in data_roots]
    if not any(os.path.commonpath([resolved, root]) == root for root in roots):
        raise invalid_data(
            f"data.path: {path!r} is outside the data roots {roots} (ZERO1_DATA_ROOTS; symlinks are followed)"
        )
    if not os.path.isfile(resolved):
        raise invalid_data(f"data.path: no such file: {path!r}")
    return spec.model_copy(update={"data": TextDataSpec(kind="text", path=resolved)})


def _check_dataset_paths(spec: JobSpec, *, data: DatasetDataSpec, data_roots: Sequence[str]) -> JobSpec:
    """A 422 when a dataset's path or tokenizer is outside the roots or names no file (the standard
    library's checks: reading and tokenizing is check_dataset's, in a Ray task); the paths made absolute."""
    try:
        datafiles.resolve_files(data.path, format=data.format, roots=data_roots)
        if data.tokenizer not in (None, datafiles.BYTES):
            datafiles.resolve_tokenizer(data.tokenizer, roots=data_roots)
    except ValueError as exc:
        raise invalid_data(str(exc)) from None
    absolute = {"path": datafiles.absolute_path(data.path)}
    if data.tokenizer not in (None, datafiles.BYTES):
        absolute["tokenizer"] = os.path.realpath(data.tokenizer)
    return spec.model_copy(update={"data": data.model_copy(update=absolute)})


def check_dataset(
    spec: JobSpec, *, model: ModelKind, checker: DatasetChecker, data_roots: Sequence[str], cache_dir: str
) -> DatasetSummary | None:
    """A dataset job's files read and tokenized into the cache (a Ray task), or a 422 naming the field:
    text_field absent, tokenizer invalid or above the model's vocab_size, the dataset empty or under one
    global batch of blocks. `model` is the job's workers' spec (vocab_size, block_size; an hf model's path)."""
    if not isinstance(spec.data, DatasetDataSpec):
        return None
    seq_len = spec.seq_len or model.block_size
    request = DatasetRequest(
        data=spec.data.to_spec(data_roots=data_roots, cache_dir=cache_dir),
        vocab_size=model.vocab_size,
        seq_len=seq_len,
        global_batch_size=spec.global_batch_size or spec.micro_batch_size * spec.num_gpus,
        seed=spec.seed,
        tokenizer_dir=getattr(model, "path", None),
    )
    return checker.check(request)


def check_storage(problems: dict[str, str], *, uri: str) -> None:
    """A 503 when some GPU node cannot write checkpoints (a job there could never save one)."""
    if problems:
        node, why = next(iter(problems.items()))
        raise ServiceError(
            f"checkpoint storage ZERO1_CHECKPOINT_URI ({uri}) is not writable from {len(problems)} GPU node(s); "
            f"node {node}: {why}",
            status_code=503,
            error="checkpoint_storage_unwritable",
        )


def _what_fits(
    plan: memory.Plan, *, cluster: ClusterCapacity, request, overhead_bytes: int, tracer: Tracer | None
) -> str:
    workload = workload_for(request, overhead_bytes=overhead_bytes, tracer=tracer)
    if plan.min_gpus is None:
        floor = memory.bytes_per_param(plan.precision)
        text = (
            f"; ZeRO stage 1 fits on no number of GPUs: the replicated {plan.precision} weights and gradients "
            f"alone are {sum(floor) * plan.num_params / GB:.2f} GB"
        )
    elif plan.min_gpus > cluster.num_gpus:
        text = f"; it needs min_gpus = {plan.min_gpus} at stage 1, and the cluster has {cluster.num_gpus}"
    else:
        text = f"; min_gpus = {plan.min_gpus} at stage 1 fits"
    higher = [
        f"stage {stage} on N >= {n}"
        for stage in (2, 3)
        if (n := memory.min_gpus(workload, stage=stage, gpu_memory_bytes=plan.gpu_memory_bytes)) is not None
    ]
    if higher and (plan.min_gpus is None or plan.min_gpus > cluster.num_gpus):
        text += f"; ZeRO {' or '.join(higher)} would fit (zero1 runs stage 1)"
    return text


def _does_not_fit(plan: PlanPublic, message: str) -> ServiceError:
    return ServiceError(message, status_code=422, error="does_not_fit", plan=plan.model_dump(mode="json"))


def request_hash(spec: JobSpec) -> str:
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def submit_job(
    session: Session,
    *,
    spec: JobSpec,
    plan: PlanPublic,
    idempotency_key: str | None,
    owner: str | None = None,
    max_queued: int | None = None,
) -> tuple[Job, bool]:
    """Store a queued job of `owner`; (job, created). A reused Idempotency-Key returns its job or a 409;
    a 429 if `owner` already has `max_queued` jobs queued."""
    digest = request_hash(spec)
    if idempotency_key is not None:
        existing = session.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
        if existing is not None:
            return _replay(existing, digest, idempotency_key, owner=owner), False
    if max_queued is not None:
        _check_queue_limit(session, owner=owner, max_queued=max_queued)
    job = Job(
        name=spec.name,
        status="queued",
        spec=spec.model_dump(mode="json"),
        plan=plan.model_dump(mode="json"),
        num_gpus=spec.num_gpus,
        steps=spec.steps,
        idempotency_key=idempotency_key,
        request_hash=digest,
        owner=owner,
    )
    try:
        # the job and its first event in one savepoint: on SQLite, whose driver opens no
        # transaction before a SAVEPOINT, releasing it commits, and the scheduler could see
        # (and start) a job whose "queued" event was not yet written
        with session.begin_nested():
            session.add(job)
            session.flush()
            session.add(JobEvent(job_id=job.id, from_status=None, to_status="queued", reason="submitted"))
            session.flush()
    except IntegrityError:  # a concurrent request with the same key won the race
        existing = session.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
        return _replay(existing, digest, idempotency_key, owner=owner), False
    return job, True


def _check_queue_limit(session: Session, *, owner: str | None, max_queued: int) -> None:
    """Checked before the insert: concurrent submits of one user may pass the limit by those in flight."""
    mine = Job.owner.is_(None) if owner is None else Job.owner == owner
    queued = session.scalar(select(func.count()).where(Job.status == "queued", mine))
    if queued >= max_queued:
        who = "the anonymous user (auth is off)" if owner is None else f"user {owner}"
        raise ServiceError(
            f"{who} has {queued} queued jobs, the limit is {max_queued} (ZERO1_MAX_QUEUED_JOBS_PER_USER); "
            "submit again when some have started, or cancel some",
            status_code=429,
            error="too_many_queued_jobs",
            queued=queued,
            limit=max_queued,
        )


def _replay(job: Job, digest: str, key: str, *, owner: str | None) -> Job:
    if job.owner != owner:  # another user's key: say nothing of their job
        raise ServiceError(
            f"Idempotency-Key {key!r} is in use by another user", status_code=409, error="idempotency_conflict"
        )
    if job.request_hash != digest:
        raise ServiceError(
            f"Idempotency-Key {key!r} was used for job {job.id} with a different body",
            status_code=409,
            error="idempotency_conflict",
        )
    return job


# --------------------------------------------------------------------------- queries


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise _no_job(job_id)
    return job


def _no_job(job_id: int) -> ServiceError:
    return ServiceError(f"no job with id {job_id}", status_code=404, error="not_found")


def can_see(principal: Principal, job: Job) -> bool:
    """Whether `principal` sees the job's details (spec, last metrics row, error, metrics, events): its owner
    and admins do; everyone sees the rest, so that all know who holds the GPUs."""
    return principal.admin or (principal.user is not None and principal.user == job.owner)


def get_visible_job(session: Session, job_id: int, *, principal: Principal) -> Job:
    """The job whose details `principal` may read; another's is a 404 as if it did not exist."""
    job = get_job(session, job_id)
    if not can_see(principal, job):
        raise _no_job(job_id)
    return job


def queue_position(session: Session, job: Job) -> int | None:
    if job.status != "queued":
        return None
    ahead = session.scalar(select(func.count()).where(Job.status == "queued", Job.id < job.id))
    return ahead + 1


def job_public(job: Job, *, position: int | None, principal: Principal) -> JobPublic:
    """The job as `principal` sees it (its details null unless can_see); `position` is its queue_position."""
    mine = can_see(principal, job)
    return JobPublic(
        id=job.id,
        name=job.name,
        status=job.status,
        spec=job.spec if mine else None,
        plan=job.plan,
        num_gpus=job.num_gpus,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        step=job.step,
        steps=job.steps,
        latest=_finite(job.latest) if mine else None,
        error=job.error if mine else None,
        attempt=job.attempt,
        num_retries=job.num_retries,
        queue_position=position,
        owner=job.owner,
    )


def _finite(row: dict | None) -> dict | None:
    """A row stored before non-finite values were nulled on the way in (JSON has no inf or nan)."""
    return None if row is None else {k: finite_or_none(v) for k, v in row.items()}


def list_jobs(
    session: Session, *, statuses: list[str] | None, limit: int, cursor: int | None, principal: Principal
) -> tuple[list[JobPublic], str | None]:
    """Newest first, as `principal` sees them; the cursor is the id the next page starts below."""
    query = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if statuses:
        query = query.where(Job.status.in_(statuses))
    if cursor is not None:
        query = query.where(Job.id < cursor)
    jobs = list(session.scalars(query))
    more = len(jobs) > limit
    jobs = jobs[:limit]
    positions: dict[int, int] = {}
    if any(j.status == "queued" for j in jobs):  # one query for the whole queue, not one per job
        queue = session.scalars(select(Job.id).where(Job.status == "queued").order_by(Job.id))
        positions = {job_id: i + 1 for i, job_id in enumerate(queue)}
    data = [job_public(j, position=positions.get(j.id), principal=principal) for j in jobs]
    return data, (str(jobs[-1].id) if more else None)


def cancel_job(session: Session, job_id: int) -> Job:
    """A queued job ends now; an active one is stopped by the scheduler within a tick.

    The scheduler may start the job between this read and the write: the compare-and-set
    then fails, and the job, now active, is flagged for the scheduler to stop instead."""
    job = get_job(session, job_id)
    if job.status == "queued" and transition(session, job, "cancelled", "cancelled by request while queued"):
        return job
    if job.status in ACTIVE:  # a compare-and-set too: the job may have ended since it was read
        flagged = session.execute(
            update(Job).where(Job.id == job.id, Job.status.in_(ACTIVE)).values(cancel_requested=True),
            execution_options={"synchronize_session": False},
        )
        if flagged.rowcount == 1:
            set_committed_value(job, "cancel_requested", True)
            return job
        session.refresh(job)
    raise ServiceError(f"job {job_id} is already {job.status}", status_code=409, error="conflict")


def job_metrics(
    session: Session,
    job: Job,
    *,
    after_step: int | None,
    limit: int,
    max_points: int | None,
    evaluated: bool = False,
) -> tuple[list[MetricPublic], int | None]:
    """The surviving curve (superseded rows left out), optionally thinned to max_points by stride;
    `evaluated`: only the steps that evaluated (eval_loss set), never thinned (they are every
    eval_every-th step, which a stride would miss)."""
    base = select(Metric).where(Metric.job_id == job.id, Metric.superseded.is_(False))
    if after_step is not None:
        base = base.where(Metric.step > after_step)
    if evaluated:
        base = base.where(Metric.eval_loss.is_not(None))
    first = 0 if after_step is None else after_step + 1
    thin = not evaluated and max_points is not None
    if thin and job.step is not None and job.step - first + 1 > max_points:
        # looked up by (job_id, step): no scan of the whole curve
        base = base.where(Metric.step.in_(thinned_steps(first, job.step, max_points=max_points)))
    rows = list(session.scalars(base.order_by(Metric.step).limit(limit + 1)))
    more = len(rows) > limit
    rows = rows[:limit]
    data = [MetricPublic.model_validate(row, from_attributes=True) for row in rows]
    return data, (rows[-1].step if more else None)


def job_artifacts(job: Job, *, launcher: RayLauncher) -> tuple[Path, list[ArtifactPublic]]:
    """The final model's directory and files of a succeeded job (none when it wrote none: it
    succeeded before artifacts existed, or its storage lost them); 409 for any other status."""
    if job.status != "succeeded":
        raise ServiceError(
            f"job {job.id} is {job.status}: its artifacts are written when it succeeds",
            status_code=409,
            error="conflict",
        )
    directory, files = launcher.artifacts(job)
    return directory, [ArtifactPublic.model_validate(entry) for entry in files]


def artifact_file(job: Job, name: str, *, launcher: RayLauncher) -> Path:
    """The path of one of the job's artifacts: a name its manifest lists (anything else, a path
    with a separator or .. included, is a 404), a regular file in its final/ directory."""
    directory, files = job_artifacts(job, launcher=launcher)
    path = directory / name
    if name not in {entry.name for entry in files} or Path(name).name != name or not path.is_file():
        raise ServiceError(f"job {job.id} has no artifact {name!r}", status_code=404, error="not_found")
    return path


def thinned_steps(first: int, last: int, *, max_points: int) -> list[int]:
    """At most max_points of the steps first..last: the multiples of the smallest stride that
    fits, and the last. Multiples of the stride, not offsets from `first`, so that the points a
    chart already has stay points as it pages on."""
    stride = max(1, math.ceil((last - first + 1) / max_points))
    while True:
        wanted = sorted({*range(-(-first // stride) * stride, last + 1, stride), last})
        if len(wanted) <= max_points:
            return wanted
        stride += 1


def job_events(session: Session, job: Job) -> list[EventPublic]:
    events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id))
    return [EventPublic.model_validate(e, from_attributes=True) for e in events]


def gpus_in_use(session: Session) -> int:
    return session.scalar(select(func.coalesce(func.sum(Job.num_gpus), 0)).where(Job.status.in_(ACTIVE)))
