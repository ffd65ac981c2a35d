"""Alembic revisions of the MetaServer database, oldest first by ``down_revision``."""
