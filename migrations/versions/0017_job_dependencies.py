"""job_dependencies: a job's depends_on, the jobs that must succeed before it starts (one row each)

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "job_dependencies",
        sa.Column("job_id", BIG_ID, nullable=False),
        sa.Column("needs_id", BIG_ID, nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["needs_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "needs_id"),
    )
    op.create_index("ix_job_dependencies_needs_id", "job_dependencies", ["needs_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_job_dependencies_needs_id", table_name="job_dependencies")
    op.drop_table("job_dependencies")
