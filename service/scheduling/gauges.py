"""What GET /metrics reads from the database at each scrape (the app registers both with its Telemetry
once its runtime started): the jobs and GPUs gauges, zero1_jobs{status}, zero1_gpus_in_use,
zero1_gpus_total, zero1_steps_per_second and zero1_owner_gpus_in_use{owner} (JobGauges), and the
counter zero1_gpu_seconds_held_total{owner,priority_class} (UsageCounters)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from sqlalchemy import func, select

from service.scheduling import usage
from service.scheduling.controls import gpus_by_owner
from service.schemas.fields import JobStatus
from service.store.db import Database
from service.store.job_repository import gpus_in_use
from service.store.tables import Job, utcnow

_GAUGES = {
    "zero1_jobs": "Jobs by status.",
    "zero1_gpus_in_use": "GPUs held by starting, running and restarting jobs.",
    "zero1_gpus_total": "GPUs in the cluster.",
    "zero1_steps_per_second": "Training steps per second, summed over running jobs.",
    "zero1_owner_gpus_in_use": "GPUs held by each owner's starting, running and restarting jobs; "
    'owner="" for jobs submitted while auth was off; 0 for an owner whose jobs all wait (queued, suspended).',
}


class JobGauges:
    """A collector of zero1_jobs{status}, zero1_gpus_in_use, zero1_gpus_total, zero1_steps_per_second and
    zero1_owner_gpus_in_use{owner}, read from `db` at each scrape."""

    def __init__(self, db: Database, *, total_gpus: Callable[[], int]) -> None:
        self._db = db
        self._total_gpus = total_gpus

    def describe(self) -> list[Metric]:
        """The names, without reading the database: the registry refuses another collector of the same names."""
        return [GaugeMetricFamily(name, text) for name, text in _GAUGES.items()]

    def collect(self) -> Iterator[Metric]:
        with self._db.session() as session:
            counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
            running = session.scalars(select(Job.latest).where(Job.status == "running")).all()
            num_in_use = gpus_in_use(session)
            by_owner = {owner or "": gpus for owner, (gpus, _) in gpus_by_owner(session).items()}
        jobs = GaugeMetricFamily("zero1_jobs", _GAUGES["zero1_jobs"], labels=["status"])
        for status in JobStatus.__args__:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        yield GaugeMetricFamily("zero1_gpus_in_use", _GAUGES["zero1_gpus_in_use"], value=num_in_use)
        yield GaugeMetricFamily("zero1_gpus_total", _GAUGES["zero1_gpus_total"], value=self._total_gpus())
        steps_per_s = sum(1 / row["step_time_s"] for row in running if row and row.get("step_time_s"))
        yield GaugeMetricFamily("zero1_steps_per_second", _GAUGES["zero1_steps_per_second"], value=steps_per_s)
        owners = GaugeMetricFamily("zero1_owner_gpus_in_use", _GAUGES["zero1_owner_gpus_in_use"], labels=["owner"])
        for owner, num_gpus in sorted(by_owner.items()):
            owners.add_metric([owner], num_gpus)
        yield owners


_HELD = (
    "GPU-seconds held by starting, running and restarting jobs (each attempt's N x its seconds), since the "
    'service started, by the job\'s owner (owner="" for jobs submitted while auth was off) and priority class.'
)


class UsageCounters:
    """zero1_gpu_seconds_held_total{owner,priority_class}: at each scrape, the GPU-seconds held since the last
    (service/scheduling/usage.py, from the jobs' events, the window [last scrape, now)) are added to the
    totals, each under its job's owner and priority class as they are at that scrape. A window's seconds are
    never negative, so the counter only grows; it counts from the service's start (the first window's), as
    the other counters do. A span whose end is committed after a scrape that counted it as still held keeps
    those seconds (at most a transaction's duration)."""

    def __init__(self, db: Database, *, clock: Callable[[], datetime] = utcnow) -> None:
        self._db = db
        self._clock = clock
        self._lock = threading.Lock()  # one window at a time: two scrapes never count the same seconds
        self._since = clock()
        self._held: dict[tuple[str, str], float] = defaultdict(float)

    def describe(self) -> list[Metric]:
        """The name, without reading the database."""
        return [CounterMetricFamily("zero1_gpu_seconds_held", _HELD, labels=["owner", "priority_class"])]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = self._clock()
            if now > self._since:
                with self._db.session() as session:
                    jobs = usage.usage_by_job(session, since=self._since, until=now, now=now, training=False)
                for job in jobs.values():
                    if job.held > 0:
                        self._held[(job.owner or "", str(job.priority))] += job.held
                self._since = now
            totals = sorted(self._held.items())
        family = CounterMetricFamily("zero1_gpu_seconds_held", _HELD, labels=["owner", "priority_class"])
        for (owner, priority_class), value in totals:
            family.add_metric([owner, priority_class], value)
        yield family
