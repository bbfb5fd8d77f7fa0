"""mlflow_sweep_runs: each sweep's parent MLflow run, its trials' runs nested under it

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | Sequence[str] | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As service.store.tables.BigId: SQLite wants INTEGER for its auto-incrementing rowid keys; elsewhere 64 bits.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "mlflow_sweep_runs",
        sa.Column("sweep_id", BIG_ID, nullable=False),
        sa.Column("experiment_id", sa.String(length=64), nullable=True),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("done", sa.Boolean(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("sweep_id"),
    )


def downgrade() -> None:
    op.drop_table("mlflow_sweep_runs")
