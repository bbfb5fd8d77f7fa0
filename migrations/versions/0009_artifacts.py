"""artifacts: the artifacts table (a succeeded job's files as the service recorded them) and
jobs.artifacts_recorded_at

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As service.store.tables.BigId: SQLite wants INTEGER for its auto-incrementing rowid keys; elsewhere 64 bits.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "artifacts",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("job_id", BIG_ID, nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_artifacts_job_name", "artifacts", ["job_id", "name"], unique=True)
    op.add_column("jobs", sa.Column("artifacts_recorded_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("artifacts_recorded_at")
    op.drop_index("ix_artifacts_job_name", table_name="artifacts")
    op.drop_table("artifacts")
