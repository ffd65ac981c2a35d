"""Every MetaServer endpoint that takes input answers bad input with a 4xx and a JSON error body:
bad JSON, a body that is not an object, wrong types, unknown fields, an oversized body; and a
Hypothesis fuzz of JSON bodies and query strings never gets a 500 or a logged traceback.

One MetaServer (SQLite, port 0, auth on with an admin token every request carries, so the token
endpoints can be fuzzed too) serves the whole module from a background thread, so the
Hypothesis tests are plain functions making blocking HTTP requests.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaserver.config import MetaConfig, sqlite_url
from metaserver.validation import BODY_SIZE_BYTES_MAX
from wire.limits import MAX_TOKEN_CHARS
from tests.fuzzing import FUZZ_SETTINGS, ClusterThread, tracebacks

# Longest wait for one HTTP answer.
HTTP_TIMEOUT_S = 30
# The MetaServer's admin token: every request below is authorised unless it says otherwise.
ADMIN_TOKEN = "fuzz-admin-token-0123456789abcdef"
# Brokers registered before the fuzzing, at loopback ports nothing listens on (refused at once).
REALTIME = {"group": "rt1", "kind": "realtime", "address": "127.0.0.1:9"}
DELAY = {"group": "dl1", "kind": "delay", "address": "127.0.0.1:7"}

# A valid body of every POST endpoint; each bad-input case starts from one of these.
VALID_BODIES: dict[str, dict[str, Any]] = {
    "/api/brokers/register": REALTIME,
    "/api/brokers/heartbeat": {**REALTIME, "backlog": [{"subject": "s", "group": "g", "lag": 1}]},
    "/api/brokers/deregister": {"group": "rt-gone", "address": "127.0.0.1:9"},
    "/api/clients/heartbeat": {"client_id": "c1", "app": "shop", "group": "g",
                               "subjects": ["s"], "role": "consumer"},
    "/api/clients/leave": {"client_id": "c1"},
    "/api/admin/brokers/readonly": {"group": "rt1", "readonly": False},
    "/api/admin/dead/redrive": {"subject": "s", "group": "g", "ids": ["m1"]},
    "/api/admin/dead/purge": {"subject": "s", "group": "g", "through_sequence": 3},
    "/api/admin/tokens": {"app": "shop", "produce": ["order.*"], "consume": ["order.?"],
                          "admin": False},
    "/api/admin/tokens/revoke": {"id": 1},
    "/api/auth/check": {"token": "not-a-token"},
}
# A value of the wrong JSON type for the first field of each valid body.
WRONG_TYPE = {"/api/admin/brokers/readonly": ("readonly", "yes")}
VALID_QUERIES: dict[str, dict[str, str]] = {
    "/api/route": {"subject": "s", "role": "producer", "kind": "realtime"},
    "/api/admin/dead": {"subject": "s", "group": "g"},
    "/api/admin/dead/message": {"broker_group": "rt1", "dead_subject": "%dead%s%g",
                                "sequence": "0"},
}
# 503s that are answers, not failures: no live broker can serve the request right now.
UNAVAILABLE_CODES = {"no_route", "broker_unavailable"}


@pytest.fixture(scope="module")
def meta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a MetaServer with one realtime and one delay broker registered."""
    cluster = ClusterThread(tmp_path_factory.mktemp("meta-bad-input"), brokers=False,
                            admin_token=ADMIN_TOKEN).start()
    try:
        for body in (REALTIME, DELAY):
            assert http(cluster.meta_url, "POST", "/api/brokers/register",
                        json.dumps(body).encode())[0] == 200
        yield cluster.meta_url
    finally:
        cluster.stop()


def http(base: str, method: str, path: str, body: bytes | None = None,
         query: dict[str, str] | None = None, token: str | None = ADMIN_TOKEN
         ) -> tuple[int, str, Any]:
    """One request (as the admin unless ``token`` says otherwise); returns (status, content
    type, decoded JSON answer)."""
    url = base + path + ("?" + urllib.parse.urlencode(query) if query else "")
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            status, kind, raw = response.status, response.headers.get_content_type(), response.read()
    except urllib.error.HTTPError as exc:
        status, kind, raw = exc.code, exc.headers.get_content_type(), exc.read()
    return status, kind, json.loads(raw)


def assert_json_error(answer: tuple[int, str, Any], status: int, code: str) -> None:
    """``answer`` is ``status`` with a JSON ``{"error": {"code", "message"}}`` body."""
    got_status, kind, body = answer
    assert (got_status, kind) == (status, "application/json"), answer
    assert body["error"]["code"] == code and body["error"]["message"], answer


def _bad_bodies() -> list[Any]:
    cases = []
    for path, valid in VALID_BODIES.items():
        first = next(iter(valid))
        name, wrong = WRONG_TYPE.get(path, (first, [valid[first]]))
        for case, raw in [
            ("bad-json", b'{"group": '),
            ("array", b"[1, 2]"),
            ("string", b'"register"'),
            ("null", b"null"),
            ("empty", b""),
            ("wrong-type", json.dumps({**valid, name: wrong}).encode()),
            ("unknown-field", json.dumps({**valid, "colour": "red"}).encode()),
            ("nan", json.dumps({**valid, "extra": float("nan")}).encode()),
            ("deep", b"[" * 100_000),
            ("lone-surrogate", json.dumps({**valid, name: "\ud800"}).encode()),
        ]:
            cases.append(pytest.param(path, raw, id=f"{path.rsplit('/', 2)[-2]}-"
                                                   f"{path.rsplit('/', 1)[-1]}-{case}"))
    return cases


@pytest.mark.parametrize(("path", "raw"), _bad_bodies())
def test_a_bad_body_is_a_400_with_a_json_error_on_every_endpoint(meta: str, path: str,
                                                                   raw: bytes) -> None:
    assert_json_error(http(meta, "POST", path, raw), 400, "bad_request")


@pytest.mark.parametrize("path", list(VALID_BODIES))
def test_a_bad_body_without_a_token_is_a_401_with_a_json_error(meta: str, path: str) -> None:
    assert_json_error(http(meta, "POST", path, b"[1", token=None), 401, "unauthorized")


@pytest.mark.parametrize("stats", [b'{"lag": NaN}', b'{"lag": -Infinity}', b'{"lag": 1e999}'],
                         ids=["nan", "infinity", "overflowing-float"])
def test_a_broker_heartbeat_whose_free_form_stats_are_not_json_numbers_is_a_400(
    meta: str, stats: bytes
) -> None:
    body = json.dumps({**REALTIME, "stats": {}}).encode().replace(b"{}", stats)
    assert_json_error(http(meta, "POST", "/api/brokers/heartbeat", body), 400, "bad_request")


@pytest.mark.parametrize("path", list(VALID_BODIES))
def test_a_body_one_byte_over_the_limit_is_a_413_with_a_json_error_naming_the_limit(
    meta: str, path: str
) -> None:
    answer = http(meta, "POST", path, b" " * (BODY_SIZE_BYTES_MAX + 1))
    assert_json_error(answer, 413, "too_large")
    message = answer[2]["error"]["message"]
    assert str(BODY_SIZE_BYTES_MAX + 1) in message and str(BODY_SIZE_BYTES_MAX) in message


def test_a_body_of_exactly_the_limit_is_read_and_judged_on_its_content(meta: str) -> None:
    padded = json.dumps(REALTIME).encode()
    padded += b" " * (BODY_SIZE_BYTES_MAX - len(padded))
    assert http(meta, "POST", "/api/brokers/register", padded)[0] == 200
    assert http(meta, "POST", "/api/brokers/register", padded[:-1])[0] == 200


def _bad_queries() -> list[Any]:
    cases = []
    for path, valid in VALID_QUERIES.items():
        first = next(iter(valid))
        for case, query in [
            ("unknown-param", {**valid, "colour": "red"}),
            ("missing-or-bad", {**valid, first: "not a name!"}),
        ]:
            cases.append(pytest.param(path, query, id=f"{path}-{case}"))
    for path in ("/api/admin/brokers", "/api/admin/subjects", "/api/admin/groups",
                 "/api/admin/delay", "/api/admin/tokens"):
        # These take no parameters: a misspelt filter must not silently list everything.
        cases.append(pytest.param(path, {"colour": "red"}, id=f"{path}-unknown-param"))
    cases.append(pytest.param("/api/admin/dead/message",
                              {**VALID_QUERIES["/api/admin/dead/message"], "sequence": "-1"},
                              id="negative-sequence"))
    return cases


@pytest.mark.parametrize(("path", "query"), _bad_queries())
def test_a_bad_query_is_a_400_with_a_json_error(meta: str, path: str,
                                                query: dict[str, str]) -> None:
    assert_json_error(http(meta, "GET", path, query=query), 400, "bad_request")


# --- fuzz ----------------------------------------------------------------------------------------

# Any JSON value, with text that may hold lone surrogates, and numbers at the edges.
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(),
    st.sampled_from([-1, 0, 2**63 - 1, 2**63, 2**64, 10**30, 1e308]),
    st.text(st.characters(codec=None), max_size=20),
    st.sampled_from(["rt1", "dl1", "s", "g", "%dead%s%g", "127.0.0.1:9", "realtime", "delay",
                     "producer", "consumer", "rw", "readonly", "", "x" * 201]),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


@st.composite
def bodies(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """A JSON body: a valid one with fields replaced, removed or added, or any JSON value."""
    if draw(st.integers(0, 4)) == 0:
        return json.dumps(draw(json_values)).encode()
    body = dict(valid)
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "remove", "extra"]))
        keys = sorted(body)
        if action == "replace" and keys:
            body[draw(st.sampled_from(keys))] = draw(json_values)
        elif action == "remove" and keys:
            del body[draw(st.sampled_from(keys))]
        else:
            body[draw(st.text(max_size=10))] = draw(json_values)
    return json.dumps(body).encode()


def assert_no_server_error(answer: tuple[int, str, Any]) -> None:
    """A JSON answer that is not a 5xx (except the 503s of an unavailable broker)."""
    status, kind, body = answer
    assert kind == "application/json", answer
    if status >= 400:
        assert body["error"]["message"], answer
    if status >= 500:
        assert status == 503 and body["error"]["code"] in UNAVAILABLE_CODES, answer


def test_fuzzed_json_bodies_never_get_a_5xx_nor_log_a_traceback(
    meta: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)

    @FUZZ_SETTINGS
    @given(data=st.data(), path=st.sampled_from(sorted(VALID_BODIES)))
    def post(data: st.DataObject, path: str) -> None:
        raw = data.draw(bodies(VALID_BODIES[path]))
        assert_no_server_error(http(meta, "POST", path, raw))

    post()
    assert tracebacks(caplog.records) == []
    # The registry still works: the route of a fresh subject is answered.
    status, _kind, _body = http(meta, "GET", "/api/route",
                                query={"subject": "after.fuzz", "role": "consumer"})
    assert status in (200, 503)


def test_fuzzed_query_strings_never_get_a_5xx_nor_log_a_traceback(
    meta: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    params = st.dictionaries(
        st.sampled_from(["subject", "role", "kind", "group", "broker_group", "dead_subject",
                         "sequence", "x"]),
        st.text(st.characters(codec="utf-8"), max_size=20)
        | st.sampled_from(["s", "g", "rt1", "producer", "consumer", "delay", "%dead%s%g", "0",
                           "-1", str(2**64), "1e3"]),
        max_size=4,
    )

    @FUZZ_SETTINGS
    @given(path=st.sampled_from(sorted(VALID_QUERIES) + ["/api/admin/brokers", "/health"]),
           query=params)
    def get(path: str, query: dict[str, str]) -> None:
        assert_no_server_error(http(meta, "GET", path, query=query))

    get()
    assert tracebacks(caplog.records) == []


@pytest.mark.parametrize("extra_chars", [-1, 0, 1], ids=["max-1", "max", "max+1"])
def test_a_configured_admin_token_longer_than_max_token_chars_is_refused_at_start(
    tmp_path: Any, extra_chars: int
) -> None:
    token = "a" * (MAX_TOKEN_CHARS + extra_chars)
    db_url = sqlite_url(tmp_path / "m.db")
    if extra_chars <= 0:
        assert MetaConfig(db_url=db_url, admin_token=token).admin_token == token
        return
    with pytest.raises(ValueError, match=f"of {MAX_TOKEN_CHARS + 1} characters exceeds "
                                         f"MAX_TOKEN_CHARS {MAX_TOKEN_CHARS}") as info:
        MetaConfig(db_url=db_url, admin_token=token)
    assert "aaaaaaaa" not in str(info.value)
