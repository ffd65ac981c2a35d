"""The one way of choosing between a C twin and its pure-Python twin.

Five hot codecs and one queue have an optional C extension beside a pure-Python function that
does exactly the same (setup.py builds them; each pair is tested to give the same bytes and
answers): ``logstore._framing`` (``logstore.record``), ``serverkit._send_check``
(``serverkit.send_check``), ``serverkit._call_queue`` (``serverkit.io_thread``'s call queue),
``realtime.storage._codecs`` (``realtime.storage.message_record``,
``consumer_log``, ``control_record``, ``store_checkpoint`` and ``write_batch``),
``delayserver._due_records`` (``delayserver.storage.due_records``) and ``delayserver._commit_codecs``
(``delayserver.storage.delay_record`` and ``schedule_entry``).
Each of those modules asks ``c_twin`` for the C function once, at import, and runs its Python
twin when the answer is None.

The answer is None when the extension was not built (no C compiler or zlib header where the
package was installed: the build goes on without it), or when the environment variable
``QMQ_NO_EXTENSIONS`` is set to anything but "" or "0" before the first import: CI runs the
tests that use the twins a second time that way, so the Python twins are proven on every run
(README, "C extensions"). ``.ci/run`` separately fails when an extension did not build, so a C
twin cannot be skipped silently there.

It lives in ``logstore`` because ``logstore`` is the lowest package with a C twin and may import
nothing of ours; ``serverkit`` imports it from here (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

NO_EXTENSIONS_ENV = "QMQ_NO_EXTENSIONS"


def extensions_disabled() -> bool:
    """True when ``QMQ_NO_EXTENSIONS`` asks for the pure-Python twins."""
    return os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0")


def c_twin(module: str, name: str) -> Any | None:
    """``name`` of the C extension ``module`` (e.g. ``"logstore._framing"``,
    ``"frame_records"``), or None when it was not built or ``QMQ_NO_EXTENSIONS`` is set: the
    caller then runs its pure-Python twin."""
    if extensions_disabled():
        return None
    try:
        extension = importlib.import_module(module)
    except ImportError:
        return None
    return getattr(extension, name)


__all__ = ["NO_EXTENSIONS_ENV", "c_twin", "extensions_disabled"]
