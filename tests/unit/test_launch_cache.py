"""spark_audit.launch: the driver JVM's command line, recorded from a JVM spark-submit started,
keyed by everything the launcher reads, and started directly by later audits; any failure
falls back to spark-submit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from spark_audit import launch
from spark_audit.launch import Entry, entry_of, launch_key, load, start, stop, store

# Stands in for the driver JVM: writes a port and a secret where pyspark's handshake expects
# them (a 4-byte port, a 4-byte length, the secret), then lives until its stdin closes.
FAKE_DRIVER = """
import os, struct, sys
path = os.environ["_PYSPARK_DRIVER_CONN_INFO_PATH"]
secret = os.environ.get("FAKE_SECRET", "s3cret").encode()
with open(path + ".tmp", "wb") as file:
    file.write(struct.pack(">i", 40123) + struct.pack(">i", len(secret)) + secret)
os.rename(path + ".tmp", path)
sys.stdin.read()
"""


def _fake_java(tmp_path) -> str:
    """A 'java' the launch module accepts as a driver JVM's argv[0] (a link to Python)."""
    java = tmp_path / "bin" / "java"
    java.parent.mkdir()
    java.symlink_to(sys.executable)
    return str(java)


def _wait_for(predicate, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_the_key_changes_with_the_settings_their_order_and_the_launchers_environment():
    settings = [("spark.master", "local[2]"), ("spark.driver.memory", "6g")]
    environ = {"HOME": "/root", "PATH": "/usr/bin"}
    key = launch_key(settings, environ)
    assert key is not None and key == launch_key(list(settings), dict(environ))
    assert launch_key(settings[::-1], environ) != key
    assert launch_key([*settings, ("spark.x", "1")], environ) != key
    assert launch_key(settings, {**environ, "SPARK_CONF_DIR": "/etc/spark"}) != key
    assert launch_key(settings, {**environ, "JAVA_HOME": "/opt/jdk"}) != key
    assert launch_key(settings, {**environ, "PATH": "/opt/bin:/usr/bin"}) != key
    # What the launcher does not read leaves the key as it was.
    assert launch_key(settings, {**environ, "TERM": "xterm", "PWD": "/tmp"}) == key


def test_the_key_changes_when_a_file_of_the_conf_directory_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    settings = [("spark.master", "local[2]")]
    before = launch_key(settings, dict(os.environ))
    (tmp_path / "spark-defaults.conf").write_text("spark.driver.memory 4g\n")
    assert launch_key(settings, dict(os.environ)) != before


def test_a_driver_jvms_command_and_the_variables_its_scripts_added_are_recorded(tmp_path):
    java = _fake_java(tmp_path)
    started_with = {"HOME": "/root", "KEPT": "same", "DROPPED": "x", "SPARK_HOME": "/old"}
    env = {"HOME": "/root", "KEPT": "same", "SPARK_HOME": "/spark", "SPARK_ENV_LOADED": "1",
           "_PYSPARK_DRIVER_CONN_INFO_PATH": "/tmp/conn", "_": "/usr/bin/java"}
    argv = [java, "-c", "import sys; sys.stdin.read()", "-Xmx6g", launch.DRIVER_MAIN_CLASS,
            "--conf", "spark.master=local[2]", "pyspark-shell"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
    try:
        _wait_for(lambda: (entry_of(proc.pid, started_with) or Entry((), {}, ())).argv)
        entry = entry_of(proc.pid, started_with)
    finally:
        stop(proc)
    assert entry is not None
    assert entry.argv == tuple(argv)
    # The connection file is per start and bash's "_" is noise: neither is carried.
    assert entry.env == {"SPARK_HOME": "/spark", "SPARK_ENV_LOADED": "1"}
    assert entry.unset == ("DROPPED",)


def test_a_process_that_is_not_a_pyspark_driver_jvm_is_not_recorded(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        assert entry_of(proc.pid, {}) is None
    finally:
        stop(proc)
    assert entry_of(proc.pid, {}) is None  # gone


def test_a_stored_entry_reads_back_and_only_the_newest_entries_are_kept(tmp_path):
    entry = Entry(("/usr/bin/java", "-cp", "x", launch.DRIVER_MAIN_CLASS, "pyspark-shell"),
                  {"SPARK_HOME": "/spark"}, ("DROPPED",))
    directory = str(tmp_path / "cache")
    assert store(directory, "k0", entry)
    assert load(directory, "k0") == entry
    assert load(directory, "absent") is None
    (tmp_path / "cache" / "broken.json").write_text("{")
    assert load(directory, "broken") is None
    os.remove(tmp_path / "cache" / "broken.json")
    now = time.time_ns()
    for i in range(1, launch.ENTRIES_MAX):  # k0 oldest, then k1, ... (one a second)
        store(directory, f"k{i}", entry)
    for i in range(launch.ENTRIES_MAX):
        stamp = now - (launch.ENTRIES_MAX - i) * 10**9
        os.utime(tmp_path / "cache" / f"k{i}.json", ns=(stamp, stamp))
    store(directory, "newest", entry)
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(names) == launch.ENTRIES_MAX
    assert "k0.json" not in names and "k1.json" in names and "newest.json" in names
    assert not [name for name in names if name.endswith(".tmp")]


def test_a_cached_command_is_started_and_its_port_and_secret_read(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SECRET", "not-the-default")
    entry = Entry((sys.executable, "-c", FAKE_DRIVER), {"ADDED_BY_SCRIPTS": "1"}, ())
    started = start(entry, wait_s=120)
    assert started is not None
    proc, port, secret = started
    try:
        assert (port, secret) == (40123, "not-the-default")
        assert proc.poll() is None  # lives while its stdin is open
    finally:
        stop(proc)
    assert proc.returncode == 0  # it ended on its stdin's EOF


def test_a_cached_command_that_exits_before_its_handshake_is_given_up(tmp_path, caplog):
    entry = Entry((sys.executable, "-c", "raise SystemExit(3)"), {}, ())
    assert start(entry, wait_s=120) is None
    assert "exited with 3" in caplog.text


def test_a_cached_command_that_never_writes_its_connection_file_is_stopped(tmp_path, caplog):
    entry = Entry((sys.executable, "-c", "import sys; sys.stdin.read()"), {}, ())
    assert start(entry, wait_s=0.5) is None
    assert "wrote no connection file" in caplog.text


def test_a_cached_command_whose_program_is_gone_is_given_up(tmp_path, caplog):
    assert start(Entry((str(tmp_path / "no-java"), "x"), {}, ()), wait_s=120) is None
    assert "could not be started" in caplog.text


def test_the_cache_is_off_when_its_directory_says_so(monkeypatch):
    monkeypatch.setenv(launch.LAUNCH_CACHE_ENV, "off")
    assert launch.default_directory() == "off"
    monkeypatch.delenv(launch.LAUNCH_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/me")
    assert launch.default_directory() == "/var/cache/me/pyqmq/audit-launch"
