"""The dashboard's pages: jobs and the queue (/), one job (/jobs/{id}) and the planner (/plan).

Each page is rendered whole on the server from the same service.api.job_responses,
service.store.job_repository and service.planning.plans functions the /v1 API uses, so it reads
without JavaScript; dashboard.js then keeps it live by polling the /v1 endpoints. A page that
depends on who reads takes ReaderDep, as the API does: by then the router's
require_page_reader has sent a browser without a token to /login.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from markupsafe import Markup
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api import job_responses
from service.api.deps import AppStateDep, ClusterDep, ReaderDep, SessionDep, SettingsDep
from service.auth import Principal
from service.dashboard import charts
from service.dashboard.curves import MAX_POINTS, job_curves
from service.dashboard.format import FILTERS, elapsed_s
from service.errors import ServiceError, describe_validation_errors
from service.planning.plans import make_plan, plan_public
from service.planning.recommendations import cost_model_of, recommend_public
from service.scheduling import controls
from service.schemas.fields import ACTIVE, TAG_PATTERN, JobStatus, resolved_roots, too_many_digits
from service.schemas.plan_requests import PlanRequest, RecommendRequest
from service.schemas.printable import MULTILINE, escape
from service.schemas.responses import JobPublic, starts_in
from service.store import job_repository
from service.store.checkpoint_files import stored_checkpoints
from service.store.job_storage import JobStorage
from service.store.log_lines import read_logs
from service.store.tables import Job, LogLine
from service.tracking.runs import run_link
from workers.memory.model import GB

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
STATUSES: tuple[str, ...] = JobStatus.__args__
TABLE_LIMIT = 100
"""Jobs the table shows, newest first, besides every active one (dashboard.js reads it from data-limit)."""
QUEUE_LIMIT = 50
"""Queued jobs the queue panel lists, in the order they start (dashboard.js reads it from data-limit)."""
LOG_LINES = 1000
"""Log lines the job page draws first (the newest), and asks for at a time after them (data-limit)."""
LOG_KEEP = 5000
"""Log lines the job page's panel keeps as more come, the newest (data-keep)."""
RANK_COLOURS = 8
"""Colours a log line's rank cycles through: .r-0 to .r-7 in dashboard.css (data-rank-colours)."""
MAX_JOB_ID = 2**63 - 1
"""The largest id a job can have (a 64-bit column): a larger one is not found, not a driver's error."""


def asset_version() -> str:
    """A digest of the static files: their URLs change when they do, so a browser never runs a stale script."""
    digest = hashlib.sha256()
    for path in sorted(p for p in STATIC_DIR.rglob("*") if p.is_file()):  # vendor/uplot/ included
        digest.update(str(path.relative_to(STATIC_DIR)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def visible(value: object) -> object:
    """Every text a page writes, with its control characters escaped (service/schemas/printable.py): names, log
    lines, reasons and errors are users'. Markup (a macro's output) was made of such values already."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return escape(value, keep=MULTILINE)
    return value


templates = Jinja2Templates(directory=HERE / "templates")
templates.env.finalize = visible  # read when a template is compiled: set before the first is loaded
templates.env.filters.update(FILTERS)
templates.env.globals.update(asset_version=asset_version(), parts=charts.PARTS, geo=charts, starts_in=starts_in)

router = APIRouter(include_in_schema=False)


# --------------------------------------------------------------------------- jobs


def table_order(job: JobPublic) -> tuple[int, int, int]:
    """Running jobs first, then starting, then the queue in the order it starts, then the rest newest first."""
    group = {"running": 0, "restarting": 0, "starting": 1, "queued": 2}.get(job.status, 3)
    return group, job.queue_position or 0, -job.id


def table_jobs(
    session: Session, *, status: str | None, principal: Principal, fifo: bool = False, tag: str | None = None
) -> list[JobPublic]:
    """The newest TABLE_LIMIT jobs (of `status`, with `tag`, each if given) and every active one (with
    `tag`), in table order."""
    statuses = [status] if status else None
    tags = [tag] if tag else None
    recent, _ = job_responses.list_jobs(
        session,
        statuses=statuses,
        limit=TABLE_LIMIT,
        cursor=None,
        principal=principal,
        fifo=fifo,
        tags=tags,
    )
    active_statuses = [s for s in ACTIVE if status in (None, s)]
    # active jobs hold GPUs, so there are never more of them than GPUs; 500 is the API's page limit
    active = (
        job_responses.list_jobs(
            session,
            statuses=active_statuses,
            limit=500,
            cursor=None,
            principal=principal,
            fifo=fifo,
            tags=tags,
        )[0]
        if active_statuses
        else []
    )
    return sorted({job.id: job for job in [*recent, *active]}.values(), key=table_order)


@router.get("/", response_class=HTMLResponse)
def jobs_page(
    request: Request,
    session: SessionDep,
    cluster: ClusterDep,
    principal: ReaderDep,
    runtime: AppStateDep,
    settings: SettingsDep,
    status: str | None = None,
    tag: str | None = None,
):
    """The cluster strip, the queue (GET /v1/queue's) and the jobs table, filtered by ?status= and ?tag= (an
    unknown status, or text that is no tag, shows all)."""
    status = status if status in STATUSES else None
    tag = tag if tag is not None and re.fullmatch(TAG_PATTERN, tag) else None
    queue = controls.queue_view(
        session,
        reasons=runtime.scheduler.queue_reasons(),
        settings=settings,
        limit=QUEUE_LIMIT,
        starts=runtime.scheduler.estimated_starts(session, limit=QUEUE_LIMIT),
    )
    context = {
        "page": "jobs",
        "cluster": cluster,
        "data_roots": resolved_roots(settings.data_roots),
        "model_roots": resolved_roots(settings.model_roots),
        "gpus_in_use": job_repository.gpus_in_use(session),
        "queued": queue.count,
        "queue": queue,
        "queue_limit": QUEUE_LIMIT,
        "status": status,
        "tag": tag,
        "jobs": table_jobs(session, status=status, principal=principal, fifo=settings.queue_policy == "fifo", tag=tag),
        "statuses": STATUSES,
        "now": datetime.now(UTC),
        "elapsed_s": elapsed_s,
        "table_limit": TABLE_LIMIT,
    }
    return templates.TemplateResponse(request, "jobs.html", context)


# --------------------------------------------------------------------------- one job


def log_tail(session: Session, job: Job, *, limit: int) -> tuple[list[dict], int]:
    """The job's newest `limit` log lines, oldest first, and the cursor after them: the page of
    GET /v1/jobs/{id}/logs that follows the line just before them."""
    before = select(LogLine.id).where(LogLine.job_id == job.id).order_by(LogLine.id.desc()).offset(limit).limit(1)
    return read_logs(session, job, after=session.scalar(before) or 0, limit=limit)


def page_job_id(text: str) -> int | None:
    """The id a page's path names, or None where none can exist: not digits, 0, or above MAX_JOB_ID."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_JOB_ID)):
        return None
    job_id = int(text)
    return job_id if 1 <= job_id <= MAX_JOB_ID else None


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(
    request: Request,
    job_id: str,
    session: SessionDep,
    principal: ReaderDep,
    settings: SettingsDep,
    runtime: AppStateDep,
):
    """Progress and training curves, the newest log lines, the memory panel, the events, the checkpoints and
    artifacts, and the spec of one job: its owner's and admins' only; to others the not-found page, as
    GET /v1/jobs/{id}/events answers them.
    An id that no job can have (not a number, or beyond the database's integers) is not found either."""
    try:
        if (number := page_job_id(job_id)) is None:
            raise ServiceError(f"no job with id {job_id}", status_code=404, error="not_found")
        job = job_repository.get_visible_job(session, number, principal=principal)
    except ServiceError as error:
        return templates.TemplateResponse(request, "not_found.html", {"message": error.message}, status_code=404)
    public = job_responses.job_public(
        job,
        position=job_repository.queue_position(session, job, fifo=settings.queue_policy == "fifo"),
        principal=principal,
    )
    curves = job_curves(session, job)
    metrics = curves.metrics
    evaluated = curves.evaluated
    checkpointed, _ = job_responses.job_metrics(
        session, job, after_step=None, limit=10 * MAX_POINTS, max_points=None, checkpointed=True
    )
    logs, log_next = log_tail(session, job, limit=LOG_LINES)
    public.mlflow = run_link(session, job, settings)
    plan = public.plan
    per_gpu = plan["per_gpu"]
    gpu_memory_bytes = plan["gpu_memory_bytes"]
    context = {
        "page": "job",
        "job": public,
        "events": job_repository.job_events(session, job),
        "now": datetime.now(UTC),
        "elapsed_s": elapsed_s,
        "max_points": MAX_POINTS,
        "loss": charts.line_chart(
            [(m.step, m.loss) for m in metrics], second=[(m.step, m.eval_loss) for m in evaluated]
        ),
        "eval_rows": evaluated,
        "step_time": charts.line_chart(
            [(m.step, m.step_time_s) for m in metrics],
            second=[(m.step, m.checkpoint_blocked_s) for m in checkpointed],
        ),
        "lr": charts.line_chart([(m.step, m.lr) for m in metrics]),
        "world_size": charts.line_chart(charts.steps_of([(m.step, m.world_size) for m in metrics])),
        "logs": logs,
        "log_next": log_next,
        "log_lines": LOG_LINES,
        "log_keep": LOG_KEEP,
        "rank_colours": RANK_COLOURS,
        "per_gpu": per_gpu,
        "gpu_memory_bytes": gpu_memory_bytes,
        "against_memory": charts.stacked_shares(per_gpu, scale_bytes=max(gpu_memory_bytes, per_gpu["total_bytes"])),
        "composition": charts.stacked_shares(per_gpu, scale_bytes=per_gpu["total_bytes"]),
        "peaks": (public.latest or {}).get("mem_peak_bytes") or [],
        "planned_bytes": (public.latest or {}).get("mem_planned_bytes"),
        "spec_json": json.dumps(public.spec, indent=2),
        "checkpoints": checkpointed,
        "checkpoint_files": checkpoint_files(job, storage=runtime.storage),
        "artifacts": job_artifacts(session, job, storage=runtime.storage),
    }
    return templates.TemplateResponse(request, "job.html", context)


def checkpoint_files(job: Job, *, storage: JobStorage) -> dict[int, list[dict]]:
    """The files of the job's complete checkpoints by step, as GET /v1/jobs/{id}/checkpoints lists
    them; none when its storage cannot be read (the API says why)."""
    try:
        found = stored_checkpoints(storage.job_store(job))
    except ServiceError:
        return {}
    return {step: [{"name": name, "bytes": size} for name, size in files] for step, files in found}


def job_artifacts(session: Session, job: Job, *, storage: JobStorage) -> list[dict] | None:
    """The succeeded job's final/ files as GET /v1/jobs/{id}/artifacts lists them; None before it has succeeded
    (the listing's 409) or when its storage cannot be read (the API says why)."""
    if job.status != "succeeded":
        return None
    try:
        _, files = job_responses.job_artifacts(session, job, storage=storage)
    except ServiceError:
        return None
    return [{"name": f.name, "bytes": f.bytes, "sha256": f.sha256} for f in files]


# --------------------------------------------------------------------------- planner

PLAN_FORM_DEFAULTS = {
    "source": "params",
    "num_params": "7.5e9",
    "vocab_size": "50257",
    "n_layer": "48",
    "n_head": "25",
    "n_embd": "1600",
    "block_size": "1024",
    "micro_batch_size": "1",
    "seq_len": "",
    "activation_checkpointing": "",
    "num_gpus": "64",
    "gpu_memory_gb": "",
    "precision": "fp16",
    "optimizer": "adamw",
    "stage": "1",
    "global_batch_size": "",
}
_GPT_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "block_size")


def _number(text: str) -> int | float | str | None:
    """'7.5e9' -> 7500000000, '80' -> 80, '0.5' -> 0.5, '' -> None; anything else, including a number of more
    than MAX_TEXT_DIGITS digits, is left for validation to name."""
    cleaned = text.strip().replace(",", "").replace("_", "")
    if not cleaned:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return text
    if not value.is_finite() or too_many_digits(value):
        return text
    return int(value) if value == value.to_integral_value() else float(value)


def plan_body(form: dict[str, str]) -> dict:
    """The POST /v1/plan body the planner form describes (dashboard.js: planBody)."""
    body = {key: _number(form[key]) for key in ("num_gpus", "gpu_memory_gb", "stage")}
    body |= {"precision": form["precision"], "optimizer": form["optimizer"]}
    if form["source"] == "gpt":
        model = {key: _number(form[key]) for key in _GPT_FIELDS}
        body["model"] = {"kind": "gpt", **{key: value for key, value in model.items() if value is not None}}
        body["micro_batch_size"] = _number(form["micro_batch_size"])
        body["seq_len"] = _number(form["seq_len"])
        body["activation_checkpointing"] = bool(form["activation_checkpointing"])
    else:
        body["num_params"] = _number(form["num_params"])
    return {key: value for key, value in body.items() if value is not None}


def recommend_body(form: dict[str, str]) -> dict | None:
    """The POST /v1/plan/recommend body of the form (dashboard.js: recommendBody): a GPT spec with a global
    batch, on up to the form's N GPUs; None without a global batch, or when planning by parameter count."""
    if form["source"] != "gpt" or _number(form["global_batch_size"]) is None:
        return None
    plan = plan_body(form)
    body = {key: plan[key] for key in ("model", "seq_len", "precision", "optimizer", "gpu_memory_gb") if key in plan}
    body |= {"global_batch_size": _number(form["global_batch_size"]), "max_gpus": plan.get("num_gpus")}
    return {key: value for key, value in body.items() if value is not None}


def recommend_context(form: dict[str, str], *, cluster, settings) -> tuple[dict, int]:
    """What plan.html draws of the recommendations, and the page's status: 422 for a body that is not valid
    (as the API answers); a configuration that fits nowhere is an answer, not an error."""
    body = recommend_body(form)
    context = {"recommend": None, "recommend_error": None, "recommend_asked": body is not None}
    if body is None:
        return context, 200
    try:
        request = RecommendRequest.model_validate(body)
    except ValidationError as error:
        return context | {"recommend_error": describe_validation_errors(list(error.errors()))[0]}, 422
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    try:
        public = recommend_public(
            request, cluster=cluster, overhead_bytes=overhead_bytes, cost_model=cost_model_of(settings)
        )
    except ServiceError as error:
        return context | {"recommend_error": error.message}, 200
    return context | {"recommend": public.model_dump(mode="json")}, 200


@router.get("/plan", response_class=HTMLResponse)
def plan_page(request: Request, cluster: ClusterDep, settings: SettingsDep):
    """The planner: a GET form, so a plan has a URL and works without JavaScript."""
    form = {**PLAN_FORM_DEFAULTS, "gpu_memory_gb": f"{cluster.gpu_memory_bytes / GB:g}"}
    given = {key: value for key, value in request.query_params.items() if key in form}
    if given:  # a submitted form: an unticked checkbox is absent from its query
        form |= {"activation_checkpointing": ""} | given
    if form["source"] not in ("params", "gpt"):
        form["source"] = "params"
    context = {"page": "plan", "form": form, "error": None, "plan": None, "recommend": None, "recommend_error": None}
    try:
        plan_request = PlanRequest.model_validate(plan_body(form))
    except ValidationError as error:
        context["error"] = describe_validation_errors(list(error.errors()))[0]
        return templates.TemplateResponse(request, "plan.html", context, status_code=422)
    plan = plan_public(make_plan(plan_request, cluster=cluster, overhead_bytes=round(settings.gpu_overhead_gb * GB)))
    context |= plan_context(plan.model_dump(mode="json"))
    recommend, status_code = recommend_context(form, cluster=cluster, settings=settings)
    return templates.TemplateResponse(request, "plan.html", context | recommend, status_code=status_code)


def plan_context(plan: dict) -> dict:
    """What plan.html draws from a plan: the floor, the sweep chart, the stacked bar."""
    floor = charts.floor_bytes(plan["per_gpu"], stage=plan["stage"])
    return {
        "plan": plan,
        "floor_bytes": floor,
        "sweep": charts.sweep_chart(plan["sweep"], gpu_memory_bytes=plan["gpu_memory_bytes"], floor_bytes=floor),
        "composition": charts.stacked_shares(plan["per_gpu"], scale_bytes=plan["per_gpu"]["total_bytes"]),
    }
