"""jobs: stop, the stop (a preemption or a suspend) the scheduler asked of the job's current attempt,
kept across a restart so that a victim the service lost mid-preemption goes back to the queue

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("stop", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("stop")
