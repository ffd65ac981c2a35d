"""Token auth on the MetaServer: bootstrapping, the admin token API, 401/403, hashed storage,
and the brokers' token check, on SQLite and PostgreSQL (real port-0 servers)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from sqlalchemy import text

from metaserver import MetaConfig, sqlite_url, start_metaserver
from metaserver.db import make_engine
from tests.pg import PgCluster, create_database

ADMIN_SECRET = "configured-admin-secret-0123456789"


class Http:
    """A JSON client of one MetaServer that may carry a Bearer token."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.session = session

    async def call(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                   **params: str) -> tuple[int, Any]:
        """Call ``path``; return the status and the JSON answer."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.request(method, self.url + path, json=body, params=params,
                                        headers=headers) as resp:
            return resp.status, await resp.json()

    async def create_token(self, token: str | None = None, **body: Any) -> dict[str, Any]:
        """Create a token; assert it worked; return the answer (with the secret)."""
        status, answer = await self.call("POST", "/api/admin/tokens", body, token=token)
        assert status == 200, answer
        return answer


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "meta.db")
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    name = f"t_{uuid.uuid4().hex[:16]}"
    await create_database(cluster.url_of("postgres"), name)
    return cluster.url_of(name)


@asynccontextmanager
async def serve(db_url: str, **config: Any) -> AsyncIterator[Http]:
    """A MetaServer on port 0 over ``db_url`` and a client of it."""
    async with start_metaserver(MetaConfig(db_url=db_url, port=0, **config)) as server, \
            aiohttp.ClientSession() as session:
        yield Http(server.url, session)


async def test_auth_is_off_until_the_first_token_then_admin_paths_need_an_admin_token(
        db_url: str) -> None:
    async with serve(db_url) as http:
        # Off: anyone may use the admin API, which is how the first admin token is made.
        assert (await http.call("GET", "/api/admin/brokers"))[0] == 200
        admin = await http.create_token(app="ops", admin=True)
        assert admin["token"].startswith("qmq_") and admin["admin"] is True

        status, answer = await http.call("GET", "/api/admin/brokers")
        assert status == 401 and answer["error"]["code"] == "unauthorized"
        assert "no Authorization: Bearer token" in answer["error"]["message"]
        status, answer = await http.call("GET", "/api/admin/brokers", token="qmq_not-a-token")
        assert status == 401 and "unknown or revoked" in answer["error"]["message"]
        assert (await http.call("GET", "/api/admin/brokers", token=admin["token"]))[0] == 200

        orders = await http.create_token(admin["token"], app="shop", produce=["order.*"],
                                         consume=["order.*"])
        status, answer = await http.call("GET", "/api/admin/brokers", token=orders["token"])
        assert status == 403 and answer["error"]["code"] == "forbidden"
        assert "'shop'" in answer["error"]["message"]
        # Brokers need an admin token too; /health stays open for probes.
        status, _ = await http.call("POST", "/api/brokers/register",
                                    {"group": "rt", "kind": "realtime",
                                     "address": "127.0.0.1:1", "state": "rw"},
                                    token=orders["token"])
        assert status == 403
        assert (await http.call("GET", "/health"))[0] == 200
        # Client paths need any valid token.
        assert (await http.call("GET", "/api/route", subject="order.x", role="producer"))[0] == 401
        status, answer = await http.call("GET", "/api/route", token=orders["token"],
                                         subject="order.x", role="producer")
        assert status == 503 and answer["error"]["code"] == "no_route"


async def test_tokens_are_stored_as_hashes_listed_without_secrets_and_revoked(
        db_url: str) -> None:
    async with serve(db_url) as http:
        admin = await http.create_token(app="ops", admin=True)
        made = await http.create_token(admin["token"], app="shop", produce=["order.*"])
        secret = made["token"]

        status, listed = await http.call("GET", "/api/admin/tokens", token=admin["token"])
        assert status == 200
        assert [t["app"] for t in listed["tokens"]] == ["ops", "shop"]
        assert all("token" not in t for t in listed["tokens"])
        assert listed["tokens"][1]["hint"] == secret[:8]
        assert listed["tokens"][1]["produce"] == ["order.*"]
        assert listed["tokens"][1]["revoked_at_ms"] is None

        engine = make_engine(db_url)
        try:
            async with engine.connect() as connection:
                rows = (await connection.execute(
                    text("SELECT token_hash FROM app_tokens ORDER BY id"))).all()
        finally:
            await engine.dispose()
        assert rows[1][0] == hashlib.sha256(secret.encode()).hexdigest()
        assert all(secret not in str(row) for row in rows)

        status, revoked = await http.call("POST", "/api/admin/tokens/revoke", {"id": made["id"]},
                                          token=admin["token"])
        assert status == 200 and revoked["revoked_at_ms"] is not None
        status, _ = await http.call("GET", "/api/route", token=secret, subject="order.x",
                                    role="producer")
        assert status == 401
        status, answer = await http.call("POST", "/api/admin/tokens/revoke", {"id": 999},
                                         token=admin["token"])
        assert status == 404 and "999" in answer["error"]["message"]


async def test_a_configured_admin_token_turns_auth_on_over_an_empty_database(
        db_url: str) -> None:
    async with serve(db_url, admin_token=ADMIN_SECRET) as http:
        assert (await http.call("GET", "/api/admin/tokens"))[0] == 401
        assert (await http.call("POST", "/api/admin/tokens", {"app": "x", "admin": True}))[0] == 401
        status, listed = await http.call("GET", "/api/admin/tokens", token=ADMIN_SECRET)
        assert (status, listed) == (200, {"tokens": []})


async def test_the_token_check_tells_brokers_what_a_token_grants(db_url: str) -> None:
    async with serve(db_url, admin_token=ADMIN_SECRET) as http:
        made = await http.create_token(ADMIN_SECRET, app="shop", produce=["order.*"],
                                       consume=["order.created"])
        status, answer = await http.call("POST", "/api/auth/check", {"token": made["token"]},
                                         token=ADMIN_SECRET)
        assert (status, answer) == (200, {"enabled": True, "valid": True, "app": "shop",
                                          "produce": ["order.*"], "consume": ["order.created"],
                                          "admin": False})
        status, answer = await http.call("POST", "/api/auth/check", {"token": "qmq_nope"},
                                         token=ADMIN_SECRET)
        assert (status, answer) == (200, {"enabled": True, "valid": False})
        # Only admin tokens (the brokers') may ask.
        status, _ = await http.call("POST", "/api/auth/check", {"token": made["token"]},
                                    token=made["token"])
        assert status == 403


async def test_the_token_check_says_auth_is_off_when_no_token_exists(tmp_path: Any) -> None:
    async with serve(sqlite_url(tmp_path / "m.db")) as http:
        status, answer = await http.call("POST", "/api/auth/check", {"token": None})
        assert (status, answer) == (200, {"enabled": False, "valid": False})


@pytest.mark.parametrize("body, needle", [
    ({"app": "shop"}, "needs produce or consume patterns, or admin"),
    ({"app": "shop", "produce": ["order/*"]}, "'order/*'"),
    ({"app": "shop", "produce": "order.*"}, "body.produce must be an array"),
    ({"app": "shop", "consume": ["x" * 201]}, "201 characters exceeds PATTERN_CHARS_MAX 200"),
    ({"app": "%bad", "admin": True}, "%bad"),
])
async def test_a_token_with_bad_patterns_or_app_is_refused_naming_the_value(
        tmp_path: Any, body: dict[str, Any], needle: str) -> None:
    async with serve(sqlite_url(tmp_path / "m.db")) as http:
        status, answer = await http.call("POST", "/api/admin/tokens", body)
        assert status == 400 and answer["error"]["code"] == "bad_request"
        assert needle in answer["error"]["message"]


def test_a_configured_admin_token_shorter_than_16_characters_is_refused_without_echoing_it(
        tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="admin_token of 6 characters is too short") as info:
        MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), admin_token="secret")
    assert "secret" not in str(info.value).replace("too short", "")


async def test_a_burst_of_requests_at_a_cache_expiry_asks_the_database_once(
    tmp_path: Any,
) -> None:
    # 64 requests arriving together with nothing cached (a busy gateway when the 1 s cache
    # runs out) share one look-up of "is auth on" and one of their token, not one each.
    import asyncio

    from sqlalchemy import event

    from metaserver.tokens import TOKENS_KEY

    async with start_metaserver(MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"),
                                           port=0)) as server:
        tokens = server.app[TOKENS_KEY]
        made = await tokens.create("shop", ["orders.*"], ["orders.*"], admin=False)
        revoked = await tokens.create("old", ["orders.*"], [], admin=False)
        await tokens.revoke(revoked["id"])  # also empties the cache
        queries: list[str] = []

        def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if "app_tokens" in statement:
                queries.append(statement)

        engine = server.registry.engine
        assert engine is not None
        event.listen(engine.sync_engine, "before_cursor_execute", count)
        checks = await asyncio.gather(*(tokens.check(None) for _ in range(32)),
                                      *(tokens.check(made["token"]) for _ in range(32)))
        assert len(queries) == 2  # once for "is auth on", once for the shop token
        assert all(c.enabled for c in checks)
        assert [c.grant is None for c in checks] == [True] * 32 + [False] * 32
        assert {c.grant.app for c in checks if c.grant} == {"shop"}
        # A token revoked on this MetaServer is refused at once, not after the cache's second.
        await tokens.revoke(made["id"])
        assert (await tokens.check(made["token"])).grant is None
