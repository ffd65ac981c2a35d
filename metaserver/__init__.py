"""MetaServer: broker registry, subject routing and admin API over HTTP/JSON (aiohttp + SQLAlchemy).

Entry points: ``create_app``, ``start_metaserver``, ``run_metaserver`` and ``MetaConfig``.
"""

from metaserver.app import RunningMetaServer, create_app, get_registry, run_metaserver, start_metaserver
from metaserver.config import MetaConfig, sqlite_url

__all__ = [
    "MetaConfig",
    "RunningMetaServer",
    "create_app",
    "get_registry",
    "run_metaserver",
    "sqlite_url",
    "start_metaserver",
]
