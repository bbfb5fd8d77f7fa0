"""The job state machine: which status may follow which, each change a compare-and-set that records
its event, the flags an active job is stopped or suspended by, and a cancel.

Functions take the request's session and only flush; the caller commits.
"""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from service.errors import ServiceError
from service.schemas.fields import ACTIVE, TERMINAL
from service.schemas.responses import PlanPublic
from service.store.job_repository import get_job
from service.store.tables import Job, JobEvent, utcnow

_TRANSITIONS = {
    "queued": {"starting", "cancelled", "suspended", "stopped_early"},
    "starting": {
        "running",
        "failed",
        "cancelled",
        "restarting",
        "queued",
        "suspended",
        "stopped_early",
    },  # a lost attempt
    "running": {
        "succeeded",
        "failed",
        "cancelled",
        "restarting",
        "queued",
        "suspended",
        "stopped_early",
    },  # queued: preempted
    "restarting": {"running", "failed", "cancelled", "queued", "suspended", "stopped_early"},
    "suspended": {"queued", "cancelled", "stopped_early"},
}
"""stopped_early: a sweep's early stopping (service/experiments/early_stopping.py) ended it, from a stop at a step
boundary with a checkpoint, or at once while it held no GPU."""


def transition(session: Session, job: Job, to_status: str, reason: str, *, gpus: int | None = None) -> bool:
    """Move `job` to `to_status` if it is still in the status this session read, recording the event
    with the GPUs the job holds from then on: `gpus` (a start's or a relaunch's N, set on the job after),
    else its world_size (num_gpus) in an active status, 0 in any other (service/scheduling/usage.py).

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
    held = (gpus or job.world_size or job.num_gpus) if to_status in ACTIVE else 0
    session.add(JobEvent(job_id=job.id, from_status=from_status, to_status=to_status, reason=reason, gpus=held))
    return True


def still_active(session: Session, job: Job) -> Job | None:
    """The job as stored now, if it is still in the attempt and an active status it was read in."""
    fresh = session.get(Job, job.id, populate_existing=True)
    if fresh is None or fresh.attempt != job.attempt or fresh.status not in ACTIVE:
        return None
    return fresh


def running_reason(job: Job, *, nodes: int) -> str:
    """The reason of a start's (or a relaunch's) transition to running; an elastic auto job's names the
    stage it trains at on this N."""
    ranks = job.world_size or job.num_gpus
    plan = PlanPublic.model_validate(job.plan)
    stage = "" if plan.stage_at is None else f" at ZeRO stage {plan.stage_for(ranks)}"
    if job.status == "restarting":
        return f"attempt {job.attempt}: {ranks} ranks placed on {nodes} node(s), resumed{stage}"
    return f"{ranks} ranks placed on {nodes} node(s) and training{stage}"


def stage_change(job: Job, old: int, new: int) -> str:
    """An elastic auto job's change of ZeRO stage as it resizes from `old` to `new` ranks, for the
    event's reason: " (ZeRO stage 3 -> 1)"; "" where the stage stays."""
    plan = PlanPublic.model_validate(job.plan)
    before, after = plan.stage_for(old), plan.stage_for(new)
    return "" if before == after else f" (ZeRO stage {before} -> {after})"


def cancel_job(session: Session, job_id: int) -> Job:
    """A queued job ends now; an active one is stopped by the scheduler within a tick.

    The scheduler may start the job between this read and the write: the compare-and-set
    then fails, and the job, now active, is flagged for the scheduler to stop instead."""
    job = get_job(session, job_id)
    if job.status in ("queued", "suspended") and transition(
        session, job, "cancelled", f"cancelled by request while {job.status}"
    ):
        return job
    if job.status in ACTIVE and flag_active(session, job, "cancel_requested"):
        return job
    raise ServiceError(f"job {job_id} is already {job.status}", status_code=409, error="conflict")


def flag_active(session: Session, job: Job, flag: str, value: bool | str = True) -> bool:
    """Set `flag` (cancel_requested, suspend_requested; stop_early, to its reason) if the job is still
    active: a compare-and-set, as it may have ended since it was read (then `job` is refreshed). Whether
    it was set."""
    query = update(Job).where(Job.id == job.id, Job.status.in_(ACTIVE)).values({flag: value})
    if session.execute(query, execution_options={"synchronize_session": False}).rowcount != 1:
        session.refresh(job)
        return False
    set_committed_value(job, flag, value)
    return True
