"""The jobs and GPUs gauges of GET /metrics: zero1_jobs{status}, zero1_gpus_in_use, zero1_gpus_total,
zero1_steps_per_second and zero1_owner_gpus_in_use{owner}, read from the database at each scrape (the app
registers a JobGauges with its Telemetry once its runtime started)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from sqlalchemy import func, select

from service.scheduling.controls import gpus_by_owner
from service.schemas.fields import JobStatus
from service.store.db import Database
from service.store.job_repository import gpus_in_use
from service.store.tables import Job

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
