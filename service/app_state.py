"""The app's state: what the service runs while it is up: database, Ray cluster, job storage, launcher,
scheduler and code store.

May import: service.settings, service.telemetry, service.concurrency, service.store, service.planning,
service.intake, service.scheduling, service.experiments, service.tracking.
"""

from __future__ import annotations

import logging

from service.concurrency import Slots, follower_limits, task_limits
from service.experiments import sweeps
from service.intake.replans import Replanner
from service.planning.capacity import RayCluster
from service.planning.dataset_checks import DatasetChecker, token_store_of
from service.planning.traces import Tracer
from service.scheduling.ray_launcher import RayLauncher
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from service.store.code.stores import code_store
from service.store.db import Database, upgrade
from service.store.housekeeping import Housekeeper
from service.store.job_storage import JobStorage
from service.store.owner_uids import OwnerUids
from service.telemetry import Telemetry
from service.tracking.exporter import Exporter
from service.tracking.webhooks import Notifier, Webhooks

log = logging.getLogger(__name__)


class AppState:
    def __init__(
        self,
        settings: Settings,
        *,
        telemetry: Telemetry | None = None,
        cluster: RayCluster | None = None,
        storage: JobStorage | None = None,
        launcher: RayLauncher | None = None,
    ) -> None:
        """`cluster`, `storage` and `launcher` replace Ray's where given: the tests' fast lane runs the app,
        its scheduler and its database on stand-ins that start no Ray."""
        self.settings = settings
        self.db = Database(settings.database_url)
        self.cluster = cluster or RayCluster(settings)
        self.code = code_store(settings.checkpoint_uri, settings.shared_dir)
        self.owner_uids = OwnerUids(self.db, table=settings.run_as)
        """An owner -> the uid its children run under (ZERO1_RUN_AS), allocated from the range on first use."""
        self.storage = storage or JobStorage(settings, run_as=self.owner_uids)
        """Where each job's files live and what they hold: the launcher, scheduler, exporter and routes ask it."""
        self.launcher = launcher or RayLauncher(settings, storage=self.storage, code_uri=self.code.uri)
        self.housekeeper = Housekeeper(db=self.db, settings=settings, cache_dir=self.storage.dataset_cache_dir)
        self.task_slots = Slots(task_limits(settings))
        """Traces and dataset checks in flight (ZERO1_MAX_TASKS, ZERO1_MAX_TASKS_PER_USER)."""
        self.log_followers = Slots(follower_limits(settings))
        """Open log streams (ZERO1_MAX_LOG_FOLLOWERS, ZERO1_MAX_LOG_FOLLOWERS_PER_USER)."""
        self.tracer = Tracer(
            timeout_s=settings.plan_timeout_s, code_uri=self.code.uri, slots=self.task_slots, run_as=self.owner_uids
        )
        self.datasets = DatasetChecker(
            timeout_s=settings.data_timeout_s,
            slots=self.task_slots,
            run_as=self.owner_uids,
            token_cache=str(self.storage.dataset_cache_dir / "tokens"),
            token_store=token_store_of(settings.checkpoint_uri),
        )
        self.scheduler = Scheduler(
            db=self.db,
            launcher=self.launcher,
            storage=self.storage,
            total_gpus=lambda: self.cluster.capacity().num_gpus,
            interval_s=settings.scheduler_interval_s,
            idle_interval_s=settings.scheduler_idle_interval_s,
            start_timeout_s=settings.start_timeout_s,
            grow_interval_s=settings.elastic_grow_interval_s,
            sweep_interval_s=settings.placement_sweep_interval_s,
            telemetry=telemetry,
            advance_sweeps=sweeps.advance,
            replan=Replanner(settings, capacity=lambda: self.cluster.capacity(), tracer=self.tracer),
        )
        self.exporter = (
            None
            if settings.mlflow_tracking_uri is None
            else Exporter(db=self.db, settings=settings, storage=self.storage)
        )
        """Each job's MLflow run, exported in the background (ZERO1_MLFLOW_TRACKING_URI); None when unset."""
        self.webhooks = None if settings.webhook_url is None else Webhooks(db=self.db, settings=settings)
        """Each job's end POSTed in the background (ZERO1_WEBHOOK_URL); None when unset."""
        self.notifier = Notifier(db=self.db, settings=settings) if settings.webhook_notify_hosts else None
        """A job's end POSTed to its own notify URL (ZERO1_WEBHOOK_NOTIFY_HOSTS); None when no host is allowed."""

    def start(self) -> None:
        """Migrate the database, connect to (or start) Ray, start scheduling."""
        upgrade(self.settings.database_url)
        self.cluster.connect()
        self.scheduler.recover()
        self.scheduler.start()
        self.housekeeper.start()
        if self.exporter is not None:
            self.exporter.start()
        if self.webhooks is not None:
            self.webhooks.start()
        if self.notifier is not None:
            self.notifier.start()
        log.info("zero1 is up: %s", self.cluster.capacity())

    def stop(self) -> None:
        """Stop scheduling and drain the metrics the supervisors hold, then let Ray go."""
        if self.exporter is not None:
            self.exporter.stop()
        if self.webhooks is not None:
            self.webhooks.stop()
        if self.notifier is not None:
            self.notifier.stop()
        self.housekeeper.stop()
        self.scheduler.stop()
        self.cluster.disconnect()
        self.db.dispose()
