"""The ``qmq`` command line against real processes: up, send, consume, admin, signals, errors."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.harness import REPO_ROOT, _spawn, admin, free_port, run_qmq, start_realtime, wait_until


def table(stdout: str) -> list[dict[str, str]]:
    """The rows of a ``qmq admin`` table (header line, then one line per row)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    header = lines[0].split()
    return [dict(zip(header, line.split())) for line in lines[1:]]


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    return result.stdout


def receipts(stdout: str) -> list[dict[str, str]]:
    """``stored id=X subject=S group=G`` lines as dicts."""
    out = []
    for line in stdout.splitlines():
        status, *pairs = line.split()
        out.append({"status": status, **dict(p.split("=", 1) for p in pairs)})
    return out


@pytest.mark.timeout(90)
def test_qmq_up_prints_where_it_listens_round_trips_a_message_and_stops_on_sigterm(cluster):
    up = cluster.start_up()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", up.meta_url)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", up.address)
    assert up.port != 0 and not up.meta_url.endswith(":0")

    sent = receipts(ok(run_qmq("send", "demo.cli", '{"order": 42}', "--tag", "vip",
                               "--prop", "source=web", "--meta", up.meta_url)))
    assert len(sent) == 1 and sent[0]["status"] == "stored"
    assert sent[0]["subject"] == "demo.cli" and sent[0]["group"] == "realtime-1"
    consumed = run_qmq("consume", "demo.cli", "--group", "g1", "--start", "earliest",
                       "--count", "1", "--meta", up.meta_url)
    [line] = ok(consumed).splitlines()
    message = json.loads(line)
    assert message["id"] == sent[0]["id"]
    assert message["body"] == '{"order": 42}'
    assert message["tags"] == ["vip"] and message["properties"] == {"source": "web"}
    assert "consumed 1 message(s)" in consumed.stderr

    assert up.terminate() == 0
    assert "Traceback" not in up.text()


@pytest.mark.timeout(90)
def test_qmq_admin_lists_the_broker_the_subject_and_the_group_with_its_lag(cluster):
    up = cluster.start_up()
    meta = ("--meta", up.meta_url)
    ok(run_qmq("send", "demo.lag", "first", *meta))
    ok(run_qmq("consume", "demo.lag", "--group", "g1", "--start", "earliest", "--count", "1",
               *meta))
    ok(run_qmq("send", "demo.lag", "waiting", "--count", "3", *meta))

    brokers = table(ok(run_qmq("admin", "brokers", *meta)))
    realtime = [(b["group"], b["address"], b["state"]) for b in brokers if b["kind"] == "realtime"]
    assert realtime == [("realtime-1", up.address, "rw")]
    if up.delay_address:  # qmq up runs a delay server too once it exists
        delay = [(b["group"], b["address"]) for b in brokers if b["kind"] == "delay"]
        assert delay == [("delay-1", up.delay_address)]
    subjects = table(ok(run_qmq("admin", "subjects", *meta)))
    # The consumer also subscribed its group's retry subject (%retry%demo.lag%g1).
    user_subjects = [s for s in subjects if not s["subject"].startswith("%")]
    assert [(s["subject"], s["groups"]) for s in user_subjects] == [("demo.lag", "realtime-1")]

    def g1_lag() -> str | None:
        groups = table(ok(run_qmq("admin", "groups", *meta)))
        row = [g for g in groups if (g["subject"], g["group"]) == ("demo.lag", "g1")]
        return row[0]["lag"] if row and row[0]["lag"] == "3" else None

    # The broker reports its backlog with its heartbeat (every 5 s under qmq up).
    assert wait_until(g1_lag, 30, "qmq admin groups to show g1 three messages behind",
                      interval_s=0.5) == "3"


@pytest.mark.timeout(120)
def test_qmq_admin_readonly_sends_producers_elsewhere_and_readonly_everywhere_refuses_them(cluster):
    up = cluster.start_up()
    meta = ("--meta", up.meta_url)
    cluster.keep(start_realtime(up.meta_url, str(cluster.root / "rt2"), "rt2"))

    def realtime_groups() -> dict[str, str]:
        return {b["group"]: b["state"] for b in admin(up.meta_url, "brokers")
                if b["kind"] == "realtime"}

    wait_until(lambda: realtime_groups() == {"realtime-1": "rw", "rt2": "rw"}, 20,
               "both realtime groups to register")
    first = receipts(ok(run_qmq("send", "demo.ro", "before", *meta)))
    # The copies of one command go to both groups, as an application's sends do.
    spread = [json.loads(line) for line in ok(run_qmq(
        "send", "demo.spread", "x", "--count", "4", "--json", *meta)).splitlines()]
    assert sorted(r["group"] for r in spread) == ["realtime-1", "realtime-1", "rt2", "rt2"]

    assert json.loads(ok(run_qmq("admin", "readonly", "realtime-1", "on", *meta)))["readonly"]
    elsewhere = [r for _ in range(3) for r in receipts(ok(run_qmq("send", "demo.ro", "x", *meta)))]
    assert {r["group"] for r in elsewhere} == {"rt2"}
    brokers = {b["group"]: b["state"] for b in table(ok(run_qmq("admin", "brokers", *meta)))
               if b["kind"] == "realtime"}
    assert brokers == {"realtime-1": "readonly", "rt2": "rw"}
    # Consumers still drain the readonly group.
    drained = ok(run_qmq("consume", "demo.ro", "--group", "g1", "--start", "earliest",
                         "--count", "4", *meta))
    assert {json.loads(line)["id"] for line in drained.splitlines()} == {
        r["id"] for r in first + elsewhere}

    ok(run_qmq("admin", "readonly", "rt2", "on", *meta))
    refused = run_qmq("send", "demo.ro", "nowhere", *meta)
    assert refused.returncode != 0
    assert "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("qmq: send failed: ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [
    ("send", "demo", "hello"),
    ("admin", "brokers"),
    ("admin", "dead", "list"),
    ("consume", "demo", "--group", "g1", "--count", "1"),
    ("schedule", "list"),
])
def test_a_command_against_an_unreachable_metaserver_exits_3_with_one_clear_line(command):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_qmq(*command, "--meta", url, timeout_s=45)
    assert result.returncode == 3, (result.returncode, result.stderr)  # EXIT_UNAVAILABLE
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("qmq: ") and url in last, last
    assert re.search(r"unreachable|cannot reach|cannot connect", last, re.I), last


def test_qmq_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    done = run_qmq("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"qmq (pyqmq) {version('pyqmq')}"


@pytest.mark.parametrize("meta", ["127.0.0.1:8090", "localhost:8090,http://10.0.0.1:8090"])
def test_a_meta_url_without_a_scheme_is_refused_with_the_url_it_probably_meant(meta) -> None:
    done = run_qmq("send", "demo", "hi", "--meta", meta)
    first = meta.split(",")[0]
    assert done.returncode == 2 and f"did you mean http://{first}?" in done.stderr, done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_qmq_up_says_each_start_and_stop_line_once(cluster, log_format) -> None:
    args = [sys.executable, "-m", "qmq", "--log-format", log_format, "up", "--data-dir",
            str(cluster.root / "up"), "--meta-port", "0", "--realtime-port", "0", "--delay-port",
            "0"]
    process, output, _ = _spawn("qmq up", args, re.compile(r"(Ctrl-C) stops everything"))
    process.send_signal(2)  # Ctrl-C
    assert process.wait(60) == 0
    lines = [line for line in "".join(output).splitlines() if line.strip()]
    if log_format == "json":
        records = [json.loads(line) for line in lines]  # every line is one JSON object
        assert {"ts", "level", "logger", "message"} <= set(records[0])
        lines = [record["message"] for record in records]
    for said in ("metaserver  http://", "realtime    ", "Ctrl-C stops everything",
                 "delay group delay-1 stopped in", "realtime group realtime-1 stopped in",
                 "metaserver stopped"):
        assert sum(said in line for line in lines) == 1, (said, lines)


@pytest.mark.parametrize("argv, usage", [
    (["admin", "dead", "show", "--help"], "usage: qmq admin dead show [-h]"),
    (["admin", "tokens", "create", "--help"], "usage: qmq admin tokens create [-h]"),
    (["admin", "readonly", "--help"], "usage: qmq admin readonly [-h]"),
])
def test_each_admin_command_has_its_own_help(argv, usage) -> None:
    done = run_qmq(*argv)
    assert done.returncode == 0 and done.stdout.startswith(usage), done.stdout


@pytest.mark.parametrize("argv, said", [
    (["admin", "nope"], "invalid choice: 'nope' (choose from 'brokers', "),
    (["admin", "dead", "show", "rt1"], "the following arguments are required: DEAD_SUBJECT"),
    (["admin", "readonly", "rt1", "maybe"], "invalid choice: 'maybe' (choose from 'on', 'off')"),
    (["admin", "tokens", "revoke", "x"], "argument ID: invalid int value: 'x'"),
    (["send", "demo", "hi", "--prop", "novalue"], "property 'novalue' must look like key=value"),
])
def test_a_usage_error_exits_2_naming_what_is_wrong(argv, said) -> None:
    done = run_qmq(*argv, "--meta", "http://127.0.0.1:9")
    assert done.returncode == 2 and said in done.stderr, done.stderr
