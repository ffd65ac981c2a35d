"""What clients and servers put on an HTTP request to the MetaServer: the token header and
aiohttp's ``ssl=`` argument.

Both the SDK (routes) and the servers (registration, access checks) call the MetaServer, so these
live here rather than in either of them.
"""

from __future__ import annotations

import ssl


def bearer(token: str | None) -> dict[str, str]:
    """HTTP headers carrying ``token`` as a Bearer credential (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def http_ssl(context: ssl.SSLContext | None) -> ssl.SSLContext | bool:
    """What aiohttp's ``ssl=`` wants: our context, or True (default verification for https)."""
    return context if context is not None else True


__all__ = ["bearer", "http_ssl"]
