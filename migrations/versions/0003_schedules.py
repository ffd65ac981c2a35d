"""Recurring schedules: their definitions and how far the MetaServers got with each.

Revision ID: 0003_schedules
Revises: 0002_token_admin
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_schedules"
down_revision = "0002_token_admin"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``schedules`` with its index on ``action_ms`` (the runner's work queue)."""
    op.create_table(
        "schedules",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("app", sa.String(200), nullable=False),
        sa.Column("subject", sa.String(512), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("properties", sa.JSON(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("cron", sa.String(200), nullable=True),
        sa.Column("every_ms", sa.BigInteger(), nullable=True),
        sa.Column("at_ms", sa.BigInteger(), nullable=True),
        sa.Column("tz", sa.String(64), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("end_ms", sa.BigInteger(), nullable=True),
        sa.Column("misfire", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("after_ms", sa.BigInteger(), nullable=False),
        sa.Column("pending_fire_ms", sa.BigInteger(), nullable=True),
        sa.Column("pending_group", sa.String(200), nullable=True),
        sa.Column("sent_count", sa.BigInteger(), nullable=False),
        sa.Column("skipped_count", sa.BigInteger(), nullable=False),
        sa.Column("doubt", sa.JSON(), nullable=True),
        sa.Column("doubt_owner", sa.String(200), nullable=True),
        sa.Column("action_ms", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.String(500), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_schedules"),
        sa.UniqueConstraint("name", name="uq_schedules_name"),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("schedules") as batch:
        batch.create_index("ix_schedules_action_ms", ["action_ms"], unique=False)


def downgrade() -> None:
    """Drop ``schedules``."""
    with op.batch_alter_table("schedules") as batch:
        batch.drop_index("ix_schedules_action_ms")
    op.drop_table("schedules")
