"""metrics: checkpoint_blocked_s, the seconds a step's checkpoint held training up (null on the others)

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("metrics", sa.Column("checkpoint_blocked_s", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("checkpoint_blocked_s")
