"""metrics: eval_loss, the held-out loss of a step that evaluated (null on the others)

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("metrics", sa.Column("eval_loss", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("eval_loss")
