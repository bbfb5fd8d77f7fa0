"""early stopping: the reason a sweep's ASHA stops a job (jobs.stop_early), each trial's rungs reached

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | Sequence[str] | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("stop_early", sa.Text(), nullable=True))
    op.add_column("sweep_trials", sa.Column("rungs", sa.JSON(), nullable=True))


def downgrade() -> None:  # SQLite drops a column by copying the table
    with op.batch_alter_table("sweep_trials") as batch:
        batch.drop_column("rungs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("stop_early")
