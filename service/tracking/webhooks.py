"""The webhook: a thread of the service that POSTs each job's end (succeeded, failed, cancelled,
stopped_early) and each sweep's end to ZERO1_WEBHOOK_URL as JSON, in the order the events were stored,
each once, resuming from its cursors (service.store.tables.WebhookCursor: one for the job events, one
for the sweep events) after a restart.

It reads the events in short transactions and POSTs with none open, from its own thread: a slow or
absent receiver never holds up the scheduler. While the receiver does not answer (no connection, a
timeout, a 5xx or a 429) it waits, doubling from 1 s to ZERO1_WEBHOOK_MAX_BACKOFF_S, and sends the
same event again; the events wait in the database meanwhile. An event the receiver refuses with
another 4xx is logged and passed over: sending it again would not change the answer.

Each body is signed with ZERO1_WEBHOOK_SECRET (`X-Zero1-Signature: sha256=<HMAC-SHA256 of the body,
hex>`), and names its event (`X-Zero1-Delivery`: a job event's id, `sweep-<id>` for a sweep event's; a
receiver that gets one twice, when the service stopped between a delivery and its record, drops the
second). Its `text` is a line a
Slack incoming webhook posts as it is.

A job's own `notify` URL (Notifier) is sent its end alone, the same body, signed the same way, while
ZERO1_WEBHOOK_NOTIFY_HOSTS names the hosts such a URL may name (checked at submit and again as it is
sent); it backs off as the webhook does, but passes an event over after MAX_TRIES.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading

import httpx
from pydantic import ValidationError
from sqlalchemy import func, select

from service.errors import ServiceError
from service.experiments import sweeps
from service.scheduling import controls
from service.schemas.fields import TERMINAL
from service.schemas.requests import JobSpec
from service.settings import Settings
from service.store.db import Database
from service.store.tables import Job, JobEvent, Sweep, SweepEvent, WebhookCursor
from service.tracking.backoff import Unreachable, run_until_stopped
from service.tracking.runs import job_url

log = logging.getLogger(__name__)

EVENTS_PER_PASS = 100
FIRST_WAIT_S = 1.0
"""Between passes, and the first wait of a backoff."""
MAX_TRIES = 6
"""A job's own URL that does not answer is tried so many times (backing off, up to about two minutes
with ZERO1_WEBHOOK_MAX_BACKOFF_S at 60), then its event is passed over."""
TIMEOUT_S = 10.0
"""How long one POST may take before it counts as not answered."""


def signature(body: bytes, secret: str) -> str:
    """The X-Zero1-Signature of `body`: sha256=<HMAC-SHA256 keyed by `secret`, hex>."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def slack_escaped(text: str) -> str:
    """`text` as Slack shows it literally: its control characters &, < and > escaped (a job's name
    is its submitter's: no <!channel> from it)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def payload(event: JobEvent, job: Job, *, settings: Settings) -> dict:
    """What the webhook is sent of a job's end."""
    done = 0 if job.step is None else job.step + 1
    loss = (job.latest or {}).get("loss")
    said = f"{done:,}/{job.steps:,} steps" + ("" if loss is None else f", loss {loss:.4g}")
    url = job_url(job.id, settings)
    return {
        "event": f"job.{event.to_status}",
        "delivery": event.id,
        "at": event.at.isoformat(),
        "reason": event.reason,
        "job": {
            "id": job.id,
            "name": job.name,
            "owner": job.owner,
            "status": event.to_status,
            "steps_done": done,
            "steps": job.steps,
            "tags": job.tags,
            "url": url,
        },
        "text": slack_escaped(f"zero1: job #{job.id} “{job.name}” {event.to_status} ({said}): {event.reason}")
        + f" <{url}|open>",
    }


def sweep_payload(event: SweepEvent, sweep: Sweep, session, *, settings: Settings) -> dict:
    """What the webhook is sent of a sweep's end: its trials' count by status and its best."""
    shown = sweeps.public(session, sweep)
    counts: dict[str, int] = {}
    for trial in shown.trials:
        counts[trial.status] = counts.get(trial.status, 0) + 1
    base = settings.public_url or f"http://{settings.host}:{settings.port}"
    url = f"{base.rstrip('/')}/sweeps/{sweep.id}"
    best = shown.best
    if best is None:
        said = "no trial succeeded"
    else:
        values = ", ".join(f"{path}={value}" for path, value in best.values.items())
        said = f"best trial {best.index} (job #{best.job_id}, {shown.metric} {best.metric:.4g}): {values}"
    trials = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    return {
        "event": f"sweep.{event.to_status}",
        "delivery": f"sweep-{event.id}",
        "at": event.at.isoformat(),
        "reason": event.reason,
        "sweep": {
            "id": sweep.id,
            "name": sweep.name,
            "owner": sweep.owner,
            "status": event.to_status,
            "trials": counts,
            "metric": shown.metric,
            "best": None if best is None else best.model_dump(mode="json"),
            "gpu_seconds": shown.gpu_seconds,
            "url": url,
        },
        "text": slack_escaped(f"zero1: sweep #{sweep.id} “{sweep.name}” {event.to_status} ({trials}); {said}")
        + f" <{url}|open>",
    }


def notify_url(job: Job, settings: Settings) -> str | None:
    """The job's own notify URL if its host is still allowed; None for a job without one."""
    if not settings.webhook_notify_hosts or job.spec.get("notify") is None:
        return None
    try:
        spec = JobSpec.model_validate(job.spec)
        controls.check_notify(spec, settings=settings)
    except (ValidationError, ServiceError) as error:
        log.warning("notify: job %s's URL is not sent to: %s", job.id, getattr(error, "message", error))
        return None
    return spec.notify


def post(http: httpx.Client, url: str, body: dict, *, secret: str | None, what: str) -> None:
    """POST `body` as JSON to `url`, signed with `secret` if given. Unreachable when the receiver did not
    answer (no connection, a timeout, a 5xx, a 429); another 4xx is logged: sending again would not help."""
    content = json.dumps(body, separators=(",", ":")).encode()
    event_id = body["delivery"]
    headers = {"Content-Type": "application/json", "X-Zero1-Event": body["event"], "X-Zero1-Delivery": str(event_id)}
    if secret is not None:
        headers["X-Zero1-Signature"] = signature(content, secret)
    try:
        response = http.post(url, content=content, headers=headers)
    except httpx.TransportError as error:
        raise Unreachable(f"event {event_id}: {type(error).__name__}") from error
    if response.status_code >= 500 or response.status_code == 429:
        raise Unreachable(f"event {event_id}: HTTP {response.status_code}")
    if response.status_code >= 400:
        log.warning("%s: event %s refused with HTTP %s; passed over", what, event_id, response.status_code)


class _Sender:
    """A thread that sends events after its cursors, and backs off while the receiver does not answer."""

    what = "webhook"

    def __init__(self, *, db: Database, settings: Settings, http: httpx.Client | None = None) -> None:
        self.db = db
        self.settings = settings
        self.secret = None if settings.webhook_secret is None else settings.webhook_secret.get_secret_value()
        self.http = http or httpx.Client(timeout=TIMEOUT_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def cursors(self) -> list[tuple[str, type[JobEvent] | type[SweepEvent]]]:
        raise NotImplementedError

    def run_once(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        for key, events in self.cursors():  # from the events after now, for a receiver new to this database
            self._cursor(key, events)
        self._thread = threading.Thread(target=self._loop, name=f"zero1-{self.what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT_S + 5)
        self.http.close()

    def _loop(self) -> None:
        max_s = self.settings.webhook_max_backoff_s
        run_until_stopped(
            self._stop, self.run_once, interval_s=FIRST_WAIT_S, max_backoff_s=max_s, log=log, what=self.what
        )

    def _job_ends(self, after: int) -> list[tuple[int, str | None, dict]]:
        """Each job end after `after`, in order: its event's id, the job's own notify URL (None if it has
        none, or names a host no longer allowed) and the body sent of it."""
        with self.db.session() as session:
            rows = session.execute(
                select(JobEvent, Job)
                .join(Job, Job.id == JobEvent.job_id)
                .where(JobEvent.id > after, JobEvent.to_status.in_(TERMINAL))
                .order_by(JobEvent.id)
                .limit(EVENTS_PER_PASS)
            ).all()
            return [
                (event.id, notify_url(job, self.settings), payload(event, job, settings=self.settings))
                for event, job in rows
            ]

    def _handled(self, key: str, event_id: int) -> None:
        with self.db.session() as session:
            session.get(WebhookCursor, key).event_id = event_id

    def _cursor(self, key: str, events: type[JobEvent] | type[SweepEvent]) -> int:
        """The last event of `events` handled; for a receiver new to this database, the newest event now
        (the ends before it was configured are not sent)."""
        with self.db.session() as session:
            cursor = session.get(WebhookCursor, key)
            if cursor is None:
                newest = session.scalar(select(func.coalesce(func.max(events.id), 0)))
                cursor = WebhookCursor(url_sha256=key, event_id=newest)
                session.add(cursor)
            return cursor.event_id


class Webhooks(_Sender):
    """ZERO1_WEBHOOK_URL: every job's end, and every sweep's."""

    def __init__(self, *, db: Database, settings: Settings, http: httpx.Client | None = None) -> None:
        assert settings.webhook_url is not None
        super().__init__(db=db, settings=settings, http=http)
        self.url = settings.webhook_url
        self.key = hashlib.sha256(self.url.encode()).hexdigest()
        self.sweeps_key = hashlib.sha256(f"sweeps {self.url}".encode()).hexdigest()
        """The cursor of the sweep events sent to the same URL."""

    def cursors(self) -> list[tuple[str, type[JobEvent] | type[SweepEvent]]]:
        return [(self.key, JobEvent), (self.sweeps_key, SweepEvent)]

    def run_once(self) -> bool:
        """Send the job ends after their cursor, then the sweep ends after theirs, each in order and
        recorded once the receiver took it (or refused it for good); whether more wait. Unreachable
        when the receiver did not answer."""
        ends = self._job_ends(self._cursor(self.key, JobEvent))
        more = self._deliver(self.key, [(event_id, body) for event_id, _, body in ends])
        after = self._cursor(self.sweeps_key, SweepEvent)
        with self.db.session() as session:
            rows = session.execute(
                select(SweepEvent, Sweep)
                .join(Sweep, Sweep.id == SweepEvent.sweep_id)
                .where(SweepEvent.id > after)
                .order_by(SweepEvent.id)
                .limit(EVENTS_PER_PASS)
            ).all()
            ends = [(event.id, sweep_payload(event, sweep, session, settings=self.settings)) for event, sweep in rows]
        return self._deliver(self.sweeps_key, ends) or more

    def _deliver(self, key: str, bodies: list[tuple[int, dict]]) -> bool:
        """POST each body in order, its event recorded under the cursor `key` once handled; whether a
        full page was sent (more may wait)."""
        for event_id, body in bodies:
            if self._stop.is_set():
                return False
            post(self.http, self.url, body, secret=self.secret, what=self.what)
            self._handled(key, event_id)
        return len(bodies) == EVENTS_PER_PASS


class Notifier(_Sender):
    """Each job's own `notify` URL, its end alone, while ZERO1_WEBHOOK_NOTIFY_HOSTS names hosts: one cursor
    over the job events for every such URL. A URL that does not answer is tried MAX_TRIES times, backing
    off between, then its event is passed over: one job's dead receiver holds up the others' for minutes,
    not for ever. The URL's host is checked again as it is sent (the hosts allowed may have changed)."""

    what = "notify"

    def __init__(self, *, db: Database, settings: Settings, http: httpx.Client | None = None) -> None:
        super().__init__(db=db, settings=settings, http=http)
        self.key = hashlib.sha256(b"notify: each job's own URL").hexdigest()
        self.tries: dict[int, int] = {}
        """Event id -> the tries that found its receiver unreachable."""

    def cursors(self) -> list[tuple[str, type[JobEvent] | type[SweepEvent]]]:
        return [(self.key, JobEvent)]

    def run_once(self) -> bool:
        sends = self._job_ends(self._cursor(self.key, JobEvent))
        for event_id, url, body in sends:
            if self._stop.is_set():
                return False
            if url is not None:
                self._send(event_id, url, body)
            self._handled(self.key, event_id)
        return len(sends) == EVENTS_PER_PASS

    def _send(self, event_id: int, url: str, body: dict) -> None:
        try:
            post(self.http, url, body, secret=self.secret, what=self.what)
        except Unreachable:
            tries = self.tries[event_id] = self.tries.get(event_id, 0) + 1
            if tries < MAX_TRIES:
                raise
            log.warning("notify: event %s: %s did not answer %s tries; passed over", event_id, url, tries)
        self.tries.pop(event_id, None)
