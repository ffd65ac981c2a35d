"""Start the audit's driver JVM from a cached command line instead of through spark-submit.

PySpark starts its driver JVM by running ``bin/spark-submit``: two shell scripts, then a first
JVM (``org.apache.spark.launcher.Main``) whose only work is to print the driver JVM's command
line (class path, memory, Java options, module flags), then that command. The launcher JVM and
the scripts cost 0.5-1 s of a small audit's critical path (docs/AUDIT.md, Performance).

The command depends only on what the launcher reads: the Spark settings pyspark passes
(``--conf``), the environment the scripts and the launcher see, the Java binary, the Spark home
with its jars and its conf directory. So:

1. A local audit whose key (``launch_key``: all of that hashed) has no cached command starts
   the usual way. Once its JVM runs, the JVM's own command line and the environment variables
   the scripts added are read from ``/proc/<pid>/cmdline`` and ``environ`` (the scripts exec
   the JVM, so pyspark's child is the driver itself) and stored as ``<dir>/<key>.json``.
2. An audit that finds its key's command starts that command itself, waits for the JVM to
   write its connection file (what spark-submit's JVM does for pyspark), and hands the port and
   secret to pyspark through ``PYSPARK_GATEWAY_PORT`` / ``PYSPARK_GATEWAY_SECRET``, pyspark's
   own way to attach to a JVM that already runs. The JVM exits when this process's end of its
   stdin closes, as it does when spark-submit started it.
3. Any doubt falls back to the usual start, logged: a key that cannot be computed, a JVM that
   exits before it writes its connection file or does not write it in time, a session that
   fails over the directly started JVM (that cached command is removed).

Only local masters use it: the goal it serves is a small local audit's start, and a cluster's
launcher reads more than the key covers (Hadoop and YARN configuration directories' contents).
``off`` (``$QMQ_AUDIT_LAUNCH_CACHE_DIR`` or ``--launch-cache-dir``) turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from spark_audit import class_archive

LAUNCH_CACHE_ENV = "QMQ_AUDIT_LAUNCH_CACHE_DIR"  # a directory, or "off"
OFF = "off"
FORMAT = 1  # of the cached entries; part of the key
# Environment variables the scripts and the launcher read (or that name what they read):
# every one with these prefixes, and these names.
KEY_ENV_PREFIXES = ("SPARK_", "PYSPARK_", "HADOOP_", "YARN_", "HIVE_", "JAVA_", "_JAVA_", "JDK_")
KEY_ENV_NAMES = ("PATH", "CLASSPATH", "MASTER")
# Set per start: the file the JVM writes its port and secret to.
CONN_INFO_ENV = "_PYSPARK_DRIVER_CONN_INFO_PATH"
GATEWAY_PORT_ENV, GATEWAY_SECRET_ENV = "PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET"
# Never carried from a recorded environment: bash's last-argument variable.
_NOT_RECORDED = frozenset({CONN_INFO_ENV, "_"})
ENTRIES_MAX = 16  # cached commands kept (the oldest removed): one per key in use
CONN_INFO_POLL_S = 0.01  # pyspark polls every 0.1 s: on average 50 ms of the critical path
# The direct start's JVM must write its connection file within this; a JVM started the usual
# way took up to 120 s under a load average of 15 (tests/spark/conftest.py).
CONN_INFO_WAIT_S = 300.0
DRIVER_MAIN_CLASS = "org.apache.spark.deploy.SparkSubmit"
# A setting or Java property whose name says it holds a secret: its value would be written to
# the entry in clear, so no entry is stored for a start that has one.
SECRET_NAME = re.compile(r"secret|password|token|key", re.IGNORECASE)
# Write bits for others than the owner: anyone with them could put a command in the cache.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH

log = logging.getLogger(__name__)


def default_directory() -> str:
    """$QMQ_AUDIT_LAUNCH_CACHE_DIR, else $XDG_CACHE_HOME (or ~/.cache)/pyqmq/audit-launch."""
    return class_archive.cache_directory(LAUNCH_CACHE_ENV, "audit-launch")


@dataclass(frozen=True)
class Entry:
    """A cached start: the driver JVM's argv, and the environment variables spark-submit's
    scripts set (``env``) or removed (``unset``) on top of this process's environment."""

    argv: tuple[str, ...]
    env: dict[str, str]
    unset: tuple[str, ...]


def _conf_dir_state(spark_home: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of every file of the conf directory the scripts read
    (spark-env.sh, spark-defaults.conf, ...)."""
    conf_dir = os.environ.get("SPARK_CONF_DIR") or os.path.join(spark_home, "conf")
    state = []
    for name in sorted(os.listdir(conf_dir)) if os.path.isdir(conf_dir) else ():
        info = os.stat(os.path.join(conf_dir, name))
        state.append((name, info.st_size, info.st_mtime_ns))
    return state


def key_environment(environ: dict[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that take part in the key (KEY_ENV_PREFIXES, _NAMES)."""
    return {name: value for name, value in sorted(environ.items())
            if name.startswith(KEY_ENV_PREFIXES) or name in KEY_ENV_NAMES}


def launch_key(settings: Sequence[tuple[str, str]], environ: dict[str, str]) -> str | None:
    """A name for the driver command of these Spark settings (in the order pyspark passes
    them) in this environment, or None when it cannot be computed (no java, no Spark home)."""
    java = class_archive.java_binary()
    if java is None:
        return None
    import pyspark  # lazily: only the audit needs it
    from pyspark.find_spark_home import _find_spark_home

    try:
        spark_home = _find_spark_home()
        # Java binary, pyspark version, Spark home and its jars: the class archive's key.
        base = class_archive.archive_key(java, spark_home, pyspark.__version__)
        described = json.dumps([FORMAT, base, list(settings), key_environment(environ),
                                _conf_dir_state(spark_home)])
    except (OSError, SystemExit):  # _find_spark_home exits when it finds none
        return None
    return hashlib.sha256(described.encode()).hexdigest()[:24]


def _unsafe(path: str) -> str | None:
    """Why ``path`` (the cache directory or an entry) may hold what someone else wrote, or
    None: it must belong to this process's effective user and be writable by no one else."""
    info = os.stat(path)
    if info.st_uid != os.geteuid():
        return f"{path} belongs to uid {info.st_uid}, not {os.geteuid()}"
    if info.st_mode & _OTHERS_WRITE:
        return f"{path} is writable by its group or others (mode {info.st_mode & 0o777:o})"
    return None


def is_driver_command(argv: Sequence[str], java: str | None) -> bool:
    """True when ``argv`` runs ``java`` (the binary the key was made for) as SparkSubmit's
    driver for pyspark: the only commands this module records or starts."""
    return (java is not None and len(argv) >= 3 and os.path.basename(argv[0]) == "java"
            and os.path.realpath(argv[0]) == os.path.realpath(java)
            and DRIVER_MAIN_CLASS in argv and argv[-1] == "pyspark-shell")


def load(directory: str, key: str) -> Entry | None:
    """The cached entry of ``key``, or None (absent or unreadable). An entry that is unsafe to
    run (the directory or file owned by another user or writable by others, or a command other
    than the driver JVM of this key's java) is refused, logged and removed."""
    path = os.path.join(directory, f"{key}.json")
    try:
        why = _unsafe(directory) or _unsafe(path)
        if why is None:
            with open(path) as file:
                data = json.load(file)
            entry = Entry(tuple(data["argv"]), dict(data["env"]), tuple(data["unset"]))
            if not is_driver_command(entry.argv, class_archive.java_binary()):
                why = f"{path} does not run this java as SparkSubmit's driver"
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if why is not None:
        log.warning("launch cache entry refused (%s); forgetting it and starting the driver "
                    "JVM through spark-submit", why)
        forget(directory, key)
        return None
    return entry


def secret_names(settings: Sequence[tuple[str, str]], argv: Sequence[str]) -> list[str]:
    """The names of ``settings``, of ``--conf`` values and of ``-D`` Java properties in
    ``argv`` that look like they hold a secret (SECRET_NAME)."""
    names = [name for name, _ in settings]
    names += [arg.split("=", 1)[0] for previous, arg in zip(("", *argv), argv)
              if previous == "--conf" and "=" in arg]
    names += [arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("-D")]
    return sorted({name for name in names if SECRET_NAME.search(name)})


def forget(directory: str, key: str) -> None:
    """Remove ``key``'s cached entry (it failed)."""
    try:
        os.remove(os.path.join(directory, f"{key}.json"))
    except OSError:
        pass


def _read_proc(pid: int) -> tuple[list[str], dict[str, str]] | None:
    """Process ``pid``'s argv and initial environment, or None (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = [arg.decode() for arg in file.read().split(b"\0")[:-1]]
        with open(f"/proc/{pid}/environ", "rb") as file:
            pairs = [item.decode().split("=", 1) for item in file.read().split(b"\0") if item]
    except (OSError, UnicodeDecodeError):
        return None
    return argv, {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def entry_of(pid: int, started_with: dict[str, str]) -> Entry | None:
    """The entry of a driver JVM ``pid`` that pyspark started the usual way with the
    environment ``started_with``, or None when ``pid`` is not such a JVM."""
    found = _read_proc(pid)
    if found is None:
        return None
    argv, environ = found
    if not is_driver_command(argv, class_archive.java_binary()):
        return None
    added = {name: value for name, value in environ.items()
             if name not in _NOT_RECORDED and started_with.get(name) != value}
    removed = tuple(sorted(name for name in started_with
                           if name not in environ and name not in _NOT_RECORDED))
    return Entry(tuple(argv), added, removed)


def store(directory: str, key: str, entry: Entry) -> bool:
    """Write ``entry`` as ``key``'s (atomically: a concurrent audit reads all of it or
    nothing) and keep at most ENTRIES_MAX entries. False when the directory is not writable.
    The directory is made 0700 and the entry is 0600: it holds every ``--conf`` value."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as file:
            json.dump({"argv": list(entry.argv), "env": entry.env,
                       "unset": list(entry.unset)}, file)
        os.replace(tmp, os.path.join(directory, f"{key}.json"))
        _prune(directory)
    except OSError:
        return False
    return True


def _prune(directory: str) -> None:
    entries = []
    for name in os.listdir(directory):
        if name.endswith(".json") and not name.startswith("."):
            try:
                entries.append((os.stat(os.path.join(directory, name)).st_mtime_ns, name))
            except OSError:
                pass
    for _, name in sorted(entries)[:-ENTRIES_MAX]:
        try:
            os.remove(os.path.join(directory, name))
        except OSError:
            pass


def _ignore_interrupt() -> None:
    # As pyspark does: Ctrl-C stops the audit's Python, not the JVM under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start(entry: Entry, wait_s: float = CONN_INFO_WAIT_S
          ) -> tuple[subprocess.Popen, int, str] | None:
    """Start ``entry``'s JVM; (its process, gateway port, secret) once it has written its
    connection file, or None (logged, the JVM stopped) when it exits first or is not done
    within ``wait_s``."""
    from pyspark.serializers import UTF8Deserializer, read_int

    conn_dir = tempfile.mkdtemp(prefix="qmq-audit-launch-")
    conn_info = os.path.join(conn_dir, "conn-info")
    env = dict(os.environ)
    env.update(entry.env)
    for name in entry.unset:
        env.pop(name, None)
    env[CONN_INFO_ENV] = conn_info
    try:
        # stdin: the JVM exits when it reads EOF, i.e. when this process ends.
        proc = subprocess.Popen(list(entry.argv), stdin=subprocess.PIPE, env=env,
                                preexec_fn=_ignore_interrupt)
        deadline = time.monotonic() + wait_s
        while proc.poll() is None and not os.path.isfile(conn_info):
            if time.monotonic() >= deadline:
                break
            time.sleep(CONN_INFO_POLL_S)
        if not os.path.isfile(conn_info):
            state = (f"exited with {proc.returncode}" if proc.poll() is not None
                     else f"wrote no connection file in {wait_s:.0f} s")
            log.warning("the driver JVM started from the launch cache %s; starting it "
                        "through spark-submit", state)
            stop(proc)
            return None
        with open(conn_info, "rb") as info:
            port = read_int(info)
            secret = UTF8Deserializer().loads(info)
    except OSError as exc:
        log.warning("the driver JVM could not be started from the launch cache (%s); "
                    "starting it through spark-submit", exc)
        return None
    finally:
        for name in os.listdir(conn_dir):
            os.remove(os.path.join(conn_dir, name))
        os.rmdir(conn_dir)
    return proc, port, secret


def stop(proc: subprocess.Popen) -> None:
    """Stop a JVM this module started (its stdin closed, then killed if it lingers)."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


@contextmanager
def _attach_to(port: int, secret: str) -> Iterator[None]:
    """pyspark's launch_gateway attaches to a running JVM named by these variables."""
    os.environ[GATEWAY_PORT_ENV], os.environ[GATEWAY_SECRET_ENV] = str(port), secret
    try:
        yield
    finally:
        os.environ.pop(GATEWAY_PORT_ENV, None)
        os.environ.pop(GATEWAY_SECRET_ENV, None)


def _forget_gateway() -> None:
    """Undo a failed attach: the next session starts a JVM of its own."""
    from pyspark.core.context import SparkContext

    gateway = SparkContext._gateway
    SparkContext._gateway, SparkContext._jvm = None, None
    if gateway is not None:
        try:
            gateway.shutdown()
        except Exception:  # best effort: the JVM is stopped next anyway
            pass


def _forget_session() -> None:
    """Undo a session that failed over a JVM this module started, once its SparkContext was
    built: stop that context (its JVM still runs) and clear pyspark's active context and
    sessions, which the fallback's getOrCreate would otherwise return over a stopped JVM."""
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession
    from pyspark.sql.context import SQLContext

    active = SparkContext._active_spark_context
    if active is not None:
        try:
            active.stop()
        except Exception:  # best effort: the JVM is stopped next anyway
            pass
    SparkContext._active_spark_context = None
    SparkSession._instantiatedSession, SparkSession._activeSession = None, None
    SQLContext._instantiatedContext = None


def get_or_create(builder: Any, settings: Sequence[tuple[str, str]], directory: str | None,
                  record: bool = True) -> Any:
    """``builder.getOrCreate()``, its driver JVM started from the launch cache under
    ``directory`` (None or ``off``: never) when it holds this start's command; else the usual
    way, storing the command for the next audit when ``record`` (False when the JVM options
    name this process, e.g. a class list being recorded: no later start would match).

    ``settings`` are the builder's Spark settings in the order they were given; a builder
    holding other ones (another pyspark) is started the usual way."""
    from pyspark.core.context import SparkContext

    ordered = list(dict(settings).items())
    started_with = dict(os.environ)
    usable = (directory and directory != OFF and SparkContext._gateway is None
              and GATEWAY_PORT_ENV not in started_with
              and list(getattr(builder, "_options", {}).items()) == ordered)
    key = launch_key(ordered, started_with) if usable else None
    if key is None:
        return builder.getOrCreate()
    entry = load(directory, key)
    if entry is not None:
        session = _from_entry(builder, entry, lambda: forget(directory, key))
        if session is not None:
            log.info("started the driver JVM from the launch cache: %s/%s.json", directory, key)
            return session
    session = builder.getOrCreate()
    proc = getattr(SparkContext._gateway, "proc", None)
    if record and proc is not None:
        found = entry_of(proc.pid, started_with)
        secrets = secret_names(settings, found.argv) if found is not None else []
        if secrets:
            log.info("the driver JVM's command is not cached: it holds %s, whose values "
                     "would be written in clear", ", ".join(secrets))
        elif found is not None and store(directory, key, found):
            log.info("cached the driver JVM's command for later audits: %s/%s.json",
                     directory, key)
    return session


def _from_entry(builder: Any, entry: Entry, forget_entry: Callable[[], None]) -> Any:
    """The session over a JVM started from ``entry``, or None (the entry forgotten, the JVM
    stopped, pyspark's state as before) when it fails."""
    from pyspark.core.context import SparkContext

    started = start(entry)
    if started is None:
        forget_entry()
        return None
    proc, port, secret = started
    try:
        with _attach_to(port, secret):
            session = builder.getOrCreate()
    except Exception as exc:  # any failure: the usual start decides
        log.warning("a session over the driver JVM started from the launch cache failed "
                    "(%s: %s); starting it through spark-submit", type(exc).__name__, exc)
        _forget_session()
        _forget_gateway()
        stop(proc)
        forget_entry()
        return None
    SparkContext._gateway.proc = proc  # as launch_gateway leaves it (the JVM's process)
    return session
