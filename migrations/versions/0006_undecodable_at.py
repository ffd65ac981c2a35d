"""Per server, where a slave's copy stopped at a record whose body it cannot decode
(``brokers.undecodable_at``, JSON: {log, offset, kind, version, reason}), as its heartbeats
report it, for ``GET /api/admin/replication`` and ``qmq admin replication``
(docs/REPLICATION.md 8.2). Null for every existing row: the next heartbeats fill it.

Revision ID: 0006_undecodable_at
Revises: 0005_backlog_table
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_undecodable_at"
down_revision = "0005_backlog_table"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the column."""
    with op.batch_alter_table("brokers") as batch:
        batch.add_column(sa.Column("undecodable_at", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("brokers") as batch:
        batch.drop_column("undecodable_at")
