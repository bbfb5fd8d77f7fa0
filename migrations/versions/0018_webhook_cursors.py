"""webhook_cursors: how far the job events have been sent to each webhook URL (by its digest)

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "webhook_cursors",
        sa.Column("url_sha256", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("url_sha256"),
    )


def downgrade() -> None:
    op.drop_table("webhook_cursors")
