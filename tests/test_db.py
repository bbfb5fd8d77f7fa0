"""The migrations against the models, and the schema's constraints, on SQLite and PostgreSQL.

Packages: service.store.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import delete, func, inspect, select
from sqlalchemy.exc import IntegrityError, StatementError

from service.store.db import Database, alembic_config, downgrade, make_engine, upgrade
from service.store.tables import Base, CodeBundle, Job, JobEvent, Metric

TABLES = {
    "jobs",
    "job_events",
    "metrics",
    "logs",
    "code_bundles",
    "artifacts",
    "mlflow_runs",
    "owner_uids",
    "job_tags",
    "job_dependencies",
    "webhook_cursors",
    "sweeps",
    "sweep_trials",
    "mlflow_sweep_runs",
    "sweep_events",
    "alembic_version",
}
GIB = 2**30


def _job(name: str = "gpt-small", **overrides) -> Job:
    fields = {
        "name": name,
        "status": "queued",
        "spec": {"model": {"name": "gpt2", "layers": 12}, "dtype": "bf16", "lr": 3e-4},
        "plan": {"num_gpus": 4, "per_gpu_bytes": [30 * GIB, 30 * GIB], "fits": True},
        "num_gpus": 4,
        "steps": 100,
    }
    return Job(**(fields | overrides))


def _metric(job_id: int, *, step: int, attempt: int = 0) -> Metric:
    return Metric(
        job_id=job_id,
        attempt=attempt,
        step=step,
        loss=10.0 / (step + 3),
        grad_norm=None if step == 0 else 0.1 * step,
        loss_scale=65536.0,
        skipped=step == 0,
        step_time_s=0.25,
        tokens_per_s=1.5e5,
        mem_peak_bytes=[40 * GIB + step, 41 * GIB, 39 * GIB, 40 * GIB],
        mem_planned_bytes=42 * GIB,
    )


def _schema(url: str) -> tuple[set[str], str | None]:
    """The tables on `url` and its Alembic revision, read through a fresh engine."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            revision = MigrationContext.configure(connection).get_current_revision()
            return set(inspect(connection).get_table_names()), revision
    finally:
        engine.dispose()


HEAD = "0024"


def _count(database: Database, model: type[Base], job_id: int) -> int:
    with database.session() as session:
        return session.scalar(select(func.count()).select_from(model).where(model.job_id == job_id))


def test_one_linear_history(database_url):
    script = ScriptDirectory.from_config(alembic_config(database_url))
    assert script.get_heads() == [HEAD]
    revisions = [r.revision for r in script.walk_revisions()]  # head first, each down to the one before
    assert (
        revisions
        == [
            "0024",
            "0023",
            "0022",
            "0021",
            "0020",
            "0019",
            "0018",
            "0017",
            "0016",
            "0015",
            "0014",
            "0013",
            "0012",
            "0011",
            "0010",
            "0009",
            "0008",
            "0007",
            "0006",
            "0005",
            "0004",
            "0003",
            "0002",
            "0001",
        ]
        and script.get_revision("0001").down_revision is None
    )


def test_migrations_match_the_models(database):
    with database.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        differences = compare_metadata(context, Base.metadata)
    assert differences == []


def test_downgrade_to_base_then_upgrade_again(database_url):
    upgrade(database_url)
    assert _schema(database_url) == (TABLES, HEAD)

    downgrade(database_url)
    assert _schema(database_url) == ({"alembic_version"}, None)

    upgrade(database_url)
    assert _schema(database_url) == (TABLES, HEAD)


def test_round_trip_through_a_session(database):
    with database.session() as session:
        job = _job(idempotency_key="key-1", request_hash="ab" * 32)
        session.add(job)
        session.flush()
        session.add_all(
            [
                JobEvent(job_id=job.id, from_status=None, to_status="queued", reason="submitted"),
                JobEvent(job_id=job.id, from_status="queued", to_status="running", reason="placed on 4 GPUs"),
            ]
        )
        session.add_all([_metric(job.id, step=step) for step in range(3)])
        job_id = job.id

    with database.session() as session:
        stored = session.get(Job, job_id)
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
        metrics = session.scalars(select(Metric).where(Metric.job_id == job_id).order_by(Metric.step)).all()

    assert stored.spec == _job().spec
    assert stored.plan == _job().plan
    assert (stored.attempt, stored.step, stored.latest, stored.error) == (0, None, None, None)
    assert stored.cancel_requested is False
    assert stored.idempotency_key == "key-1"
    assert stored.created_at.tzinfo is not None
    assert abs(datetime.now(UTC) - stored.created_at) < timedelta(minutes=5)
    assert [(e.from_status, e.to_status, e.reason) for e in events] == [
        (None, "queued", "submitted"),
        ("queued", "running", "placed on 4 GPUs"),
    ]
    assert all(event.at.tzinfo is not None for event in events)
    assert [m.step for m in metrics] == [0, 1, 2]
    for metric in metrics:
        expected = _metric(job_id, step=metric.step)
        assert metric.loss == expected.loss
        assert metric.grad_norm == expected.grad_norm
        assert (metric.loss_scale, metric.step_time_s, metric.tokens_per_s) == (65536.0, 0.25, 1.5e5)
        assert metric.skipped is (metric.step == 0)
        assert metric.superseded is False
        assert metric.mem_peak_bytes == expected.mem_peak_bytes
        assert metric.mem_planned_bytes == 42 * GIB  # past 32 bits


def test_aware_datetimes_keep_their_instant(database):
    """A time given in another zone comes back as the same instant."""
    started_at = datetime(2026, 3, 1, 17, 0, tzinfo=timezone(timedelta(hours=5)))
    with database.session() as session:
        job = _job(started_at=started_at)
        session.add(job)

    with database.session() as session:
        stored = session.get(Job, job.id)
        found = session.scalars(select(Job.id).where(Job.started_at == started_at)).all()
    assert found == [job.id]
    assert stored.started_at == started_at
    assert stored.started_at.utcoffset() == timedelta(0)
    assert (stored.started_at.hour, stored.started_at.minute) == (12, 0)


def test_a_naive_datetime_is_refused(database):
    with pytest.raises(StatementError, match="naive datetime"), database.session() as session:
        session.add(_job(started_at=datetime(2026, 3, 1, 12, 0)))
    with database.session() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_a_step_is_stored_once_per_attempt(database):
    with database.session() as session:
        job = _job()
        session.add(job)
        session.flush()
        session.add(_metric(job.id, step=7))

    with pytest.raises(IntegrityError), database.session() as session:
        session.add(_metric(job.id, step=7))

    with database.session() as session:
        session.add(_metric(job.id, step=7, attempt=1))  # a retry may store the same step again
    assert _count(database, Metric, job.id) == 2


def test_deleting_a_job_deletes_its_events_and_metrics(database):
    with database.session() as session:
        doomed = _job("doomed")
        kept = _job("kept")
        session.add_all([doomed, kept])
        session.flush()
        for job in (doomed, kept):
            session.add(JobEvent(job_id=job.id, from_status=None, to_status="queued", reason="submitted"))
            session.add_all([_metric(job.id, step=step) for step in range(2)])

    with database.session() as session:
        session.execute(delete(Job).where(Job.id == doomed.id))  # the database cascades, not the ORM

    assert (_count(database, JobEvent, doomed.id), _count(database, Metric, doomed.id)) == (0, 0)
    assert (_count(database, JobEvent, kept.id), _count(database, Metric, kept.id)) == (1, 2)


def test_a_code_bundle_is_recorded_once_per_uploader(database):
    digest = "sha256:" + "ab" * 32
    with database.session() as session:
        session.add_all([CodeBundle(digest=digest, uploader=user, bytes=5 * GIB, files=3) for user in ("alice", "bob")])

    with pytest.raises(IntegrityError), database.session() as session:
        session.add(CodeBundle(digest=digest, uploader="alice", bytes=5 * GIB, files=3))

    with database.session() as session:
        rows = session.scalars(select(CodeBundle).where(CodeBundle.digest == digest).order_by(CodeBundle.id)).all()
    assert [(row.uploader, row.bytes, row.files) for row in rows] == [("alice", 5 * GIB, 3), ("bob", 5 * GIB, 3)]
    assert all(row.created_at.tzinfo is not None for row in rows)
