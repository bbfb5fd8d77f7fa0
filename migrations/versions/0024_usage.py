"""usage: job_events.gpus, the GPUs a job holds from each event on; metrics.stored_at, when a row was stored
(both null for what was stored before them)

Revision ID: 0024
Revises: 0023
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | Sequence[str] | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("job_events", sa.Column("gpus", sa.Integer, nullable=True))
    op.add_column("metrics", sa.Column("stored_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("stored_at")
    with op.batch_alter_table("job_events") as batch:
        batch.drop_column("gpus")
