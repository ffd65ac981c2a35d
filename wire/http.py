"""What clients and servers put on an HTTP request to the MetaServer: the token header and
aiohttp's ``ssl=`` argument.

Both the SDK (routes) and the servers (registration, access checks) call the MetaServer, so these
live here rather than in either of them.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

# Most MetaServer URLs one client or server is given.
META_URLS_MAX = 16


def bearer(token: str | None) -> dict[str, str]:
    """HTTP headers carrying ``token`` as a Bearer credential (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def http_ssl(context: ssl.SSLContext | None) -> ssl.SSLContext | bool:
    """What aiohttp's ``ssl=`` wants: our context, or True (default verification for https)."""
    return context if context is not None else True


def parse_meta_urls(value: str | Sequence[str]) -> tuple[str, ...]:
    """The MetaServer URLs of ``--meta`` or the SDK's ``meta_url``: one URL, a comma-separated
    list, or a list of URLs (each may itself hold commas). Trailing slashes are dropped and
    repeats removed, order kept; ValueError names what is wrong."""
    parts = [value] if isinstance(value, str) else list(value)
    urls: list[str] = []
    for part in parts:
        if not isinstance(part, str):
            raise ValueError(f"MetaServer URL {part!r} must be a string")
        for url in part.split(","):
            url = url.strip().rstrip("/")
            if not url:
                continue
            if not url.startswith(("http://", "https://")) or len(url) <= len("https://"):
                raise ValueError(f"MetaServer URL {url!r} must start with http:// or https://")
            if url not in urls:
                urls.append(url)
    if not urls:
        raise ValueError(f"no MetaServer URL in {value!r}")
    if len(urls) > META_URLS_MAX:
        raise ValueError(f"{len(urls)} MetaServer URLs exceed META_URLS_MAX {META_URLS_MAX}")
    return tuple(urls)


__all__ = ["META_URLS_MAX", "bearer", "http_ssl", "parse_meta_urls"]
