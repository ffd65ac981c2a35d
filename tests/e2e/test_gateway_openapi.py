"""The gateway's OpenAPI document, checked by schemathesis against a running ``qmq up``:
generated requests (valid, and invalid where the document constrains them) get no server error,
a documented status, and an answer that matches the document. Few examples per operation
(``EXAMPLES``), so the test stays a few seconds; ``QMQ_OPENAPI_EXAMPLES`` runs more."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from hypothesis import HealthCheck, settings

from metaserver.openapi import openapi_document
from tests import harness
from wire.limits import MAX_PULL_WAIT_MS

EXAMPLES = int(os.environ.get("QMQ_OPENAPI_EXAMPLES", "25"))
# Long polls generated with a large wait_ms are cut to this, so the run stays short.
TEST_WAIT_MS_MAX = 200


# Built from the same function the server answers /api/openapi.json with (the test below checks
# they agree); schemathesis' lazy loading from a fixture does not run under pytest 9.
# A send or cancel of more than MAX_SEND_BATCH_MESSAGES is 413 too_large, as the binary
# protocol's too_large: a refusal schemathesis does not expect of an over-long array by itself.
# Not every request the document allows can succeed, so positive_data_acceptance is off: a
# receipt must come from a pull, and a tag's limit is 64 bytes of UTF-8, which JSON Schema
# cannot say; such values get a 400 with the binary protocol's message.
CONFIG = SchemathesisConfig.from_dict({"checks": {
    "negative_data_rejection": {"expected-statuses": [400, 401, 403, 404, 405, 413, 415, 422]},
    "positive_data_acceptance": {"enabled": False}}})
schema = schemathesis.openapi.from_dict(openapi_document(), config=CONFIG)


def test_the_served_document_is_the_one_tested(gateway_up: harness.UpProcess) -> None:
    with urllib.request.urlopen(gateway_up.meta_url + "/api/openapi.json", timeout=30) as resp:
        assert json.load(resp) == json.loads(json.dumps(openapi_document()))


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_gateway_answer_matches_the_openapi_document(case: Any,
                                                           gateway_up: harness.UpProcess) -> None:
    wait_ms = case.body.get("wait_ms") if isinstance(case.body, dict) else None
    if type(wait_ms) is int and TEST_WAIT_MS_MAX < wait_ms <= MAX_PULL_WAIT_MS:
        case.body["wait_ms"] = TEST_WAIT_MS_MAX  # still valid; an invalid one stays invalid
    case.call_and_validate(base_url=gateway_up.meta_url)
