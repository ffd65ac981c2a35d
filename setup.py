"""Build hook for the optional C extensions; every other setting is in pyproject.toml.

``logstore._framing`` frames log records in C (see logstore/_framing.c); ``sdk._send_check``
is the servers' quick check of sent payloads over a batch (see sdk/_send_check.c). Both are
optional: when no C compiler is present the build goes on without them and the pure-Python
twins (logstore.record, sdk.send_check) do the work.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("logstore._framing", sources=["logstore/_framing.c"], optional=True),
        Extension("sdk._send_check", sources=["sdk/_send_check.c"], optional=True),
    ],
)
