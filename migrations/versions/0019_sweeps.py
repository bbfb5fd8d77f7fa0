"""sweeps and sweep_trials: a search over a job spec's fields, one job per trial

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sweeps_status", "sweeps", ["status"], unique=False)
    op.create_table(
        "sweep_trials",
        sa.Column("sweep_id", BIG_ID, nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("job_id", BIG_ID, nullable=True),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.Column("skipped", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("sweep_id", "index"),
    )
    op.create_index("ix_sweep_trials_job_id", "sweep_trials", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_sweep_trials_job_id", table_name="sweep_trials")
    op.drop_table("sweep_trials")
    op.drop_index("ix_sweeps_status", table_name="sweeps")
    op.drop_table("sweeps")
