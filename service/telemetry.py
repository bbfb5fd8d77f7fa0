"""The service's Prometheus metrics: what GET /metrics renders.

`Telemetry` holds them in a registry of its own, one per app (never prometheus_client's process-wide
default: a test process builds many apps). HTTP latency is observed by `RequestTimer`, the scheduler's
work by the scheduler through Telemetry's methods (the GPU-seconds a poll's rows trained among them),
and the jobs and GPUs gauges and the GPU-seconds held are read from the database at each scrape by the
collectors the app registers (service/scheduling/gauges.py's JobGauges and UsageCounters), so a scrape
shows the database as it is.

The histograms' buckets, in seconds:

- `zero1_http_request_duration_seconds`: 5 ms to 60 s. A read answers in milliseconds; a plan that
  traces a model or a code upload takes seconds; an artifact download may take a minute.
- `zero1_job_duration_seconds`: 1 min to 7 days, from a smoke test to a week-long run.
- `zero1_scheduler_tick_duration_seconds`: 1 ms to 30 s. A tick is milliseconds; seconds mean Ray
  or the database is slow to answer, and the scheduler falls behind ZERO1_SCHEDULER_INTERVAL_S.
- `zero1_queue_wait_seconds`: 1 s to 2 days, from an idle cluster to a long queue.

May import: service.schemas.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.registry import Collector
from sqlalchemy import event
from sqlalchemy.orm import Session
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.schemas.fields import TERMINAL

try:  # newer FastAPI keeps an included router whole in app.routes; this lists its routes, prefixed
    from fastapi.routing import iter_route_contexts
except ImportError:  # older FastAPI copied them, prefixed, into app.routes
    iter_route_contexts = list

HTTP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
JOB_BUCKETS_S = (60, 300, 900, 1800, 3600, 2 * 3600, 4 * 3600, 8 * 3600, 12 * 3600, 86_400, 2 * 86_400, 7 * 86_400)
TICK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
QUEUE_BUCKETS_S = (1, 5, 15, 30, 60, 300, 900, 1800, 3600, 2 * 3600, 4 * 3600, 12 * 3600, 86_400, 2 * 86_400)

PREEMPT_OUTCOMES = ("checkpointed", "shrunk", "killed", "suspended")
"""How a preemption ended: the victim stopped at a step with a checkpoint, was shrunk to fewer GPUs, was
killed past ZERO1_PREEMPT_GRACE_S (it resumes from its last checkpoint), or was suspended."""

UNMATCHED = "<unmatched>"
"""The route label of a request no route matches (a 404, a slash redirect): never the raw path,
whose values are unbounded."""
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods labelled as sent; any other is "other" (a client may send any token)."""


class Telemetry:
    """The metrics, their registry, and a method for each thing the service observes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._collectors: dict[type, Collector] = {}
        self._request_s = Histogram(
            "zero1_http_request_duration_seconds",
            "HTTP requests, from the request in to the response's last byte, by method, route template and status.",
            ["method", "route", "status"],
            buckets=HTTP_BUCKETS_S,
            registry=self.registry,
        )
        self._job_s = Histogram(
            "zero1_job_duration_seconds",
            "Jobs that ran, from their start to their end, by outcome.",
            ["outcome"],
            buckets=JOB_BUCKETS_S,
            registry=self.registry,
        )
        for outcome in TERMINAL:  # every outcome scraped from the start, at 0
            self._job_s.labels(outcome)
        self._rows = Counter(
            "zero1_metric_rows_ingested", "Metric rows stored from the workers.", registry=self.registry
        )
        self._log_lines = Counter(
            "zero1_log_lines_ingested", "Log lines stored from the workers.", registry=self.registry
        )
        self._training_s = Counter(
            "zero1_gpu_seconds_training",
            "GPU-seconds of the training steps stored from the workers (each step_time_s x its N), by the job's "
            'owner (owner="" for jobs submitted while auth was off) and priority class (its priority).',
            ["owner", "priority_class"],
            registry=self.registry,
        )
        self._tick_s = Histogram(
            "zero1_scheduler_tick_duration_seconds",
            "Scheduler ticks that completed.",
            buckets=TICK_BUCKETS_S,
            registry=self.registry,
        )
        self._queue_s = Histogram(
            "zero1_queue_wait_seconds",
            "Jobs started, from their submission to their start.",
            buckets=QUEUE_BUCKETS_S,
            registry=self.registry,
        )

        self._preemptions = Counter(
            "zero1_preemptions",
            "Running jobs the scheduler stopped or shrank to free GPUs for another, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in PREEMPT_OUTCOMES:  # every outcome scraped from the start, at 0
            self._preemptions.labels(outcome)

    def register(self, collector: Collector) -> None:
        """Scrape `collector` from now on, in place of one of its type registered before: the jobs and
        GPUs gauges, read from the runtime's database once the app started (service/scheduling/gauges.py)."""
        previous = self._collectors.pop(type(collector), None)
        if previous is not None:
            self.registry.unregister(previous)
        self.registry.register(collector)
        self._collectors[type(collector)] = collector

    def render(self) -> bytes:
        """Every metric in Prometheus' text format (this reads the database)."""
        return generate_latest(self.registry)

    def request_took(self, method: str, *, route: str, status: int, duration_s: float) -> None:
        method = method if method in _METHODS else "other"
        self._request_s.labels(method, route, str(status)).observe(duration_s)

    def job_ended(self, outcome: str, *, duration_s: float) -> None:
        """A job that started reached `outcome` (succeeded, failed or cancelled) `duration_s` after its start."""
        assert outcome in TERMINAL, f"outcome {outcome!r} is not one of {TERMINAL}"
        self._job_s.labels(outcome).observe(duration_s)

    def rows_ingested(self, num_rows: int) -> None:
        self._rows.inc(num_rows)

    def log_lines_ingested(self, num_lines: int) -> None:
        self._log_lines.inc(num_lines)

    def ingested_on_commit(
        self,
        session: Session,
        *,
        num_rows: int,
        num_lines: int,
        owner: str | None = None,
        priority_class: int = 0,
        training_gpu_s: float = 0.0,
    ) -> None:
        """Count metric rows and log lines stored in `session` once it commits, and the GPU-seconds the
        rows trained under the job's owner and priority class: a transaction rolled back is never
        counted (its poll is stored, and counted, again)."""

        def count(_: Session) -> None:
            self.rows_ingested(num_rows)
            self.log_lines_ingested(num_lines)
            if training_gpu_s > 0:
                self._training_s.labels(owner or "", str(priority_class)).inc(training_gpu_s)

        event.listen(session, "after_commit", count, once=True)

    def tick_took(self, duration_s: float) -> None:
        self._tick_s.observe(duration_s)

    def queue_waited(self, duration_s: float) -> None:
        self._queue_s.observe(duration_s)

    def preempted(self, outcome: str) -> None:
        """A preemption ended in `outcome` (one of PREEMPT_OUTCOMES)."""
        assert outcome in PREEMPT_OUTCOMES, f"outcome {outcome!r} is not one of {PREEMPT_OUTCOMES}"
        self._preemptions.labels(outcome).inc()


class RequestTimer:
    """ASGI middleware: observes each HTTP request's seconds, until its response's last byte, by route template.

    Pure ASGI, so a streamed response passes through message by message, never buffered. The
    template is found before the app runs (routing rewrites the scope: a mount's root_path).
    """

    def __init__(self, app: ASGIApp, *, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry
        self._routes: list[BaseRoute] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._routes is None:  # all routes are added by the first request
            self._routes = list(iter_route_contexts(scope["app"].routes))
        route = route_template(self._routes, scope)
        status = 500  # what ServerErrorMiddleware answers for an exception raised before a response started
        started = time.perf_counter()

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            duration_s = time.perf_counter() - started
            self.telemetry.request_took(scope["method"], route=route, status=status, duration_s=duration_s)


def route_template(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The path template of the route that serves `scope`, chosen as the router chooses: the first full
    match, else the first that matches the path but not the method (a 405); UNMATCHED if none."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path_format", UNMATCHED)
        if match is Match.PARTIAL and partial is None:
            partial = getattr(route, "path_format", UNMATCHED)
    return partial or UNMATCHED
