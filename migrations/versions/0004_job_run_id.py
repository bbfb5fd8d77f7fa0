"""jobs: run_id, a random id per job that names its checkpoint directory

Job ids repeat after a database restore or a deleted SQLite file; a directory named by the
id alone would hand a new job another's checkpoints. Jobs stored before this revision keep
run_id null and their `job-<id>` directory.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("run_id", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("run_id")
