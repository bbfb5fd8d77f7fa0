"""job logs: the logs table (every rank's lines) and jobs.log_state

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As service.store.tables.BigId: SQLite wants INTEGER for its auto-incrementing rowid keys; elsewhere 64 bits.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "logs",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("job_id", BIG_ID, nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stream", sa.String(length=8), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_logs_job_id", "logs", ["job_id", "id"])
    op.create_index("ix_logs_job_rank_id", "logs", ["job_id", "rank", "id"])
    op.add_column("jobs", sa.Column("log_state", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("log_state")
    op.drop_index("ix_logs_job_rank_id", table_name="logs")
    op.drop_index("ix_logs_job_id", table_name="logs")
    op.drop_table("logs")
