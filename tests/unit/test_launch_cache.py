"""spark_audit.launch: the driver JVM's command line, recorded from a JVM spark-submit started,
keyed by everything the launcher reads, and started directly by later audits; any failure
falls back to spark-submit."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

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


@pytest.fixture
def fake_java(tmp_path, monkeypatch) -> str:
    """A 'java' the launch module accepts as a driver JVM's argv[0] (a link to Python), made
    this environment's java ($JAVA_HOME/bin/java)."""
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.symlink_to(sys.executable)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    return str(java)


def _driver_entry(java: str) -> Entry:
    return Entry((java, "-cp", "x", launch.DRIVER_MAIN_CLASS, "pyspark-shell"),
                 {"SPARK_HOME": "/spark"}, ("DROPPED",))


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


def test_a_driver_jvms_command_and_the_variables_its_scripts_added_are_recorded(fake_java):
    java = fake_java
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


def test_a_stored_entry_reads_back_and_only_the_newest_entries_are_kept(tmp_path, fake_java):
    entry = _driver_entry(fake_java)
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


def test_the_cache_directory_is_made_for_its_owner_only(tmp_path, fake_java):
    directory = tmp_path / "cache"
    assert store(str(directory), "k", _driver_entry(fake_java))
    assert directory.stat().st_mode & 0o777 == 0o700
    assert (directory / "k.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("where, mode", [("directory", 0o777), ("directory", 0o770),
                                         ("entry", 0o666), ("entry", 0o620)])
def test_an_entry_others_could_have_written_is_refused_and_forgotten(tmp_path, fake_java, caplog,
                                                                     where, mode):
    directory = tmp_path / "cache"
    store(str(directory), "k", _driver_entry(fake_java))
    os.chmod(directory if where == "directory" else directory / "k.json", mode)
    assert load(str(directory), "k") is None
    assert "writable by its group or others" in caplog.text
    assert not (directory / "k.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
def test_an_entry_another_user_owns_is_refused_and_forgotten(tmp_path, fake_java, caplog):
    directory = tmp_path / "cache"
    store(str(directory), "k", _driver_entry(fake_java))
    os.chown(directory / "k.json", 12345, 12345)
    assert load(str(directory), "k") is None
    assert "belongs to uid 12345" in caplog.text
    assert not (directory / "k.json").exists()
    store(str(directory), "k", _driver_entry(fake_java))
    os.chown(directory, 12345, 12345)
    assert load(str(directory), "k") is None
    assert "belongs to uid 12345" in caplog.text


@pytest.mark.parametrize("argv", [
    [sys.executable, "-c", "exit(7)"],  # not java
    ["/opt/other-jdk/bin/java", "-cp", "x", launch.DRIVER_MAIN_CLASS, "pyspark-shell"],
    ["JAVA", "-cp", "x", "org.example.Main", "pyspark-shell"],  # not SparkSubmit's driver
    ["JAVA", "-cp", "x", launch.DRIVER_MAIN_CLASS, "--conf", "a=b"],  # not pyspark's
])
def test_an_entry_that_is_not_this_javas_driver_command_is_refused_and_forgotten(
        tmp_path, fake_java, caplog, argv):
    directory = tmp_path / "cache"
    store(str(directory), "k", _driver_entry(fake_java))
    path = directory / "k.json"
    path.write_text(json.dumps({"argv": [fake_java if arg == "JAVA" else arg for arg in argv],
                                "env": {}, "unset": []}))
    assert load(str(directory), "k") is None
    assert "does not run this java as SparkSubmit's driver" in caplog.text
    assert not path.exists()


def test_settings_or_java_properties_named_like_secrets_are_found():
    argv = ["java", "-Dio.netty.allocator.type=pooled", "-Dmy.Password=x",
            launch.DRIVER_MAIN_CLASS, "--conf", "spark.hadoop.fs.s3a.secret.key=abc",
            "--conf", "spark.master=local[2]", "pyspark-shell"]
    settings = [("spark.master", "local[2]"), ("spark.authenticate.TOKEN", "t")]
    assert launch.secret_names(settings, argv) == [
        "my.Password", "spark.authenticate.TOKEN", "spark.hadoop.fs.s3a.secret.key"]
    assert launch.secret_names([("spark.master", "local[2]")], argv[:2]) == []


def _driver_process(java: str, settings) -> subprocess.Popen:
    confs = [item for name, value in settings for item in ("--conf", f"{name}={value}")]
    return subprocess.Popen([java, "-c", "import sys; sys.stdin.read()",
                             launch.DRIVER_MAIN_CLASS, *confs, "pyspark-shell"],
                            stdin=subprocess.PIPE)


@pytest.mark.parametrize("name, stored", [("spark.sql.shuffle.partitions", True),
                                          ("spark.hadoop.fs.s3a.secret.key", False)])
def test_a_start_whose_settings_name_a_secret_is_not_cached(tmp_path, fake_java, monkeypatch,
                                                             caplog, name, stored):
    from pyspark.core.context import SparkContext

    caplog.set_level(logging.INFO, logger=launch.__name__)
    settings = [("spark.master", "local[1]"), (name, "2")]
    proc = _driver_process(fake_java, settings)
    monkeypatch.setattr(SparkContext, "_gateway", None)

    def get_or_create():  # stands in for pyspark's start through spark-submit
        SparkContext._gateway = SimpleNamespace(proc=proc)
        _wait_for(lambda: entry_of(proc.pid, {}) is not None)
        return "session"

    builder = SimpleNamespace(_options=dict(settings), getOrCreate=get_or_create)
    directory = tmp_path / "cache"
    try:
        assert launch.get_or_create(builder, settings, str(directory)) == "session"
    finally:
        stop(proc)
    assert bool(list(directory.glob("*.json"))) is stored
    assert ("would be written in clear" in caplog.text) is not stored


def test_a_session_that_fails_after_its_context_was_built_leaves_no_active_context(
        monkeypatch, caplog):
    """The fallback's getOrCreate must not find the failed context (its JVM is stopped)."""
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession

    jvm = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                           stdin=subprocess.PIPE)
    monkeypatch.setattr(launch, "start", lambda entry: (jvm, 40123, "secret"))
    monkeypatch.setattr(SparkContext, "_gateway", None)
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    monkeypatch.setattr(SparkSession, "_instantiatedSession", None)
    monkeypatch.setattr(SparkSession, "_activeSession", None)
    stopped = []

    def failing_get_or_create():  # the context is built, then the session fails (injected)
        context = SimpleNamespace(stop=lambda: stopped.append(True))
        SparkContext._active_spark_context = context
        SparkSession._instantiatedSession = SparkSession._activeSession = SimpleNamespace(
            _sc=context)
        raise RuntimeError("injected after the SparkContext was built")

    forgotten = []
    builder = SimpleNamespace(getOrCreate=failing_get_or_create)
    assert launch._from_entry(builder, Entry(("java",), {}, ()),
                              lambda: forgotten.append(True)) is None
    assert "injected after the SparkContext was built" in caplog.text
    assert stopped == [True] and forgotten == [True]
    assert SparkContext._active_spark_context is None
    assert SparkSession._instantiatedSession is None and SparkSession._activeSession is None
    assert jvm.wait(timeout=60) == 0  # stopped: its stdin closed
