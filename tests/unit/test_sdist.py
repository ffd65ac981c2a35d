"""A source distribution holds everything its C extensions include, so a build from it (a
wheel made by ``python -m build``, ``pip install`` of the tarball) builds every extension."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _extension_headers() -> set[str]:
    """Every header that a C source of setup.py's extensions includes with quotes, as a
    repo-relative path (sources named in setup.py only: a venv in the tree has its own)."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as setup:
        sources = re.findall(r'sources=\["([^"]+)"\]', setup.read())
    assert sources, "setup.py names no extension source"
    headers = set()
    for source_path in sources:
        folder = os.path.dirname(os.path.join(ROOT, source_path))
        with open(os.path.join(ROOT, source_path), encoding="utf-8") as source:
            for include in LOCAL_INCLUDE.findall(source.read()):
                path = os.path.normpath(os.path.join(folder, include))
                headers.add(os.path.relpath(path, ROOT))
    return headers


def test_the_sdist_holds_every_header_the_c_extensions_include(tmp_path):
    headers = _extension_headers()
    assert "logstore/_framing.h" in headers  # the scan sees the includes
    # egg_info in tmp_path: an earlier build's SOURCES.txt in the tree would fill the list.
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
                    "sdist", "--dist-dir", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    (tarball,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(tarball) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert headers <= members, f"missing from the sdist: {sorted(headers - members)}"
