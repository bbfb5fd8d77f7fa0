"""sweep_events: each sweep's end, with its reason, what the webhook sends of sweeps

Revision ID: 0022
Revises: 0021
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | Sequence[str] | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As service.store.tables.BigId: SQLite wants INTEGER for its auto-incrementing rowid keys; elsewhere 64 bits.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "sweep_events",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("sweep_id", BIG_ID, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("to_status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_sweep_events_sweep_id"), "sweep_events", ["sweep_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_sweep_events_sweep_id"), table_name="sweep_events")
    op.drop_table("sweep_events")
