"""The OpenAPI 3.0 document of the HTTP gateway, served at ``GET /api/openapi.json``.

Built from the same constants the gateway checks (``gateway_codec``, ``wire.limits``), so the
document cannot drift from the code: ``tests/integration/test_gateway_openapi.py`` has
schemathesis send generated requests, valid and invalid, and check every answer against it.

What the document constrains is what the gateway refuses as a whole with 400 (types, unknown
fields, ranges, name patterns of pull, ack and nack). A send's messages are described by type
only: their limits (body size, tags, properties, id, subject name, due time) are checked per
message, as on the binary protocol, and a refused message gets an ``error`` in its result
while the others are sent.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from metaserver import gateway_codec as codec
from wire.limits import (
    MAX_ACK_RANGES,
    MAX_CLIENT_ID_CHARS,
    MAX_DELAY_MS,
    MAX_PULL_BATCH_MESSAGES,
    MAX_PULL_WAIT_MS,
    MAX_SEND_BATCH_MESSAGES,
)

OPENAPI_PATH = "/api/openapi.json"
NAME = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"}
MS = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
STRINGS = {"type": "array", "items": {"type": "string"}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null: an optional request field given as null counts as left out."""
    if "$ref" in schema:
        return schema
    out = {**schema, "nullable": True}
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out


def _object(properties: dict[str, Any], required: list[str],
            description: str = "") -> dict[str, Any]:
    properties = {name: schema if name in required else _nullable(schema)
                  for name, schema in properties.items()}
    out: dict[str, Any] = {"type": "object", "properties": properties, "required": required,
                           "additionalProperties": False}
    if description:
        out["description"] = description
    return out


ERROR_CODES = sorted({*codec.HTTP_STATUS, "no_route", "readonly", "overloaded",
                      "connection_lost", "timeout"})

SCHEMAS: dict[str, Any] = {
    "ErrorDetail": _object({
        "code": {"type": "string", "description": "stable code: " + ", ".join(ERROR_CODES)},
        "message": {"type": "string", "description": "for people: quotes the value and the "
                                                     "limit"}}, ["code", "message"]),
    "Error": _object({"error": _ref("ErrorDetail")}, ["error"]),
    "SendMessage": _object({
        "subject": {"type": "string", "description": "[A-Za-z0-9][A-Za-z0-9._-]{0,199}"},
        "body": {"type": "string", "description": "the body: UTF-8 text, or base64 with "
                                                  "encoding base64; at most 4 MiB decoded"},
        "encoding": {"type": "string", "enum": ["utf-8", "base64"], "default": "utf-8"},
        "id": {"type": "string", "description": "your id (1-128 printable ASCII, no space), so "
                                                "a resend is not stored twice; made if absent"},
        "tags": {**STRINGS, "description": "at most 10, each 1-64 bytes"},
        "properties": {"type": "object", "additionalProperties": {"type": "string"},
                       "description": "at most 64; keys 1-128 bytes, values up to 4096 bytes"},
        "delay_ms": {**MS, "description": "deliver this many ms from now"},
        "deliver_at_ms": {**MS, "description": "deliver at this epoch ms"},
        "deliver_at": {"type": "string", "description": "deliver at this RFC 3339 time, "
                                                        "e.g. 2027-01-01T09:00:00Z"},
        "expire_at_ms": {**MS, "description": "not delivered after this epoch ms"},
    }, ["subject", "body"], "at most one of delay_ms, deliver_at_ms and deliver_at"),
    "SendRequest": _object({"messages": {"type": "array", "items": _ref("SendMessage"),
                                         "minItems": 1, "maxItems": MAX_SEND_BATCH_MESSAGES}},
                           ["messages"]),
    "SendResult": {"type": "object", "properties": {
        "id": {"type": "string", "nullable": True},
        "status": {"type": "string", "enum": ["stored", "duplicate"]},
        "subject": {"type": "string"},
        "broker_group": {"type": "string"},
        "deliver_at_ms": {"type": "integer", "description": "delayed messages: cancel needs it"},
        "error": _ref("ErrorDetail"),
    }, "required": ["id"], "additionalProperties": False},
    "SendResponse": _object({"results": {"type": "array", "items": _ref("SendResult")}},
                            ["results"]),
    "CancelMessage": _object({"subject": NAME, "id": {"type": "string"},
                              "broker_group": NAME, "deliver_at_ms": MS},
                             ["subject", "id", "broker_group", "deliver_at_ms"],
                             "what the send result said"),
    "CancelRequest": _object({"messages": {"type": "array", "items": _ref("CancelMessage"),
                                           "minItems": 1,
                                           "maxItems": MAX_SEND_BATCH_MESSAGES}}, ["messages"]),
    "CancelResult": {"type": "object", "properties": {
        "id": {"type": "string", "nullable": True},
        "status": {"type": "string", "enum": ["cancelled", "already_dispatched",
                                              "already_cancelled", "already_past", "unknown"]},
        "error": _ref("ErrorDetail"),
    }, "required": ["id"], "additionalProperties": False},
    "CancelResponse": _object({"results": {"type": "array", "items": _ref("CancelResult")}},
                              ["results"]),
    "PullRequest": _object({
        "subject": NAME, "group": NAME,
        "consumer_id": {"type": "string", "minLength": 1, "maxLength": MAX_CLIENT_ID_CHARS},
        "max_count": {"type": "integer", "minimum": 1, "maximum": MAX_PULL_BATCH_MESSAGES,
                      "default": codec.PULL_COUNT_DEFAULT},
        "wait_ms": {"type": "integer", "minimum": 0, "maximum": MAX_PULL_WAIT_MS,
                    "default": codec.PULL_WAIT_MS_DEFAULT},
        "tags": {**STRINGS, "description": "only messages with one of these tags"},
        "start": {"type": "string", "enum": ["latest", "earliest"], "default": "latest"},
    }, ["subject", "group", "consumer_id"]),
    "PulledMessage": _object({
        "receipt": {"type": "string", "description": "give it to ack or nack"},
        "id": {"type": "string"}, "subject": {"type": "string"},
        "origin_id": {"type": "string"},
        "origin_subject": {"type": "string", "nullable": True},
        "retries": {"type": "integer"}, "redelivered": {"type": "integer"},
        "created_at_ms": {"type": "integer"},
        "deliver_at_ms": {"type": "integer", "nullable": True},
        "expire_at_ms": {"type": "integer", "nullable": True},
        "tags": STRINGS,
        "properties": {"type": "object", "additionalProperties": {"type": "string"}},
        "size_bytes": {"type": "integer"},
        "encoding": {"type": "string", "enum": ["utf-8", "base64"]},
        "body": {"type": "string"},
    }, ["receipt", "id", "subject", "retries", "redelivered", "created_at_ms", "tags",
        "properties", "encoding", "body"]),
    "PullResponse": _object({"messages": {"type": "array", "items": _ref("PulledMessage")}},
                            ["messages"]),
    "AckRequest": _object({"receipts": {"type": "array", "items": {"type": "string"},
                                        "minItems": 1, "maxItems": MAX_ACK_RANGES}},
                          ["receipts"]),
    "AckResponse": _object({"acked": {"type": "integer"}}, ["acked"]),
    "NackRequest": _object({"receipts": {"type": "array", "items": {"type": "string"},
                                         "minItems": 1, "maxItems": MAX_ACK_RANGES},
                            "retry_after_ms": {"type": "integer", "minimum": 0,
                                               "maximum": MAX_DELAY_MS}}, ["receipts"]),
    "NackResponse": _object({"nacked": {"type": "integer"}}, ["nacked"]),
}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(status): {"description": "an error (see docs/HTTP.md)",
                          "content": {"application/json": {"schema": _ref("Error")}}}
            for status in statuses}


def _operation(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "done",
                              "content": {"application/json": {"schema": _ref(response)}}},
                      **_errors(400, 401, 403, 404, 413, 500, 501, 503)},
    }}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the gateway's endpoints."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "pyqmq HTTP gateway", "version": "1",
                 "description": "Send, cancel, pull, ack and nack over JSON; docs/HTTP.md."},
        "paths": {
            "/api/send": _operation("Send messages, realtime or delayed", "SendRequest",
                                    "SendResponse"),
            "/api/cancel": _operation("Cancel delayed messages", "CancelRequest",
                                      "CancelResponse"),
            "/api/pull": _operation("Pull messages of a subject for a consumer group (long "
                                    "poll with wait_ms)", "PullRequest", "PullResponse"),
            "/api/ack": _operation("Acknowledge pulled messages", "AckRequest", "AckResponse"),
            "/api/nack": _operation("Hand pulled messages back for a retry", "NackRequest",
                                    "NackResponse"),
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "an app token; needed when auth "
                                                          "is on"}},
        },
        "security": [{}, {"bearer": []}],
    }


async def serve_openapi(request: web.Request) -> web.Response:
    """``GET /api/openapi.json`` (open to everyone, auth on or off)."""
    return web.json_response(openapi_document())
