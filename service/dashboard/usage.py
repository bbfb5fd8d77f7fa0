"""The usage page (/usage): GPU-hours held and spent training by owner and priority class over a period the
reader picks, and each owner's GPUs and usage against their quota, as GET /v1/usage answers
(service/scheduling/usage.py). Server-rendered from a GET form, so a period has a URL and the page reads
without JavaScript; the reader sees what the API shows them (an admin: everyone's)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import TypeAdapter, ValidationError

from service.api.deps import ReaderDep, SessionDep, SettingsDep
from service.dashboard.routes import templates
from service.errors import ServiceError
from service.scheduling import usage
from service.schemas.usage import IsoTime
from service.store.tables import utcnow

router = APIRouter(include_in_schema=False)

_MOMENT = TypeAdapter(IsoTime)
FORM_TIME = "%Y-%m-%dT%H:%M"
"""How the form writes a time (an <input type="datetime-local">'s value, read as UTC)."""


def asked_time(name: str, text: str | None) -> datetime | None:
    """A time the form gave (ISO 8601; without a zone, UTC), None when blank; a ServiceError naming the field
    for text that is no time."""
    if text is None or not text.strip():
        return None
    try:
        return _MOMENT.validate_python(text.strip())
    except ValidationError as error:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ServiceError(f"{name}: {error.errors()[0]['msg']} (got {shown!r})", status_code=422) from None


def presets(now: datetime) -> list[tuple[str, str]]:
    """(label, query) of the periods a click away: this month, the last, the last 7 days and 24 hours."""
    this_month = usage.month_start(now)
    last_month = usage.month_start(this_month - timedelta(days=1))
    periods = [
        ("This month", this_month, None),
        ("Last month", last_month, this_month),
        ("Last 7 days", now - timedelta(days=7), None),
        ("Last 24 hours", now - timedelta(hours=24), None),
    ]
    return [
        (label, f"since={since.strftime(FORM_TIME)}" + (f"&until={until.strftime(FORM_TIME)}" if until else ""))
        for label, since, until in periods
    ]


def hours(seconds: float | None) -> str:
    """GPU-seconds as GPU-hours, grouped, to two decimals."""
    return "—" if seconds is None else f"{seconds / 3600:,.2f}"


@router.get("/usage", response_class=HTMLResponse)
def usage_page(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    principal: ReaderDep,
    since: str | None = None,
    until: str | None = None,
):
    """The reader's usage (an admin's: everyone's) over ?since= to ?until= (default: this month to now), a
    table per owner and priority class, and the quotas; a period that is not one is the form with its error
    (422), as GET /v1/usage answers it."""
    now = utcnow()
    context = {
        "page": "usage",
        "form": {"since": since or "", "until": until or ""},
        "presets": presets(now),
        "report": None,
        "error": None,
        "hours": hours,
    }
    try:
        start, end = usage.period(asked_time("since", since), asked_time("until", until), now=now)
    except ServiceError as error:
        return templates.TemplateResponse(request, "usage.html", context | {"error": error.message}, status_code=422)
    if not since:
        context["form"]["since"] = start.astimezone(UTC).strftime(FORM_TIME)
    report = usage.report(session, principal=principal, settings=settings, since=start, until=end, now=now)
    return templates.TemplateResponse(request, "usage.html", context | {"report": report})
