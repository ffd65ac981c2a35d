"""TLS settings shared by the SDK and the servers: turning what a user passes into an
``ssl.SSLContext``.

Clients accept ``tls=`` as an ``ssl.SSLContext`` (used as it is), a path to a CA bundle in PEM
(the certificates to trust, e.g. a self-signed server certificate), or None (plain TCP). The same
context verifies an ``https://`` MetaServer. Servers load their certificate chain and key from
PEM files (``--tls-cert``/``--tls-key``).
"""

from __future__ import annotations

import os
import ssl

TlsOption = ssl.SSLContext | str | os.PathLike[str] | None


def client_context(tls: TlsOption) -> ssl.SSLContext | None:
    """The client-side context of ``tls`` (see the module doc); None means plain TCP."""
    if tls is None or isinstance(tls, ssl.SSLContext):
        return tls
    path = os.fspath(tls)
    if not os.path.isfile(path):
        raise ValueError(f"tls CA file {path!r} does not exist")
    return ssl.create_default_context(cafile=path)


def server_context(cert_path: str | None, key_path: str | None) -> ssl.SSLContext | None:
    """The server-side context of a certificate chain and key (PEM files); None when neither is
    given; ValueError naming the option when only one is, or when they cannot be loaded."""
    if cert_path is None and key_path is None:
        return None
    if cert_path is None or key_path is None:
        raise ValueError(f"tls_cert {cert_path!r} and tls_key {key_path!r} go together: "
                         "give both or neither")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load tls_cert {cert_path!r} / tls_key {key_path!r}: "
                         f"{exc}") from None
    return context


__all__ = ["TlsOption", "client_context", "server_context"]
