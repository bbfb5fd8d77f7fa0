"""owner_uids: the uid each owner that ZERO1_RUN_AS does not name got from its `*=LO-HI` range, allocated once

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "owner_uids",
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("uid", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner"),
        sa.UniqueConstraint("uid", name="uq_owner_uids_uid"),
    )


def downgrade() -> None:
    op.drop_table("owner_uids")
