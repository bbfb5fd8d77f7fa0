"""mlflow_runs: each job's MLflow run and its export cursor (ZERO1_MLFLOW_TRACKING_URI)

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As service.store.tables.BigId: SQLite wants INTEGER for its auto-incrementing rowid keys; elsewhere 64 bits.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "mlflow_runs",
        sa.Column("job_id", BIG_ID, nullable=False),
        sa.Column("experiment_id", sa.String(length=64), nullable=True),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("batch_time_ms", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=True),
        sa.Column("artifacts_done", sa.Boolean(), nullable=False),
        sa.Column("done", sa.Boolean(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id"),
    )


def downgrade() -> None:
    op.drop_table("mlflow_runs")
