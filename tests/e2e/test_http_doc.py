"""docs/HTTP.md's examples run as written: every ``sh`` block of its Examples section, in order,
in one bash, against a ``qmq up`` (with ``QMQ`` set to its URL, as the first block allows)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests import harness

DOC = harness.REPO_ROOT / "docs" / "HTTP.md"
BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)


def example_blocks() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    examples = text.split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    return BLOCK.findall(examples)


def test_the_doc_has_an_example_for_every_gateway_endpoint():
    script = "\n".join(example_blocks())
    for path in ("/api/send", "/api/cancel", "/api/pull", "/api/ack", "/api/nack"):
        assert f'"$QMQ{path}"' in script, path


def test_every_example_of_the_http_doc_runs_against_qmq_up(gateway_up):
    for tool in ("curl", "jq", "bash"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing (.ci/run installs it)")
    script = "set -euo pipefail\n" + "\n".join(example_blocks())
    run = subprocess.run(["bash", "-c", script], env={**os.environ, "QMQ": gateway_up.meta_url},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert out.count('"status": "stored"') >= 3, out
    assert '"status": "cancelled"' in out, out
    assert '"acked": 2' in out and '"nacked": 1' in out, out
    assert '"body": "{\\"order\\": 42}"' in out and '"encoding": "base64"' in out, out
    assert "MAX_PULL_BATCH_MESSAGES 1024" in out and "HTTP 400" in out, out
