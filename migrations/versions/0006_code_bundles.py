"""code_bundles: who uploaded which code bundle (POST /v1/code), one row per digest and uploader

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As service.store.tables.BigId: SQLite wants INTEGER for its auto-incrementing rowid keys; elsewhere 64 bits.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "code_bundles",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("uploader", sa.String(length=200), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_code_bundles_digest_uploader", "code_bundles", ["digest", "uploader"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_code_bundles_digest_uploader", table_name="code_bundles")
    op.drop_table("code_bundles")
