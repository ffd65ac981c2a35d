"""Replication: per group an epoch, its master, replication settings and the lease counter; per
server a stable server id, its role, reported positions and in-sync flag (docs/REPLICATION.md).

Servers are keyed by ``server_id`` from now on, so the unique ``(group_name, address)`` goes:
a wiped data dir restarted on the same address is a new server, and its registration marks the
old row offline. Existing rows get ``addr:<group>/<address>``, the id the MetaServer gives a
server that sends none, so an older server keeps its row. Existing groups start at epoch 0
with no master: the next server to register or heartbeat becomes master at epoch 1.

Revision ID: 0004_replication
Revises: 0003_schedules
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_replication"
down_revision = "0003_schedules"
branch_labels = None
depends_on = None

SERVER_ID_CHARS = 512


def upgrade() -> None:
    """Add the replication columns, give every existing broker a server id, key brokers by it."""
    with op.batch_alter_table("broker_groups") as batch:
        batch.add_column(sa.Column("epoch", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("master_id", sa.String(SERVER_ID_CHARS), nullable=True))
        batch.add_column(sa.Column("replication", sa.String(16), nullable=False,
                                   server_default="sync"))
        batch.add_column(sa.Column("min_insync", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("lease_renewals", sa.BigInteger(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("epoch_started_at_ms", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("switchover_to", sa.String(SERVER_ID_CHARS), nullable=True))
        batch.add_column(sa.Column("switchover_deadline_ms", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("writable", sa.Boolean(), nullable=False,
                                   server_default=sa.true()))
    with op.batch_alter_table("brokers") as batch:
        batch.add_column(sa.Column("server_id", sa.String(SERVER_ID_CHARS), nullable=True))
        batch.add_column(sa.Column("role", sa.String(16), nullable=False,
                                   server_default="slave"))
        batch.add_column(sa.Column("reported_epoch", sa.BigInteger(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("in_sync", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
        batch.add_column(sa.Column("position", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("positions", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("lag_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("lag_ms", sa.BigInteger(), nullable=True))
    # String concatenation is || on both SQLite and PostgreSQL.
    op.execute("UPDATE brokers SET server_id = 'addr:' || group_name || '/' || address")
    with op.batch_alter_table("brokers") as batch:
        batch.alter_column("server_id", existing_type=sa.String(SERVER_ID_CHARS),
                           nullable=False)
        batch.drop_constraint("uq_brokers_group_name", type_="unique")
        batch.create_unique_constraint("uq_brokers_server_id", ["server_id"])
        batch.create_index("ix_brokers_group_name", ["group_name"])


def downgrade() -> None:
    """Drop the replication columns and key brokers by (group, address) again."""
    with op.batch_alter_table("brokers") as batch:
        batch.drop_index("ix_brokers_group_name")
        batch.drop_constraint("uq_brokers_server_id", type_="unique")
        batch.create_unique_constraint("uq_brokers_group_name", ["group_name", "address"])
        for column in ("lag_ms", "lag_bytes", "positions", "position", "in_sync",
                       "reported_epoch", "role", "server_id"):
            batch.drop_column(column)
    with op.batch_alter_table("broker_groups") as batch:
        for column in ("writable", "switchover_deadline_ms", "switchover_to",
                       "epoch_started_at_ms", "lease_renewals", "min_insync", "replication",
                       "master_id", "epoch"):
            batch.drop_column(column)
