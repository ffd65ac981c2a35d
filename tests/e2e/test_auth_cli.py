"""Auth through the ``qmq`` command line against a real ``qmq up``: bootstrapping the first admin
token, ``qmq admin tokens create|list|revoke``, and tokens on send/consume."""

from __future__ import annotations

import json
import re

import pytest

from tests.harness import run_qmq


def created_token(stdout: str) -> str:
    """The secret ``qmq admin tokens create`` printed."""
    found = re.search(r"^token: (qmq_\S+)$", stdout, re.MULTILINE)
    assert found, stdout
    return found.group(1)


@pytest.mark.timeout(120)
def test_tokens_are_created_listed_and_revoked_with_the_cli_and_gate_send_and_consume(cluster):
    up = cluster.start_up()
    meta = ("--meta", up.meta_url)
    # Auth is off in qmq up by default: anyone may send, and make the first admin token.
    assert run_qmq("send", "demo.open", "hi", *meta).returncode == 0
    made = run_qmq("admin", "tokens", "create", "--app", "ops", "--admin", *meta)
    assert made.returncode == 0, made.stderr
    admin = created_token(made.stdout)
    assert "cannot show it again" in made.stderr

    # Now auth is on: the admin API wants the admin token.
    refused = run_qmq("admin", "tokens", "list", *meta)
    assert refused.returncode == 1 and "401 unauthorized" in refused.stderr  # the service: no
    made = run_qmq("admin", "tokens", "create", "--app", "shop", "--produce", "order.*",
                   "--consume", "order.*", "--token", admin, *meta)
    assert made.returncode == 0, made.stderr
    shop = created_token(made.stdout)
    listed = run_qmq("admin", "tokens", "list", "--json", *meta, env={"QMQ_TOKEN": admin})
    assert listed.returncode == 0, listed.stderr
    tokens = json.loads(listed.stdout)
    assert [(t["app"], t["admin"], t["produce"]) for t in tokens] == [
        ("ops", True, []), ("shop", False, ["order.*"])]
    assert admin not in listed.stdout and shop not in listed.stdout

    # The shop token may use order.* only; qmq up's own brokers keep working with auth on.
    sent = run_qmq("send", "order.created", "42", "--token", shop, *meta)
    assert sent.returncode == 0, sent.stderr
    refused = run_qmq("send", "payment.x", "no", "--token", shop, *meta)
    assert refused.returncode == 1
    assert "forbidden: app 'shop' may not produce to subject 'payment.x'" in refused.stderr
    # A refused consume says so in one line, naming the subject typed (not its retry subject).
    for _ in range(3):
        denied = run_qmq("consume", "payment.x", "--group", "g1", "--count", "1", "--token",
                         shop, *meta)
        lines = [line for line in denied.stderr.splitlines() if line.strip()]
        assert denied.returncode != 0 and len(lines) == 1, denied.stderr
        assert "may not consume subject 'payment.x'" in lines[0] and "%" not in lines[0]
    consumed = run_qmq("consume", "order.created", "--group", "g1", "--start", "earliest",
                       "--count", "1", "--token", shop, *meta)
    assert consumed.returncode == 0, consumed.stderr
    assert json.loads(consumed.stdout)["body"] == "42"
    anonymous = run_qmq("send", "order.created", "x", *meta)
    assert anonymous.returncode == 1 and "unauthorized" in anonymous.stderr

    shop_id = str(tokens[1]["id"])
    revoked = run_qmq("admin", "tokens", "revoke", shop_id, "--token", admin, *meta)
    assert revoked.returncode == 0 and "revoked token id=" in revoked.stdout
    after = run_qmq("send", "order.created", "x", "--token", shop, *meta)
    assert after.returncode == 1 and "unauthorized" in after.stderr
    assert up.terminate() == 0
