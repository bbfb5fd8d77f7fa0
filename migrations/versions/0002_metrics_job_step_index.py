"""metrics: an index on (job_id, step) for a job's curve, thinned or paged

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_metrics_job_step", "metrics", ["job_id", "step"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_metrics_job_step", table_name="metrics")
