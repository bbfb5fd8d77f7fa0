"""Sweeps: POST /v1/sweeps (a job spec searched over some of its fields, planned whole before any trial
starts), GET /v1/sweeps and /v1/sweeps/{id} (the trials, their values, status, metric and why each
waits; the best), POST /v1/sweeps/{id}/cancel, /suspend and /resume. The rules are service/experiments/sweeps.py's."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from starlette.concurrency import run_in_threadpool

from service.api.deps import (
    MAX_ID,
    AppStateDep,
    ClusterDep,
    PrincipalDep,
    ReaderDep,
    SessionDep,
    SettingsDep,
    errors,
    json_response,
)
from service.auth import Principal, check_can_steer
from service.errors import ServiceError
from service.experiments import sweeps
from service.intake import admission
from service.scheduling import controls
from service.schemas.requests import JobSpec
from service.schemas.responses import PlanPublic
from service.schemas.sweeps import SweepPublic, SweepSpec, SweepsPublic
from workers.memory.model import GB

router = APIRouter(prefix="/sweeps", tags=["sweeps"])
_ERRORS = errors(401, 403, 404, 409, 422)
SweepId = Annotated[int, Path(ge=1, le=MAX_ID)]


def _admitter(runtime, cluster, settings, principal: Principal):
    """A trial's spec -> its plan, checked as POST /v1/jobs checks a job that needs no task of Ray: the
    priority and the quota, the plan, the data's paths."""

    def admit(spec: JobSpec) -> PlanPublic:
        unsupported = "code" if spec.code else "init_from" if spec.init_from else None
        if unsupported is None and spec.data.kind == "dataset":
            unsupported = "data of kind dataset"
        if unsupported is not None:
            why = f"a sweep of jobs with {unsupported} is not supported yet: submit its trials as jobs"
            detail = [{"field": "base", "message": why, "type": "value_error"}]
            raise ServiceError(f"base: {why}", status_code=422, error="invalid_request", detail=detail)
        controls.check_priority(spec, settings=settings, principal=principal)
        controls.check_quota(spec, settings=settings, owner=principal.user)
        controls.check_notify(spec, settings=settings)
        admission.check_data(spec, data_roots=settings.data_roots)
        overhead = round(settings.gpu_overhead_gb * GB)
        return admission.admit(spec, cluster=cluster, overhead_bytes=overhead, tracer=runtime.tracer)

    return admit


@router.post("", status_code=201, response_model=SweepPublic, responses=_ERRORS)
async def create_sweep(
    spec: SweepSpec, cluster: ClusterDep, settings: SettingsDep, principal: PrincipalDep, runtime: AppStateDep
) -> Response:
    """Plan every trial (a 422 naming the first that is not valid or does not fit, unless skip_unfit);
    store the sweep. The scheduler submits its trials from its next tick, max_concurrent at a time."""
    admit = _admitter(runtime, cluster, settings, principal)
    planned = await run_in_threadpool(sweeps.plan_trials, spec, admit=admit)

    def store() -> SweepPublic:
        with runtime.db.session() as session:
            sweep = sweeps.create(session, spec, planned, owner=principal.user)
            return sweeps.public(session, sweep)

    created = await run_in_threadpool(store)
    runtime.scheduler.sweep_created()
    return json_response(created, status_code=201)


@router.get("", response_model=SweepsPublic, responses=_ERRORS)
def list_sweeps(session: SessionDep, principal: ReaderDep, runtime: AppStateDep) -> Response:
    """The caller's sweeps (an admin: everyone's), newest first."""
    reasons = runtime.scheduler.queue_reasons()
    data = [
        sweeps.public(session, sweep, reasons=reasons) for sweep in sweeps.visible_sweeps(session, principal, limit=500)
    ]
    return json_response(SweepsPublic(data=data))


@router.get("/{sweep_id}", response_model=SweepPublic, responses=_ERRORS)
def get_sweep(sweep_id: SweepId, session: SessionDep, principal: ReaderDep, runtime: AppStateDep) -> Response:
    """Its trials (values, job, status, steps, metric, why each waits) and the best; its owner's and admins'."""
    sweep = sweeps.get_visible_sweep(session, sweep_id, principal)
    return json_response(sweeps.public(session, sweep, reasons=runtime.scheduler.queue_reasons()))


def _steer(session, sweep_id: int, principal: Principal, action) -> Response:
    sweep = sweeps.get_visible_sweep(session, sweep_id, principal)
    check_can_steer(principal, job_id=sweep.id, owner=sweep.owner)
    action(session, sweep)
    session.flush()
    return json_response(sweeps.public(session, sweep), status_code=202)


@router.post("/{sweep_id}/cancel", status_code=202, response_model=SweepPublic, responses=_ERRORS)
def cancel_sweep(sweep_id: SweepId, session: SessionDep, principal: PrincipalDep) -> Response:
    """Cancel every trial's job that has not ended, and the trials not yet submitted; 409 once it ended."""
    return _steer(session, sweep_id, principal, sweeps.cancel)


@router.post("/{sweep_id}/suspend", status_code=202, response_model=SweepPublic, responses=_ERRORS)
def suspend_sweep(sweep_id: SweepId, session: SessionDep, principal: PrincipalDep) -> Response:
    """Submit no further trial, and suspend each trial's job that has not ended (a running one at its next
    step, with a checkpoint); 409 unless it is running."""
    return _steer(session, sweep_id, principal, sweeps.suspend)


@router.post("/{sweep_id}/resume", status_code=202, response_model=SweepPublic, responses=_ERRORS)
def resume_sweep(sweep_id: SweepId, session: SessionDep, principal: PrincipalDep) -> Response:
    """Its suspended trials' jobs back to the queue, and its next trials submitted again; 409 unless suspended."""
    return _steer(session, sweep_id, principal, sweeps.resume)
