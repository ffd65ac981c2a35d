"""Backlogs in their own tables: ``backlog_heads`` (per server: the version of its rows, a delay
server's stats object, its stats) and ``backlog_rows`` (per server, subject and group: the
counts), so a backlog change writes only the rows that changed and never the ``brokers`` row a
lease renewal writes (metaserver/backlog.py). What ``brokers.stats`` held is not copied: every
server sends its whole backlog again when the MetaServer does not know its version.

Revision ID: 0005_backlog_table
Revises: 0004_replication
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_backlog_table"
down_revision = "0004_replication"
branch_labels = None
depends_on = None

SERVER_ID_CHARS = 512
SUBJECT_CHARS = 512
NAME_CHARS = 200


def upgrade() -> None:
    """Create the two backlog tables."""
    op.create_table(
        "backlog_heads",
        sa.Column("server_id", sa.String(SERVER_ID_CHARS), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=True),
        sa.Column("backlog", sa.JSON(), nullable=True),
        sa.Column("stats", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("server_id", name="pk_backlog_heads"),
    )
    op.create_table(
        "backlog_rows",
        sa.Column("server_id", sa.String(SERVER_ID_CHARS), nullable=False),
        sa.Column("subject", sa.String(SUBJECT_CHARS), nullable=False),
        sa.Column("group_name", sa.String(NAME_CHARS), nullable=False),
        sa.Column("lag", sa.BigInteger(), nullable=False),
        sa.Column("consumers", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("redelivered", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("retried", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("dead", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("server_id", "subject", "group_name", name="pk_backlog_rows"),
    )


def downgrade() -> None:
    """Drop the backlog tables (brokers.stats is still there, empty)."""
    op.drop_table("backlog_rows")
    op.drop_table("backlog_heads")
