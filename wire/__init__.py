"""What clients and servers both speak: the message model and its payload codec (``message``),
protocol frames and ops (``protocol``), the error types and their wire codes (``errors``), the
limits (``limits``), TLS contexts (``tls``), the MetaServer's HTTP headers (``http``) and the
wall clock in ms every process defaults to (``clock``).

This package imports nothing else of ours, so the SDK and every server can depend on it.
"""
