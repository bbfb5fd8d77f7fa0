"""job_tags: a job's tags (GET /v1/jobs?tag= finds the jobs of one by its index); jobs: notes, its
owner's free text

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("notes", sa.Text(), nullable=True))
    op.create_table(
        "job_tags",
        sa.Column("job_id", BIG_ID, nullable=False),
        sa.Column("tag", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "tag"),
    )
    op.create_index("ix_job_tags_tag", "job_tags", ["tag"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_job_tags_tag", table_name="job_tags")
    op.drop_table("job_tags")
    with op.batch_alter_table("jobs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("notes")
