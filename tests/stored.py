"""Where the service stored a job's files, read back from its database."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, text

from service.launcher import checkpoint_dirname


def job_checkpoint_dir(database_url: str, checkpoints: Path, job_id: int) -> Path:
    """The job's checkpoint directory under `checkpoints`: named by its id and its run id."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            run_id = connection.execute(text("SELECT run_id FROM jobs WHERE id = :id"), {"id": job_id}).scalar_one()
    finally:
        engine.dispose()
    return Path(checkpoints) / checkpoint_dirname(job_id, run_id)
