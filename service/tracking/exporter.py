"""The MLflow exporter: a thread of the service that makes each job an MLflow run and sends it what
the database holds (its spec as params, its metric rows, its status, final/'s files), resuming from
the job's cursor (service.store.tables.MlflowRun), so a service restart sends nothing twice.

It reads rows in short transactions and calls MLflow with none open: a slow or absent MLflow never
holds up the scheduler's writes, so it never slows a job, nor fails one. While MLflow does not
answer, it waits, doubling from ZERO1_MLFLOW_INTERVAL_S to ZERO1_MLFLOW_MAX_BACKOFF_S, and then
catches up: the rows are in the database meanwhile. A request MLflow refuses (a 4xx) backs off that
job alone, and its cursor says why.

Each owner's runs go to an experiment of its own (runs.experiment_name). A sweep's trial's run is nested
under the sweep's parent run, which the pass ends after the sweep (sweep_runs). What it logs or stores of an
MLflow error has the tracking URI's credentials cut out (service/tracking/uris.py).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from functools import partial
from pathlib import Path

from sqlalchemy import case, select
from sqlalchemy.orm import Session

from service.settings import Settings
from service.store.artifacts import ArtifactChanged, FinalFile, JobDir, Refused, recorded_artifacts, stream_artifact
from service.store.db import Database
from service.store.job_storage import JobStorage
from service.store.tables import Job, Metric, MlflowRun
from service.tracking import runs
from service.tracking.backoff import Unreachable, run_until_stopped
from service.tracking.mlflow_client import MAX_METRICS_PER_BATCH, Mlflow, is_unreachable
from service.tracking.sweep_runs import SweepRuns
from service.tracking.uris import scrubbed

log = logging.getLogger(__name__)

ROWS_PER_BATCH = MAX_METRICS_PER_BATCH // runs.POINTS_PER_ROW
JOBS_PER_PASS = 100
SLICE_S = 2.0
"""How long one job's catching up may go on before the next job's turn (the pass then goes round again)."""


def _ms(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp() * 1000)


class Exporter:
    def __init__(self, *, db: Database, settings: Settings, storage: JobStorage, mlflow: Mlflow | None = None) -> None:
        assert settings.mlflow_tracking_uri is not None
        self.db = db
        self.settings = settings
        self.storage = storage  # where each job's final/ is read
        self.mlflow = mlflow or Mlflow(settings.mlflow_tracking_uri)
        self._experiments: dict[str, str] = {}  # name -> id, as found or made
        self.sweeps = SweepRuns(db=db, mlflow=self.mlflow)  # each sweep's parent run
        self._retry_at: dict[
            tuple[str, int], tuple[float, float]
        ] = {}  # a job or sweep MLflow refused: when next, and its wait
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="zero1-mlflow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        settings = self.settings
        run_until_stopped(
            self._stop,
            self.run_once,
            interval_s=settings.mlflow_interval_s,
            max_backoff_s=settings.mlflow_max_backoff_s,
            log=log,
            what="mlflow",
            said=self._said,
        )

    # ----------------------------------------------------------------------- one pass

    def run_once(self) -> bool:
        """One pass over the jobs not fully exported, active ones first, then the ended sweeps' parent
        runs (sweep_runs); whether work is left."""
        more = False
        for job, cursor in self._pending():
            if self._stop.is_set():
                return False
            more |= self._attempt(("job", job.id), partial(self._export, job, cursor), partial(self._note, job.id))
        for sweep_id in self.sweeps.ending():
            if self._stop.is_set():
                return False
            note = partial(self._note_sweep, sweep_id)
            more |= self._attempt(("sweep", sweep_id), partial(self.sweeps.end, sweep_id), note)
        return more

    def _attempt(self, key: tuple[str, int], work: Callable[[], bool], note: Callable[[str], None]) -> bool:
        """work() for a job or a sweep unless it waits out a refusal; a refusal (4xx) backs off that one
        alone, doubling, and its cursor says why; an unanswered request stops the pass (Unreachable)."""
        retry = self._retry_at.get(key)
        if retry is not None and time.monotonic() < retry[0]:
            return False
        try:
            more = work()
        except Unreachable:
            raise
        except Exception as error:
            note(f"{type(error).__name__}: {self._said(error)}"[:2000])
            if is_unreachable(error):
                raise Unreachable(f"{key[0]} {key[1]}: {self._said(error)}") from error
            wait = min(2 * retry[1], self.settings.mlflow_max_backoff_s) if retry else self.settings.mlflow_interval_s
            self._retry_at[key] = (time.monotonic() + wait, wait)
            log.warning("mlflow: %s %s refused (%s); trying it again in %.3g s", *key, self._said(error), wait)
            return False
        self._retry_at.pop(key, None)
        return more

    def _said(self, error: BaseException) -> str:
        """The error's message as it may be logged or stored: no credential of the tracking URI."""
        return scrubbed(str(error), uri=self.settings.mlflow_tracking_uri)

    def _experiment(self, owner: str | None) -> str:
        """The id of `owner`'s experiment (runs.experiment_name), found or made once."""
        name = runs.experiment_name(owner, self.settings)
        if name not in self._experiments:
            try:
                self._experiments[name] = self.mlflow.experiment_id(name)
            except Exception as error:
                raise Unreachable(f"no experiment {name!r}: {self._said(error)}") from error
        return self._experiments[name]

    def _pending(self) -> list[tuple[Job, MlflowRun]]:
        """The jobs whose runs are not done, each with its cursor (made here for a job without one)."""
        terminal = case((Job.status.in_(tuple(runs.RUN_STATUS)), 1), else_=0)
        with self.db.session() as session:
            found = session.execute(
                select(Job, MlflowRun)
                .outerjoin(MlflowRun, MlflowRun.job_id == Job.id)
                .where((MlflowRun.done.is_(None)) | (MlflowRun.done.is_(False)))
                .order_by(terminal, Job.id)
                .limit(JOBS_PER_PASS)
            ).all()
            pairs = []
            for job, cursor in found:
                if cursor is None:
                    cursor = MlflowRun(job_id=job.id, artifacts_done=False, done=False)
                    session.add(cursor)
                pairs.append((job, cursor))
        return pairs

    def _export(self, job: Job, cursor: MlflowRun) -> bool:
        """Bring the job's run up to the database; whether more is left after this job's slice."""
        if cursor.run_id is None:
            experiment_id = self._experiment(job.owner)
            nested = self.sweeps.tags_for(job, experiment_id=experiment_id)  # a sweep's trial: under its parent
            cursor.run_id = self.mlflow.find_or_create_run(
                experiment_id,
                key=runs.job_key(job),
                name=job.name,
                start_time_ms=_ms(job.created_at),
                tags=runs.run_tags(job, self.settings) | nested,
                params=runs.flat_params(job.spec),
            )
            self._save(job.id, experiment_id=experiment_id, run_id=cursor.run_id, status=job.status)
        elif cursor.status != job.status:
            self.mlflow.set_tags(cursor.run_id, {"zero1.status": job.status})
            self._save(job.id, status=job.status)
        deadline = time.monotonic() + SLICE_S
        while rows := self._rows(job.id, after_step=cursor.step):
            if cursor.batch_time_ms is None:  # kept until MLflow took the batch: a resend is the same points
                cursor.batch_time_ms = int(time.time() * 1000)
                self._save(job.id, batch_time_ms=cursor.batch_time_ms)
            points = [(name, value, row.step) for row in rows for name, value in runs.row_points(row).items()]
            self.mlflow.log_points(cursor.run_id, points, timestamp_ms=cursor.batch_time_ms)
            cursor.step = rows[-1].step
            cursor.batch_time_ms = None
            self._save(job.id, step=cursor.step, batch_time_ms=None, last_error=None)
            if time.monotonic() > deadline:
                return True
        if job.status not in runs.RUN_STATUS:
            return False
        if job.status == "succeeded" and not cursor.artifacts_done:
            self._upload_final(job, cursor.run_id)
            self._save(job.id, artifacts_done=True)
        self.mlflow.terminate(cursor.run_id, status=runs.RUN_STATUS[job.status], end_time_ms=_ms(job.finished_at))
        self._save(job.id, done=True, last_error=None)
        log.info("mlflow: job %s exported as run %s (%s)", job.id, cursor.run_id, job.status)
        return False

    def _rows(self, job_id: int, *, after_step: int | None) -> list[Metric]:
        """The next surviving rows past the cursor, in step order, one per step (a step redone after
        a retry or a resize keeps the point first sent: the same loss, as resumes are exact)."""
        with self.db.session() as session:
            rows = session.scalars(
                select(Metric)
                .where(
                    Metric.job_id == job_id,
                    Metric.superseded.is_(False),
                    Metric.step > (-1 if after_step is None else after_step),
                )
                .order_by(Metric.step, Metric.attempt)
                .limit(ROWS_PER_BATCH)
            ).all()
            session.expunge_all()
        return list({row.step: row for row in reversed(rows)}.values())[::-1]

    def _upload_final(self, job: Job, run_id: str) -> None:
        """final/'s recorded files to the run's final/, each copied as the downloads serve it (hashed
        while read, so a file changed since it was recorded is not sent)."""
        job_dir = self.storage.checkpoint_dir(job)
        with self.db.session() as session:
            files = recorded_artifacts(session, session.get(Job, job.id), job_dir=job_dir)
        with tempfile.TemporaryDirectory(prefix="zero1-mlflow-") as scratch:
            for file in files:
                path = Path(scratch) / file.name
                if self._copy(job, job_dir, file, path):
                    self.mlflow.log_file(run_id, path, folder="final")
                    path.unlink()

    @staticmethod
    def _copy(job: Job, job_dir: JobDir, file: FinalFile, path: Path) -> bool:
        try:
            with path.open("wb") as out:
                for piece in stream_artifact(job.id, job_dir, file, first=0, last=file.bytes - 1):
                    out.write(piece)
        except (ArtifactChanged, Refused, OSError) as error:
            log.warning("mlflow: job %s: artifact %r not sent: %s", job.id, file.name, error)
            return False
        return True

    def _save(self, job_id: int, **values: object) -> None:
        with self.db.session() as session:
            _update(session, job_id, values)

    def _note(self, job_id: int, error: str) -> None:
        try:
            self._save(job_id, last_error=error)
        except Exception:
            log.exception("mlflow: could not note job %s's error", job_id)

    def _note_sweep(self, sweep_id: int, error: str) -> None:
        try:
            self.sweeps.save(sweep_id, last_error=error)
        except Exception:
            log.exception("mlflow: could not note sweep %s's error", sweep_id)


def _update(session: Session, job_id: int, values: dict[str, object]) -> None:
    row = session.get(MlflowRun, job_id)
    for name, value in values.items():
        setattr(row, name, value)
