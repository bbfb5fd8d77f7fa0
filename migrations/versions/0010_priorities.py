"""priorities, quotas, preemption: jobs.priority, jobs.borrowed, jobs.backfilled, jobs.suspend_requested,
and the queue's index (status, priority, id)

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("priority", sa.Integer, nullable=False, server_default="50"))
    op.add_column("jobs", sa.Column("borrowed", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("jobs", sa.Column("backfilled", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("jobs", sa.Column("suspend_requested", sa.Boolean, nullable=False, server_default=sa.false()))
    op.create_index("ix_jobs_queue", "jobs", ["status", "priority", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_queue", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("suspend_requested")
        batch.drop_column("backfilled")
        batch.drop_column("borrowed")
        batch.drop_column("priority")
