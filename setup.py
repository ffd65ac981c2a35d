"""Build hook for the one optional C extension; every other setting is in pyproject.toml.

``logstore._framing`` frames log records in C (see logstore/_framing.c). It is optional: when no
C compiler is present the build goes on without it and logstore uses its pure-Python framing.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("logstore._framing", sources=["logstore/_framing.c"], optional=True),
    ],
)
