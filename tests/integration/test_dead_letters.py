"""Dead letters end to end, in-process on port 0: a real realtime broker holding
``%dead%orders%billing`` messages, a MetaServer (SQLite file) it registered with, the admin API
over HTTP and the CLI commands; plus ``qmq admin delay`` against a registered delay server."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import pytest

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver import MetaConfig, sqlite_url, start_metaserver
from qmq import admin_commands, cli, commands
from realtime.admin import ADMIN_GROUP
from realtime.pulls import PULL_RESPONSE_PAYLOAD_BYTES_MAX
from realtime.config import RealtimeConfig
from realtime.retries import RetryPolicies, RetryPolicy, plan_retry
from realtime.server import RealtimeServer
from wire.limits import MAX_BODY_BYTES
from wire.message import Message, decode_message, encode_message
from tests.rawclient import RawClient

DEAD = "%dead%orders%billing"
T0 = 1_700_000_000_000
# With no retries allowed, the first nack of a message makes its dead copy.
NO_RETRIES = RetryPolicies(default=RetryPolicy(retries_max=0))


def dead_copy(body: bytes, origin_id: str, **fields: Any) -> bytes:
    """The payload realtime.retries makes for ``orders`` message ``origin_id`` nacked by billing
    after its last retry."""
    original = Message(id=origin_id, subject="orders", body=body, created_at_ms=T0, **fields)
    copy = plan_retry(encode_message(original), "billing", NO_RETRIES, T0 + 1)
    assert copy.dead and copy.subject == DEAD
    return copy.payload


class Cluster:
    """A MetaServer, one realtime broker registered with it, a raw client and an HTTP session."""

    meta: Any
    broker: RealtimeServer
    client: RawClient
    http: aiohttp.ClientSession

    async def get(self, path: str, **params: Any) -> tuple[int, Any]:
        async with self.http.get(self.meta.url + path,
                                 params={k: str(v) for k, v in params.items()}) as resp:
            return resp.status, await resp.json()

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(self.meta.url + path, json=body) as resp:
            return resp.status, await resp.json()

    async def ok(self, method: str, path: str, body: dict[str, Any] | None = None,
                 **params: Any) -> Any:
        status, data = await (self.get(path, **params) if method == "GET"
                              else self.post(path, body or {}))
        assert status == 200, data
        return data

    async def send_dead(self, *payloads: bytes) -> None:
        answer = await self.client.request({"op": "send", "messages": list(payloads)})
        assert [r["status"] for r in answer["results"]] == ["stored"] * len(payloads), answer


@pytest.fixture
async def cluster(tmp_path):
    c = Cluster()
    config = MetaConfig(db_url=sqlite_url(str(tmp_path / "meta.db")), port=0)
    async with start_metaserver(config) as meta:
        c.meta = meta
        c.broker = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=meta.url, group="rt1", port=0,
            expiry_check_interval_ms=3_600_000, heartbeat_interval_ms=3_600_000))
        await c.broker.start()
        c.client = await RawClient.connect(c.broker.port)
        c.http = aiohttp.ClientSession()
        try:
            yield c
        finally:
            await c.http.close()
            await c.client.close()
            await c.broker.stop()


@pytest.fixture
async def three_dead(cluster):
    await cluster.send_dead(dead_copy(b"order 1 failed", "o1", tags=("vip",)),
                            dead_copy(b"order 2 failed", "o2", properties={"k": "v"}),
                            dead_copy(b"order 3 failed", "o3"))
    return cluster


async def test_the_list_shows_each_dead_letter_with_its_retries_and_origin_subject(three_dead):
    data = await three_dead.ok("GET", "/api/admin/dead")
    assert data["errors"] == [] and data["truncated"] is False
    rows = data["dead"]
    assert [(r["sequence"], r["id"], r["origin_id"], r["retries"]) for r in rows] == [
        (0, "o1.r1", "o1", 1), (1, "o2.r1", "o2", 1), (2, "o3.r1", "o3", 1)]
    first = rows[0]
    assert (first["broker_group"], first["dead_subject"], first["subject"], first["group"]) == (
        "rt1", DEAD, "orders", "billing")
    assert (first["body_preview"], first["size_bytes"], first["created_at_ms"]) == (
        "order 1 failed", 14, T0)


async def test_the_list_filters_by_subject_and_group(three_dead):
    await three_dead.send_dead(dead_copy(b"x", "p1").replace(b"orders", b"paymnt"))
    by_subject = await three_dead.ok("GET", "/api/admin/dead", subject="orders")
    assert {r["dead_subject"] for r in by_subject["dead"]} == {DEAD}
    assert len((await three_dead.ok("GET", "/api/admin/dead"))["dead"]) == 4
    assert (await three_dead.ok("GET", "/api/admin/dead", subject="orders",
                                group="shipping"))["dead"] == []
    assert len((await three_dead.ok("GET", "/api/admin/dead", group="billing"))["dead"]) == 4
    status, error = await three_dead.get("/api/admin/dead", subject="%dead%x%y")
    assert status == 400 and error["error"]["code"] == "bad_request"


async def test_the_list_body_preview_is_the_first_200_characters_with_replacement(cluster):
    await cluster.send_dead(dead_copy("é".encode() * 300, "long"), dead_copy(b"\xff\xfeok", "bin"))
    rows = (await cluster.ok("GET", "/api/admin/dead"))["dead"]
    assert rows[0]["body_preview"] == "é" * 200 and rows[0]["size_bytes"] == 600
    assert rows[1]["body_preview"] == "\ufffd\ufffdok"


async def test_show_returns_the_whole_dead_letter_with_its_body(three_dead):
    data = await three_dead.ok("GET", "/api/admin/dead/message", broker_group="rt1",
                               dead_subject=DEAD, sequence=1)
    assert (data["id"], data["origin_id"], data["origin_subject"], data["retries"]) == (
        "o2.r1", "o2", "orders", 1)
    assert (data["body"], data["encoding"], data["sequence"]) == ("order 2 failed", "utf-8", 1)
    assert data["properties"]["k"] == "v"
    assert data["created_at_ms"] == T0 and data["deliver_at_ms"] is None


async def test_show_gives_a_binary_body_as_base64(cluster):
    await cluster.send_dead(dead_copy(b"\x00\xff\x80", "bin"))
    data = await cluster.ok("GET", "/api/admin/dead/message", broker_group="rt1",
                            dead_subject=DEAD, sequence=0)
    assert data["encoding"] == "base64" and base64.b64decode(data["body"]) == b"\x00\xff\x80"


async def test_show_of_a_missing_message_group_or_bad_name_is_an_error(three_dead):
    cases = [({"broker_group": "rt1", "dead_subject": DEAD, "sequence": 3}, 404),
             ({"broker_group": "rt9", "dead_subject": DEAD, "sequence": 0}, 404),
             ({"broker_group": "rt1", "dead_subject": "%dead%nothing%here", "sequence": 0}, 404),
             ({"broker_group": "rt1", "dead_subject": "orders", "sequence": 0}, 400),
             ({"broker_group": "rt1", "dead_subject": DEAD, "sequence": "-1"}, 400),
             ({"broker_group": "rt1", "dead_subject": DEAD}, 400)]
    for params, status in cases:
        got, body = await three_dead.get("/api/admin/dead/message", **params)
        assert (got, body["error"]["code"]) == (
            status, "not_found" if status == 404 else "bad_request"), params


async def test_redrive_puts_the_dead_letters_back_on_their_subject_with_retries_reset(three_dead):
    answer = await three_dead.ok("POST", "/api/admin/dead/redrive",
                                 {"subject": "orders", "group": "billing"})
    assert answer == {"redriven": 3, "duplicates": 0, "errors": []}
    pulled = await three_dead.client.pull("orders", "billing", "c1", start="earliest")
    messages = [decode_message(p) for p in pulled["payloads"]]
    assert [(m.id, m.subject, m.retries, m.body) for m in messages] == [
        ("o1.redrive1", "orders", 0, b"order 1 failed"),
        ("o2.redrive1", "orders", 0, b"order 2 failed"),
        ("o3.redrive1", "orders", 0, b"order 3 failed")]
    assert messages[0].tags == ("vip",) and messages[1].properties["k"] == "v"
    assert messages[0].properties["qmq-redriven-from"] == "o1.r1"
    assert "qmq-origin-id" not in messages[0].properties
    assert all(m.deliver_at_ms is None for m in messages)
    # Re-driving does not purge: the dead letters are still listed.
    assert len((await three_dead.ok("GET", "/api/admin/dead"))["dead"]) == 3


async def test_redriving_the_same_dead_letters_again_is_deduplicated(three_dead):
    body = {"subject": "orders", "group": "billing"}
    await three_dead.ok("POST", "/api/admin/dead/redrive", body)
    again = await three_dead.ok("POST", "/api/admin/dead/redrive", body)
    assert (again["redriven"], again["duplicates"]) == (0, 3)


async def test_redrive_of_chosen_ids_sends_only_those(three_dead):
    answer = await three_dead.ok("POST", "/api/admin/dead/redrive",
                                 {"subject": "orders", "group": "billing", "ids": ["o3.r1", "o1"]})
    assert answer["redriven"] == 2
    pulled = await three_dead.client.pull("orders", "billing", "c1", start="earliest")
    assert sorted(decode_message(p).id for p in pulled["payloads"]) == [
        "o1.redrive1", "o3.redrive1"]


async def test_a_bad_redrive_or_purge_request_is_a_bad_request(three_dead):
    for path, body in [("/api/admin/dead/redrive", {"subject": "orders"}),
                       ("/api/admin/dead/redrive", {"subject": "orders", "group": "billing",
                                                    "ids": []}),
                       ("/api/admin/dead/redrive", {"subject": "%dead%a%b", "group": "g"}),
                       ("/api/admin/dead/purge", {"subject": "orders", "group": "billing",
                                                  "through_sequence": -1}),
                       ("/api/admin/dead/purge", {"subject": "orders", "group": "billing",
                                                  "extra": 1})]:
        status, error = await three_dead.post(path, body)
        assert (status, error["error"]["code"]) == (400, "bad_request"), body


async def test_purge_removes_dead_letters_from_the_list_and_retention_may_drop_them(three_dead):
    admin = three_dead.broker.admin
    assert await admin.retention_floor(DEAD) is None
    partial = await three_dead.ok("POST", "/api/admin/dead/purge",
                                  {"subject": "orders", "group": "billing", "through_sequence": 0})
    assert partial["purged"] == 1 and partial["errors"] == []
    assert [r["sequence"] for r in (await three_dead.ok("GET", "/api/admin/dead"))["dead"]] == [1, 2]
    assert await admin.retention_floor(DEAD) == 1
    everything = await three_dead.ok("POST", "/api/admin/dead/purge",
                                     {"subject": "orders", "group": "billing"})
    assert everything["purged"] == 2
    assert everything["brokers"] == [{"broker_group": "rt1", "address": three_dead.broker.address,
                                      "purged_before": 3, "purged": 2}]
    assert (await three_dead.ok("GET", "/api/admin/dead"))["dead"] == []
    assert await admin.retention_floor(DEAD) == 3


async def test_the_admin_watermark_group_stays_out_of_the_heartbeat_backlog(three_dead):
    await three_dead.ok("POST", "/api/admin/dead/purge", {"subject": "orders", "group": "billing",
                                                          "through_sequence": 0})
    await three_dead.client.pull("orders", "audit", "c1")
    await three_dead.broker.registration.report_backlog_now()
    (broker,) = (await three_dead.ok("GET", "/api/admin/brokers"))["brokers"]
    backlog = broker["stats"]["backlog"]
    assert {(b["subject"], b["group"]) for b in backlog} == {("orders", "audit")}
    assert all(not b["group"].startswith("%") for b in backlog)
    assert ADMIN_GROUP.startswith("%")


async def test_browse_returns_at_most_max_count_and_does_not_consume(three_dead):
    client = three_dead.client
    page = await client.request({"op": "browse", "subject": DEAD, "max_count": 2})
    assert [m["sequence"] for m in page["messages"]] == [0, 1]
    assert (page["next_sequence"], page["first_sequence"], page["end_sequence"]) == (2, 0, 3)
    rest = await client.request({"op": "browse", "subject": DEAD, "from_sequence": 2,
                                 "max_count": 2})
    assert [m["sequence"] for m in rest["messages"]] == [2]
    # Nothing was consumed: a group reading the dead subject from the start gets all three.
    pulled = await client.pull(DEAD, "inspect", "c1", start="earliest")
    assert len(pulled["payloads"]) == 3


async def test_browse_stops_at_the_frame_budget(cluster):
    body_bytes = MAX_BODY_BYTES * 5 // 8  # 2.5 MiB: two fit in the budget, three do not
    assert 2 * body_bytes < PULL_RESPONSE_PAYLOAD_BYTES_MAX < 3 * body_bytes
    for i in range(3):
        await cluster.send_dead(dead_copy(bytes([65 + i]) * body_bytes, f"big{i}"))
    page = await cluster.client.request({"op": "browse", "subject": DEAD, "max_count": 10})
    assert [m["sequence"] for m in page["messages"]] == [0, 1]
    assert page["next_sequence"] == 2
    last = await cluster.client.request({"op": "browse", "subject": DEAD,
                                         "from_sequence": 2, "max_count": 10})
    assert decode_message(last["messages"][0]["payload"]).body == b"C" * body_bytes


async def test_purging_a_subject_that_is_not_a_dead_letter_subject_is_a_bad_request(three_dead):
    await three_dead.client.request({"op": "send", "messages": [
        encode_message(Message(id="a", subject="orders", body=b"x", created_at_ms=T0))]})
    for subject in ("orders", "%retry%orders%billing"):
        answer = await three_dead.client.request({"op": "purge", "subject": subject,
                                                  "through_sequence": 0})
        assert answer["error"]["code"] == "bad_request", answer
        assert "not a dead-letter subject" in answer["error"]["message"]
    assert len((await three_dead.client.pull("orders", "g", "c", start="earliest"))[
        "payloads"]) == 1


async def test_an_unreachable_broker_is_reported_in_errors_not_a_500(three_dead):
    ghost = "127.0.0.1:1"  # nothing listens on port 1
    await three_dead.ok("POST", "/api/brokers/register",
                        {"group": "rt-ghost", "kind": "realtime", "address": ghost})
    data = await three_dead.ok("GET", "/api/admin/dead")
    assert len(data["dead"]) == 3
    assert [(e["broker_group"], e["address"], e["code"]) for e in data["errors"]] == [
        ("rt-ghost", ghost, "connection_lost")]
    status, error = await three_dead.get("/api/admin/dead/message", broker_group="rt-ghost",
                                         dead_subject=DEAD, sequence=0)
    assert (status, error["error"]["code"]) == (503, "broker_unavailable")


async def test_cli_dead_list_prints_a_row_per_dead_letter(three_dead, capsys):
    assert await admin_commands.admin_dead_command(three_dead.meta.url, ["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["broker_group", "sequence", "subject", "group", "id", "retries",
                              "created_at", "size_bytes", "body_preview"]
    assert [line.split()[:6] for line in out[1:]] == [
        ["rt1", str(i), "orders", "billing", f"o{i + 1}.r1", "1"] for i in range(3)]
    assert "2023-11-14T22:13:20Z" in out[1] and out[1].endswith("order 1 failed")


async def test_cli_dead_show_redrive_and_purge(three_dead, capsys):
    url = three_dead.meta.url
    assert await admin_commands.admin_dead_command(url, ["show", "rt1", DEAD, "2"]) == 0
    assert '"body": "order 3 failed"' in capsys.readouterr().out
    assert await admin_commands.admin_dead_command(url, ["redrive", "orders", "billing"],
                                             ids=["o2.r1"]) == 0
    assert capsys.readouterr().out.strip() == "redriven 1 message(s) to orders"
    assert await admin_commands.admin_dead_command(url, ["purge", "orders", "billing"], through=1) == 0
    assert capsys.readouterr().out.strip() == "purged 2 dead letter(s) of orders / billing"
    with pytest.raises(commands.CommandError, match="usage: qmq admin dead list"):
        await admin_commands.admin_dead_command(url, ["show", "rt1"])


async def test_the_qmq_command_line_parses_the_dead_and_delay_admin_commands(three_dead, capsys):
    url = three_dead.meta.url
    # main() runs its own event loop, so it gets a thread of its own.
    code = await asyncio.to_thread(cli.main, ["admin", "dead", "list", "--subject", "orders",
                                              "--group", "billing", "--json", "--meta", url])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["dead"]
    assert [r["id"] for r in rows] == ["o1.r1", "o2.r1", "o3.r1"]
    code = await asyncio.to_thread(cli.main, ["admin", "dead", "purge", "orders", "billing",
                                              "--through", "0", "--meta", url])
    assert (code, capsys.readouterr().out.strip()) == (
        0, "purged 1 dead letter(s) of orders / billing")
    assert await asyncio.to_thread(cli.main, ["admin", "delay", "--meta", url]) == 0
    assert capsys.readouterr().out.strip() == "(no online delay server)"
    # An unknown action is argparse's usage error, exit code 2 (qmq/exits.py).
    with pytest.raises(SystemExit) as exited:
        await asyncio.to_thread(cli.main, ["admin", "dead", "bogus", "--meta", url])
    assert exited.value.code == 2
    assert "usage: qmq admin dead" in capsys.readouterr().err


async def test_admin_delay_reports_each_delay_servers_latest_stats(cluster, tmp_path, capsys):
    async def dispatch(subject, payloads):  # nothing is due during this test
        raise AssertionError("no dispatch expected")

    delay = DelayServer(DelayConfig(data_dir=str(tmp_path / "delay"), meta_url=cluster.meta.url,
                                    group="delay-1", port=0, heartbeat_interval_ms=3_600_000),
                        dispatch=dispatch)
    await delay.start()
    try:
        client = await RawClient.connect(delay.port)
        due_ms = delay.clock() + 2 * 3_600_000
        sent = await client.send(Message(id="d1", subject="orders", body=b"later",
                                         created_at_ms=delay.clock(), deliver_at_ms=due_ms))
        assert sent["results"][0]["status"] == "stored"
        await client.close()
        await delay.registration.report_backlog_now()
        (entry,) = (await cluster.ok("GET", "/api/admin/delay"))["delay"]
        assert (entry["group"], entry["address"]) == ("delay-1", delay.address)
        stats = entry["stats"]
        assert stats["pending_total"] == 1 and stats["pending_per_subject"] == {"orders": 1}
        (hour,) = stats["pending_per_hour"]
        assert int(hour) % 3_600_000 == 0 and int(hour) <= due_ms < int(hour) + 3_600_000
        assert await admin_commands.admin_delay_command(cluster.meta.url) == 0
        out = capsys.readouterr().out
        assert "delay group delay-1 at " + delay.address in out
        assert "pending total: 1" in out
        assert f"    {admin_commands._iso_ms(int(hour))}  1" in out
        assert "    orders  1" in out
        assert "lateness: p50 n/a, p99 n/a, max 0 ms; early 0" in out
    finally:
        await delay.stop()


async def test_the_heartbeat_backlog_counts_redeliveries_retries_and_dead_copies_per_group(
        tmp_path):
    config = MetaConfig(db_url=sqlite_url(str(tmp_path / "meta.db")), port=0)
    async with start_metaserver(config) as meta:
        broker = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=meta.url, group="rt1", port=0,
            retries_max=0, expiry_check_interval_ms=3_600_000,
            heartbeat_interval_ms=3_600_000))
        await broker.start()
        client = await RawClient.connect(broker.port)
        try:
            payloads = [encode_message(Message(id=f"m{i}", subject="orders", body=b"x",
                                               created_at_ms=T0)) for i in range(3)]
            await client.request({"op": "send", "messages": payloads})
            first = await client.pull("orders", "billing", "c1", start="earliest", max_count=3)
            # c1 leaves holding all three: c2 gets them again (redelivered), then nacks two of
            # them, which with no retries allowed go to the dead-letter subject.
            await client.request({"op": "leave", "consumer_id": "c1",
                                  "subscriptions": [["orders", "billing"]]})
            again = await client.pull("orders", "billing", "c2", max_count=3)
            assert len(first["payloads"]) == len(again["payloads"]) == 3
            await client.request({"op": "nack", "subject": "orders", "group": "billing",
                                  "consumer_id": "c2", "pull_seqs": again["pull_seqs"][:2]})
            await broker.registration.report_backlog_now()
            async with aiohttp.ClientSession() as http:
                async with http.get(meta.url + "/api/admin/groups") as resp:
                    groups = (await resp.json())["groups"]
            (billing,) = [g for g in groups if (g["group"], g["subject"]) == ("billing", "orders")]
            assert (billing["redelivered"], billing["retried"], billing["dead"]) == (3, 0, 2)
            assert billing["lag"] == 1
        finally:
            await client.close()
            await broker.stop()
