"""metrics: lr, the learning rate a step used (null for rows stored before it was kept)

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("metrics", sa.Column("lr", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("lr")
