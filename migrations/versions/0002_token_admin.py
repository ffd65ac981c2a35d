"""App tokens: an admin flag and a short non-secret hint for listing.

Revision ID: 0002_token_admin
Revises: 0001_initial
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_token_admin"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add ``admin`` (false for existing rows) and ``token_hint`` to ``app_tokens``."""
    with op.batch_alter_table("app_tokens") as batch:
        batch.add_column(sa.Column("admin", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
        batch.add_column(sa.Column("token_hint", sa.String(16), nullable=False,
                                   server_default=""))


def downgrade() -> None:
    """Drop the two columns again."""
    with op.batch_alter_table("app_tokens") as batch:
        batch.drop_column("token_hint")
        batch.drop_column("admin")
