"""Initial MetaServer schema: broker groups, brokers, subjects and routes, consumer groups, clients,
app tokens.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create every table of the first schema."""
    op.create_table(
        "broker_groups",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("readonly", sa.Boolean(), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_broker_groups"),
    )
    op.create_table(
        "brokers",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("group_name", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("address", sa.String(300), nullable=False),
        sa.Column("reported_state", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("last_heartbeat_ms", sa.BigInteger(), nullable=False),
        sa.Column("registered_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("stats", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_brokers"),
        sa.ForeignKeyConstraint(
            ["group_name"],
            ["broker_groups.name"],
            name="fk_brokers_group_name_broker_groups",
        ),
        sa.UniqueConstraint("group_name", "address", name="uq_brokers_group_name"),
    )
    op.create_table(
        "subjects",
        sa.Column("name", sa.String(512), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_subjects"),
    )
    op.create_table(
        "subject_routes",
        sa.Column("subject", sa.String(512), nullable=False),
        sa.Column("group_name", sa.String(200), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("added_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("removed_at_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("subject", "group_name", name="pk_subject_routes"),
        sa.ForeignKeyConstraint(
            ["subject"], ["subjects.name"], name="fk_subject_routes_subject_subjects"
        ),
        sa.ForeignKeyConstraint(
            ["group_name"],
            ["broker_groups.name"],
            name="fk_subject_routes_group_name_broker_groups",
        ),
    )
    op.create_index("ix_subject_routes_group_name", "subject_routes", ["group_name"])
    op.create_table(
        "consumer_groups",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("subject", sa.String(512), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", "subject", name="pk_consumer_groups"),
    )
    op.create_table(
        "clients",
        sa.Column("client_id", sa.String(200), nullable=False),
        sa.Column("app", sa.String(200), nullable=False),
        sa.Column("group_name", sa.String(200), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("subjects", sa.JSON(), nullable=False),
        sa.Column("online", sa.Boolean(), nullable=False),
        sa.Column("first_seen_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_seen_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("client_id", name="pk_clients"),
    )
    op.create_index("ix_clients_group_name", "clients", ["group_name"])
    op.create_table(
        "app_tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("app", sa.String(200), nullable=False),
        sa.Column("token_hash", sa.String(128), nullable=False),
        sa.Column("produce_patterns", sa.JSON(), nullable=False),
        sa.Column("consume_patterns", sa.JSON(), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("revoked_at_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_app_tokens"),
        sa.UniqueConstraint("token_hash", name="uq_app_tokens_token_hash"),
    )
    op.create_index("ix_app_tokens_app", "app_tokens", ["app"])


def downgrade() -> None:
    """Drop every table of the first schema."""
    op.drop_index("ix_app_tokens_app", table_name="app_tokens")
    op.drop_table("app_tokens")
    op.drop_index("ix_clients_group_name", table_name="clients")
    op.drop_table("clients")
    op.drop_table("consumer_groups")
    op.drop_index("ix_subject_routes_group_name", table_name="subject_routes")
    op.drop_table("subject_routes")
    op.drop_table("subjects")
    op.drop_table("brokers")
    op.drop_table("broker_groups")
