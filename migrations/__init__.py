"""Alembic migrations of the MetaServer database; ``metaserver.db`` applies them on start."""
