"""Sweeps: a job spec searched over some of its fields, one job per trial.

A sweep is planned whole before any trial starts: each trial's spec is validated and admitted by the
memory model as POST /v1/jobs admits a job, and one that does not fit is a 422 naming the trial's
values and the plan (or, with skip_unfit, a trial listed as skipped). Then the scheduler, at each
tick, submits the next trials while fewer than max_concurrent of the sweep's jobs have not ended,
each a job of the sweep's owner and priority tagged `sweep:<id>`, and stops those its early stopping
judges behind at a rung (service/experiments/early_stopping.py); once every trial has ended the sweep
has too, its best trial the succeeded one with the least metric. A suspended sweep submits none, its
trials' jobs suspended with it.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import random
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.auth import Principal
from service.errors import ServiceError, describe_validation_errors
from service.experiments import early_stopping
from service.intake import submission
from service.scheduling import controls, job_states, usage
from service.scheduling.dispatch import Reasons
from service.schemas.fields import ACTIVE, TERMINAL
from service.schemas.requests import JobSpec
from service.schemas.responses import PlanPublic
from service.schemas.sweeps import IntUniform, LogUniform, SweepPublic, SweepSpec, TrialPublic, Uniform
from service.store.tables import Job, Metric, Sweep, SweepEvent, SweepTrial, utcnow

log = logging.getLogger(__name__)

Admit = Callable[[JobSpec], PlanPublic]
"""A trial's spec -> its plan, or a ServiceError (does_not_fit: admission.admit on the cluster)."""


def tag(sweep_id: int) -> str:
    return f"sweep:{sweep_id}"


def trial_values(spec: SweepSpec) -> list[dict[str, Any]]:
    """The values of each trial: the grid's every combination (the last path varying fastest), or
    max_trials draws of a random search from `seed`."""
    paths = list(spec.space)
    if spec.is_grid:
        return [dict(zip(paths, combo, strict=True)) for combo in itertools.product(*spec.space.values())]
    draw = random.Random(spec.seed)
    return [{path: _draw(spec.space[path], draw) for path in paths} for _ in range(spec.max_trials or 0)]


def _draw(dimension: Any, draw: random.Random) -> Any:
    if isinstance(dimension, list):
        return draw.choice(dimension)
    if isinstance(dimension, Uniform):
        return draw.uniform(*dimension.uniform)
    if isinstance(dimension, LogUniform):
        low, high = dimension.log_uniform
        return math.exp(draw.uniform(math.log(low), math.log(high)))
    assert isinstance(dimension, IntUniform)
    return draw.randint(*dimension.int_uniform)


def trial_spec(spec: SweepSpec, index: int, values: dict[str, Any]) -> JobSpec:
    """Trial `index`'s job spec: the base with each path set to its value, named and tagged for the sweep
    (its tag added once the sweep has an id); a 422 naming the trial for a spec that is not valid."""
    body = copy.deepcopy(spec.base)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = body
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise _trial_error(index, values, f"{path}: {part} is not an object in the base spec")
        node[leaf] = value
    body["name"] = f"{spec.name}-{index}"
    try:
        return JobSpec.model_validate(body)
    except ValidationError as error:
        message, _ = describe_validation_errors(error.errors())
        raise _trial_error(index, values, message) from None


def _trial_error(index: int, values: dict[str, Any], why: str, **extra: Any) -> ServiceError:
    shown = ", ".join(f"{path}={value!r}" for path, value in values.items())
    detail = [{"field": "space", "message": f"trial {index} ({shown}): {why}", "type": "value_error"}]
    return ServiceError(
        f"trial {index} ({shown}): {why}", status_code=422, error="invalid_request", detail=detail, trial=index, **extra
    )


def plan_trials(
    spec: SweepSpec, *, admit: Admit
) -> list[tuple[dict[str, Any], JobSpec, PlanPublic | None, str | None]]:
    """Each trial's (values, spec, plan, why it is skipped): every one admitted, or a 422 for the first
    that is not (without skip_unfit)."""
    planned = []
    for index, values in enumerate(trial_values(spec)):
        job_spec = trial_spec(spec, index, values)
        if spec.early_stopping is not None and spec.early_stopping.rungs[-1] >= job_spec.steps:
            last = spec.early_stopping.rungs[-1]
            why = f"early_stopping.rungs: its last rung ({last}) must be < steps ({job_spec.steps})"
            raise _trial_error(index, values, why)
        try:
            planned.append((values, job_spec, admit(job_spec), None))
        except ServiceError as error:
            if error.error != "does_not_fit":
                raise
            if not spec.skip_unfit:
                raise _trial_error(
                    index, values, f"does not fit: {error.message}", plan=error.extra.get("plan")
                ) from None
            planned.append((values, job_spec, None, f"does not fit: {error.message}"))
    return planned


def create(session: Session, spec: SweepSpec, planned: list, *, owner: str | None) -> Sweep:
    """The sweep and its trials stored, none submitted yet (the scheduler's next tick does)."""
    sweep = Sweep(name=spec.name, owner=owner, status="running", spec=spec.model_dump(mode="json"))
    session.add(sweep)
    session.flush()
    for index, (values, _, plan, skipped) in enumerate(planned):
        stored = None if plan is None else plan.model_dump(mode="json")
        session.add(SweepTrial(sweep_id=sweep.id, index=index, values=values, plan=stored, skipped=skipped))
    session.flush()
    return sweep


def advance(session: Session) -> bool:
    """Each running sweep: submit its next trials while fewer than max_concurrent of its jobs have not
    ended; end it once every trial has. Called by the scheduler at each tick, before it admits;
    whether a sweep is still running."""
    running = False
    for sweep in session.scalars(select(Sweep).where(Sweep.status.in_(("running", "suspended")))).all():
        spec = SweepSpec.model_validate(sweep.spec)
        trials = _trials(session, sweep.id)
        jobs = _jobs(session, trials)
        if spec.early_stopping is not None:
            early_stopping.decide(session, spec, trials, jobs)
        statuses = {job_id: job.status for job_id, job in jobs.items()}
        live = sum(1 for t in trials if t.job_id is not None and statuses.get(t.job_id) not in TERMINAL)
        if sweep.status == "suspended":
            running = True
            continue
        waiting = [t for t in trials if t.job_id is None and t.skipped is None]
        for trial in waiting[: max(0, spec.max_concurrent - live)]:
            try:
                with session.begin_nested():  # a trial that cannot be submitted now is skipped, saying why
                    trial.job_id = _submit(session, sweep, spec, trial)
                live += 1
            except Exception as error:  # noqa: BLE001 - one trial's, never the scheduler's tick
                why = error.message if isinstance(error, ServiceError) else f"{type(error).__name__}: {error}"
                log.warning("sweep %s: trial %s could not be submitted: %s", sweep.id, trial.index, why)
                trial.skipped = f"could not be submitted: {why}"[:2000]
        waiting = [t for t in waiting if t.job_id is None and t.skipped is None]
        if not waiting and live == 0:
            succeeded = sum(1 for t in trials if t.job_id is not None and statuses.get(t.job_id) == "succeeded")
            why = f"every trial has ended: {succeeded} of {len(trials)} succeeded"
            _end(session, sweep, "succeeded" if succeeded else "failed", why)
        else:
            running = True
    return running


def _submit(session: Session, sweep: Sweep, spec: SweepSpec, trial: SweepTrial) -> int:
    """The trial's job, admitted by the plan it was planned by (the cluster may have changed since: the
    scheduler's admission holds it to the GPUs as any job)."""
    job_spec = trial_spec(spec, trial.index, trial.values)
    job_spec = job_spec.model_copy(update={"tags": sorted({*job_spec.tags, tag(sweep.id)})})
    job, _ = submission.submit_job(
        session,
        spec=job_spec,
        plan=PlanPublic.model_validate(trial.plan),
        idempotency_key=None,
        owner=sweep.owner,
        priority=job_spec.priority if job_spec.priority is not None else 50,
    )
    return job.id


def _end(session: Session, sweep: Sweep, status: str, reason: str) -> None:
    """The sweep ends, its event stored for the webhook."""
    sweep.status = status
    sweep.finished_at = utcnow()
    session.add(SweepEvent(sweep_id=sweep.id, to_status=status, reason=reason))


def get_visible_sweep(session: Session, sweep_id: int, principal: Principal) -> Sweep:
    """The sweep, if the caller may see it (its owner, an admin); else a 404, as for a sweep that does not
    exist: another user's sweeps are not confirmed to exist."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None or not (principal.admin or (principal.user is not None and principal.user == sweep.owner)):
        raise ServiceError(f"no sweep with id {sweep_id}", status_code=404, error="not_found")
    return sweep


def visible_sweeps(session: Session, principal: Principal, *, limit: int) -> list[Sweep]:
    """The caller's sweeps (an admin's: everyone's), newest first."""
    query = select(Sweep).order_by(Sweep.id.desc()).limit(limit)
    if not principal.admin:
        query = query.where(Sweep.owner == principal.user) if principal.user is not None else query.where(False)
    return list(session.scalars(query))


def suspend(session: Session, sweep: Sweep) -> None:
    """No trial is submitted until it resumes; each trial's job that has not ended is suspended (a queued
    one at once, an active one at its next step boundary, with a checkpoint)."""
    _conflict_unless(sweep, "running", "suspended")
    for job in _jobs(session, _trials(session, sweep.id)).values():
        if job.status == "queued" or (job.status in ACTIVE and not job.stop_early):
            controls.suspend_job(session, job.id)
    sweep.status = "suspended"


def resume(session: Session, sweep: Sweep) -> None:
    """Its suspended trials' jobs go back to the queue, and its next trials are submitted again."""
    _conflict_unless(sweep, "suspended", "resumed")
    for job in _jobs(session, _trials(session, sweep.id)).values():
        if job.status == "suspended":
            controls.resume_job(session, job.id)
    sweep.status = "running"


def _conflict_unless(sweep: Sweep, status: str, what: str) -> None:
    if sweep.status != status:
        raise ServiceError(
            f"sweep {sweep.id} is {sweep.status}: only a {status} sweep can be {what}",
            status_code=409,
            error="conflict",
        )


def cancel(session: Session, sweep: Sweep) -> None:
    """Cancel the sweep: its jobs that have not ended (as POST /v1/jobs/{id}/cancel does), and the
    trials not yet submitted, listed as skipped."""
    if sweep.status not in ("running", "suspended"):
        raise ServiceError(
            f"sweep {sweep.id} is {sweep.status}: only a running or suspended sweep can be cancelled",
            status_code=409,
            error="conflict",
        )
    for trial in _trials(session, sweep.id):
        if trial.job_id is None and trial.skipped is None:
            trial.skipped = "the sweep was cancelled first"
        elif trial.job_id is not None and (job := session.get(Job, trial.job_id)).status not in TERMINAL:
            job_states.cancel_job(session, job.id)
    _end(session, sweep, "cancelled", "cancelled by request")


def public(session: Session, sweep: Sweep, *, reasons: Reasons | None = None) -> SweepPublic:
    """The sweep as the API answers it: each trial with its job's status, steps, metric and why it waits
    (`reasons`: the scheduler's, by job id); the best; the GPU-seconds its trials held."""
    spec = SweepSpec.model_validate(sweep.spec)
    trials = _trials(session, sweep.id)
    jobs = _jobs(session, trials)
    last_eval = _last_eval_losses(session, list(jobs)) if spec.metric == "eval_loss" else {}
    live = sum(1 for job in jobs.values() if job.status not in TERMINAL)
    shown = []
    for trial in trials:
        job = jobs.get(trial.job_id)
        status = "skipped" if trial.skipped is not None and job is None else (job.status if job else "pending")
        metric = None
        if job is not None:
            metric = last_eval.get(job.id) if spec.metric == "eval_loss" else (job.latest or {}).get("loss")
        done = 0 if job is None or job.step is None else job.step + 1
        shown.append(
            TrialPublic(
                index=trial.index, values=trial.values, job_id=trial.job_id, status=status,
                skipped=trial.skipped, reason=_waits(sweep, spec, job, status, live, reasons), steps_done=done,
                metric=metric, rungs=trial.rungs or {},
            )
        )  # fmt: skip
    ranked = [t for t in shown if t.status == "succeeded" and t.metric is not None and math.isfinite(t.metric)]
    return SweepPublic(
        id=sweep.id,
        name=sweep.name,
        owner=sweep.owner,
        status=sweep.status,
        metric=spec.metric,
        max_concurrent=spec.max_concurrent,
        early_stopping=spec.early_stopping,
        gpu_seconds=round(usage.held_gpu_seconds(session, list(jobs.values())), 3),
        created_at=sweep.created_at,
        finished_at=sweep.finished_at,
        trials=shown,
        best=min(ranked, key=lambda t: (t.metric, t.index)) if ranked else None,
        tag=tag(sweep.id),
    )


def _waits(
    sweep: Sweep, spec: SweepSpec, job: Job | None, status: str, live: int, reasons: Reasons | None
) -> str | None:
    """Why a trial waits: its turn in the sweep (not submitted yet), or its job's in the queue."""
    if status == "pending":
        if sweep.status == "suspended":
            return "the sweep is suspended"
        return f"waits its turn: {live} of the sweep's trials have not ended (max_concurrent {spec.max_concurrent})"
    if status == "queued" and job is not None:
        return reasons.of(job.id) if reasons is not None else "queued"
    if status == "suspended":
        return "suspended" + (" with the sweep" if sweep.status == "suspended" else "")
    return None


def _jobs(session: Session, trials: list[SweepTrial]) -> dict[int, Job]:
    ids = [t.job_id for t in trials if t.job_id is not None]
    return {job.id: job for job in session.scalars(select(Job).where(Job.id.in_(ids)))} if ids else {}


def _trials(session: Session, sweep_id: int) -> list[SweepTrial]:
    return list(session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id).order_by(SweepTrial.index)))


def _last_eval_losses(session: Session, job_ids: list[int]) -> dict[int, float]:
    """Each job's eval_loss at its last step that evaluated (of the surviving curve)."""
    if not job_ids:
        return {}
    evaluated = (Metric.job_id.in_(job_ids), Metric.eval_loss.is_not(None), Metric.superseded.is_(False))
    last = (
        select(Metric.job_id, func.max(Metric.step).label("step")).where(*evaluated).group_by(Metric.job_id).subquery()
    )
    rows = session.execute(
        select(Metric.job_id, Metric.eval_loss)
        .join(last, (Metric.job_id == last.c.job_id) & (Metric.step == last.c.step))
        .where(*evaluated)
    ).all()
    return dict(rows)
