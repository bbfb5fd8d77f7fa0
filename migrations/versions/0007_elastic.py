"""elastic jobs: jobs.min_gpus and jobs.world_size (the N it runs at now), metrics.world_size

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("min_gpus", sa.Integer, nullable=True))
    op.add_column("jobs", sa.Column("world_size", sa.Integer, nullable=True))
    op.add_column("metrics", sa.Column("world_size", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("world_size")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("world_size")
        batch.drop_column("min_gpus")
