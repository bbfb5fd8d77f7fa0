"""The experiment pages: jobs side by side (/compare?jobs=1,2,3), the sweeps (/sweeps) and one sweep
(/sweeps/{id}).

Server-rendered as routes.py's pages: the tables read without JavaScript; the curves and scatters are
static/charts.js's (uPlot, vendored), drawn from JSON the page carries (curves.series). A job the reader may
not see, or that does not exist, is left out of a comparison, counted but never named; a sweep is its
owner's and admins' only, as GET /v1/sweeps/{id} answers (service/api/routes/sweeps.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from service.api.deps import ReaderDep, SessionDep
from service.auth import Principal
from service.dashboard.curves import job_curves, series
from service.dashboard.routes import page_job_id, templates
from service.errors import ServiceError
from service.experiments import sweeps
from service.schemas.sweeps import SweepPublic, SweepSpec
from service.store import job_repository
from service.store.tables import Job

router = APIRouter(include_in_schema=False)

MAX_COMPARED = 12
"""Jobs a comparison draws: the first this many ids of ?jobs= (twelve lines on a chart are already many)."""
SWEEPS_LIMIT = 100
"""Sweeps the list shows, newest first."""
HEADED = ("name",)
"""Spec paths each column's heading already shows, left out of the differing fields."""
LOG_SPAN = 10
"""A searched field's scatter has a log x scale when its largest value is more than this times its least."""
_MISSING = object()


# --------------------------------------------------------------------------- compare


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A spec by dotted path: {"optimizer": {"lr": 0.1}} -> {"optimizer.lr": 0.1}; a list or an empty object
    is one value."""
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, child in value.items():
            flat |= flatten(child, f"{prefix}.{key}" if prefix else str(key))
        return flat
    return {prefix: value}


def shown(value: Any) -> str:
    """A spec value in a table cell: text as it is, anything else as JSON writes it; '—' where a spec has none."""
    if value is _MISSING:
        return "—"
    return value if isinstance(value, str) else json.dumps(value)


def differing_fields(specs: list[dict]) -> list[tuple[str, list[str]]]:
    """(path, each spec's value shown) for every dotted path whose values are not all equal, in the order
    the specs first name them; a path one spec lacks differs."""
    flats = [flatten(spec) for spec in specs]
    paths = list(dict.fromkeys(path for flat in flats for path in flat))
    rows = []
    for path in paths:
        if path in HEADED:
            continue
        values = [flat.get(path, _MISSING) for flat in flats]
        if any(v is _MISSING for v in values) or any(v != values[0] for v in values):
            rows.append((path, [shown(v) for v in values]))
    return rows


def asked_ids(text: str) -> list[str]:
    """The ids ?jobs= names, comma-separated, each once, in order (text that is no id is kept, to be left out)."""
    return list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))


def compared_jobs(session: Session, asked: list[str], *, principal: Principal) -> tuple[list[Job], int]:
    """The jobs of `asked` the reader may see, in its order, and how many were left out (not an id, no such
    job, or another's: told apart to nobody)."""
    jobs = []
    for text in asked:
        if (number := page_job_id(text)) is None:
            continue
        try:
            jobs.append(job_repository.get_visible_job(session, number, principal=principal))
        except ServiceError:
            continue
    return jobs, len(asked) - len(jobs)


def job_label(job: Job) -> str:
    return f"job {job.id} {job.name}"


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, session: SessionDep, principal: ReaderDep, jobs: str = ""):
    """Loss, eval loss and lr of each job overlaid, one series a job, and the spec fields that differ."""
    asked = asked_ids(jobs)
    jobs_shown, left_out = compared_jobs(session, asked[:MAX_COMPARED], principal=principal)
    data = [series(job, job_curves(session, job), label=job_label(job)) for job in jobs_shown]
    context = {
        "page": "compare",
        "jobs": jobs_shown,
        "left_out": left_out,
        "num_asked": len(asked),
        "max_compared": MAX_COMPARED,
        "differing": differing_fields([job.spec for job in jobs_shown]) if len(jobs_shown) > 1 else [],
        "chart_data": {
            "series": data,
            "overlays": [
                {"figure": "loss-figure", "steps": "steps", "values": "loss"},
                {"figure": "eval-figure", "steps": "eval_steps", "values": "eval_loss"},
                {"figure": "lr-figure", "steps": "steps", "values": "lr"},
            ],
            "scatters": [],
        },
    }
    return templates.TemplateResponse(request, "compare.html", context)


# --------------------------------------------------------------------------- sweeps


def trial_curves(session: Session, public: SweepPublic) -> list[dict]:
    """Each trial's job's curves, for those with rows of the sweep's metric, labelled by trial and job."""
    drawn = []
    for trial in public.trials:
        if trial.job_id is None or (job := session.get(Job, trial.job_id)) is None:
            continue
        curves = job_curves(session, job)
        rows = curves.evaluated if public.metric == "eval_loss" else curves.metrics
        if rows:
            drawn.append(series(job, curves, label=f"trial {trial.index} · job {job.id}"))
    return drawn


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def field_scatter(path: str, public: SweepPublic) -> dict:
    """A searched field's value against each trial's metric, for the trials with one; the best marked. A field
    with a value that is no number is drawn by category (its values' places, labelled); one whose positive
    values span more than LOG_SPAN times is drawn on a log scale."""
    best = public.best.index if public.best else None
    trials = [t for t in public.trials if t.metric is not None and math.isfinite(t.metric) and path in t.values]
    values = [t.values[path] for t in trials]
    categories = None
    if not all(_number(v) for v in values):
        categories = sorted({shown(v) for v in values})
        values = [categories.index(shown(v)) for v in values]
    positive = categories is None and values and min(values) > 0
    return {
        "path": path,
        "metric": public.metric,
        "log": bool(positive and max(values) > LOG_SPAN * min(values)),
        "categories": categories,
        "points": [
            {"x": x, "y": t.metric, "trial": t.index, "best": t.index == best}
            for x, t in zip(values, trials, strict=True)
        ],
    }


def sweep_chart_data(session: Session, public: SweepPublic, *, paths: list[str]) -> dict:
    steps, values = ("eval_steps", "eval_loss") if public.metric == "eval_loss" else ("steps", "loss")
    return {
        "series": trial_curves(session, public),
        "overlays": [{"figure": "trials-figure", "steps": steps, "values": values}],
        "scatters": [{"figure": f"field-{i}", **field_scatter(path, public)} for i, path in enumerate(paths)],
    }


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: str, session: SessionDep, principal: ReaderDep):
    """The trials' curves overlaid, their table (the best marked), and each searched field against the metric;
    its owner's and admins' only: to others the not-found page, as GET /v1/sweeps/{id} answers them."""
    try:
        if (number := page_job_id(sweep_id)) is None:
            raise ServiceError(f"no sweep with id {sweep_id}", status_code=404, error="not_found")
        sweep = sweeps.get_visible_sweep(session, number, principal)
    except ServiceError as error:
        return templates.TemplateResponse(request, "not_found.html", {"message": error.message}, status_code=404)
    public = sweeps.public(session, sweep)
    paths = list(SweepSpec.model_validate(sweep.spec).space)
    job_ids = [t.job_id for t in public.trials if t.job_id is not None]
    context = {
        "page": "sweep",
        "sweep": public,
        "paths": paths,
        "compare_ids": ",".join(str(i) for i in job_ids),
        "num_jobs": len(job_ids),
        "max_compared": MAX_COMPARED,
        "chart_data": sweep_chart_data(session, public, paths=paths),
    }
    return templates.TemplateResponse(request, "sweep.html", context)


@router.get("/sweeps", response_class=HTMLResponse)
def sweeps_page(request: Request, session: SessionDep, principal: ReaderDep):
    """The reader's sweeps (an admin's: everyone's), newest first, as GET /v1/sweeps lists them."""
    listed = [sweeps.public(session, sweep) for sweep in sweeps.visible_sweeps(session, principal, limit=SWEEPS_LIMIT)]
    context = {"page": "sweeps", "sweeps": listed, "limit": SWEEPS_LIMIT}
    return templates.TemplateResponse(request, "sweeps.html", context)
