"""A JVM class-data-sharing (CDS) archive of the audit's driver JVM, built once, used by every
later ``qmq audit``.

A small audit's driver JVM spends about a quarter of its CPU loading and verifying the ~17,000
classes Spark needs, looked up one by one through ~280 jars. A static CDS archive holds them
parsed and verified, mapped from one file. Making it safely, with audits running concurrently:

1. An audit that finds no archive starts its JVM with ``-XX:DumpLoadedClassList=<list>``
   (its own file, named by its process id; costs nothing measurable) and, once its verdict is
   known, records the JVM's class path and module options beside the list and starts a
   detached builder (``python -m spark_audit.class_archive <recording>``).
2. The builder waits for that JVM to exit (it exits with the audit's process, and only then is
   the list complete), takes the directory's build lock (a second builder gives up at once),
   runs ``java -Xshare:dump`` over the list into a temporary file and renames it into place:
   a JVM opening the archive sees the whole file or none. A dump that fails leaves a
   ``.failed`` file (with its output), so no later audit tries again for that key.
3. The first audit that finds the archive but no top layer also starts its JVM with
   ``-XX:ArchiveClassesAtExit=<its own temporary file>``: at its exit the JVM writes a dynamic
   archive, on top of the static one, of classes that one does not hold (a 10k-event audit
   loaded 6,415 of its 21,013 classes from elsewhere, most of them lambda proxies Spark's
   Scala code spins at run time; reflection accessors and signed jars' classes are in no
   archive). Its builder waits for that JVM to exit, takes the lock, checks that a JVM opens
   the layer (``-Xshare:on``), and renames it to ``<key>.top.jsa``, or leaves
   ``<key>.top.failed`` and no later audit tries again.
4. Later audits start their JVM with ``-XX:SharedArchiveFile=<archive>[:<top layer>]``. The
   JVM checks the archive against its own version and class path and ignores it (it then loads
   classes as usual) when they differ; the key also changes with the Java binary, the pyspark
   version, its Spark home (each virtualenv has its own) and its jars, so an upgrade builds a
   new archive rather than reuse a stale one.

The dump is expensive once (about a minute and a half of CPU on the benchmark machine, run at
a lower priority after the audit that recorded the list has exited) and saves about a quarter
of every later small audit's CPU (docs/AUDIT.md, Performance). Nothing here reads a clock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

ARCHIVE_DIR_ENV = "QMQ_AUDIT_CLASS_ARCHIVE_DIR"  # a directory, or "off"
OFF = "off"
DUMP_TIMEOUT_S = 1_800  # a dump took ~4 min of wall time on a loaded 2-core machine
JVM_EXIT_WAIT_S = 600  # the recording JVM exits with its audit, seconds after the verdict
JVM_EXIT_POLL_S = 0.5
BUILDER_NICENESS = 10  # the dump yields to audits and servers
# JVM warnings go to stderr: the driver JVM shares qmq audit's stdout, which may be --json.
JVM_LOG_OPTIONS = "-Xlog:disable -Xlog:all=warning:stderr"
# A JVM writing the top layer warns at its exit about each class no archive takes (~450 lines
# for a 10k-event audit: signed jars, reflection accessors), after qmq audit has returned.
TOP_RECORDING_LOG_OPTIONS = "-Xlog:cds*=off:stderr"
# Options of the recording JVM that the dump must repeat (modules and the GC shape an archive).
_DUMP_OPTION_PREFIXES = ("--add-", "-XX:+IgnoreUnrecognizedVMOptions", "-XX:+Use")


def cache_directory(env_name: str, leaf: str) -> str:
    """$``env_name`` when set, else $XDG_CACHE_HOME (or ~/.cache)/pyqmq/``leaf``: where the
    audit keeps what it caches between runs (this archive, the launch cache)."""
    configured = os.environ.get(env_name)
    if configured:
        return configured
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pyqmq", leaf)


def default_directory() -> str:
    """$QMQ_AUDIT_CLASS_ARCHIVE_DIR, else $XDG_CACHE_HOME (or ~/.cache)/pyqmq/audit-class-archive.
    ``off`` turns the archive off."""
    return cache_directory(ARCHIVE_DIR_ENV, "audit-class-archive")


def java_binary() -> str | None:
    """The java that pyspark's launcher runs: $JAVA_HOME/bin/java, else java on the PATH."""
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.exists(found) else None


def archive_key(java: str, spark_home: str, pyspark_version: str) -> str:
    """A name for the archive of this Java binary, pyspark version, Spark home and set of jars
    (the archive records the class path: another Spark home's JVM would ignore it)."""
    digest = hashlib.sha256()
    stat = os.stat(java)
    digest.update(f"{java}\0{stat.st_size}\0{stat.st_mtime_ns}\0{pyspark_version}\0"
                  f"{os.path.realpath(spark_home)}\0".encode())
    jars = os.path.join(spark_home, "jars")
    for name in sorted(os.listdir(jars)) if os.path.isdir(jars) else ():
        digest.update(f"{name}\0{os.path.getsize(os.path.join(jars, name))}\0".encode())
    return f"pyspark-{pyspark_version}-{digest.hexdigest()[:16]}"


@dataclass(frozen=True)
class ClassArchive:
    """Where one key's archive lives, and what a JVM started now does with it."""

    directory: str
    key: str
    java: str

    @property
    def archive_path(self) -> str:
        return os.path.join(self.directory, f"{self.key}.jsa")

    @property
    def failed_path(self) -> str:
        return os.path.join(self.directory, f"{self.key}.failed")

    @property
    def lock_path(self) -> str:
        return os.path.join(self.directory, f"{self.key}.lock")

    @property
    def top_path(self) -> str:
        """The dynamic layer over the archive (module docstring, step 3)."""
        return os.path.join(self.directory, f"{self.key}.top.jsa")

    @property
    def top_failed_path(self) -> str:
        return os.path.join(self.directory, f"{self.key}.top.failed")

    def top_tmp_path(self, pid: int) -> str:
        """The dynamic layer a recording JVM of audit process ``pid`` writes at its exit."""
        return os.path.join(self.directory, f"{self.key}.top.tmp-{pid}.jsa")

    def list_path(self, pid: int) -> str:
        """The class list a recording JVM of audit process ``pid`` writes."""
        return os.path.join(self.directory, f"{self.key}.classes-{pid}.lst")

    def ready(self) -> bool:
        """Whether the archive is in place."""
        return os.path.isfile(self.archive_path)

    def java_options(self, pid: int) -> tuple[str, bool]:
        """(driver JVM options, True if that JVM records its class list for a build)."""
        if self.ready():
            if os.path.isfile(self.top_path):
                return (f"-XX:SharedArchiveFile={self.archive_path}:{self.top_path} "
                        f"{JVM_LOG_OPTIONS}"), False
            if os.path.exists(self.top_failed_path):
                return f"-XX:SharedArchiveFile={self.archive_path} {JVM_LOG_OPTIONS}", False
            return (f"-XX:SharedArchiveFile={self.archive_path} "
                    f"-XX:ArchiveClassesAtExit={self.top_tmp_path(pid)} {JVM_LOG_OPTIONS} "
                    f"{TOP_RECORDING_LOG_OPTIONS}"), True
        if os.path.exists(self.failed_path):
            return JVM_LOG_OPTIONS, False
        return f"-XX:DumpLoadedClassList={self.list_path(pid)} {JVM_LOG_OPTIONS}", True


def plan(directory: str | None) -> ClassArchive | None:
    """The archive for this machine's java and pyspark under ``directory``, or None when it is
    off, there is no java, or the directory cannot be made or holds whitespace (Spark splits
    extraJavaOptions on it)."""
    if not directory or directory == OFF or any(c.isspace() for c in directory):
        return None
    java = java_binary()
    if java is None:
        return None
    import pyspark  # lazily: only the audit needs it
    from pyspark.find_spark_home import _find_spark_home

    try:
        os.makedirs(directory, exist_ok=True)
        key = archive_key(java, _find_spark_home(), pyspark.__version__)
    except OSError:
        return None
    return ClassArchive(os.path.abspath(directory), key, java)


def dump_options(input_arguments: list[str]) -> list[str]:
    """The recording JVM's options a dump must repeat (modules, GC)."""
    return [a for a in input_arguments if a.startswith(_DUMP_OPTION_PREFIXES)]


def start_build(archive: ClassArchive, spark: Any, pid: int) -> bool:
    """After a recording audit (``java_options`` said so), while its JVM still runs: write what
    the dump needs beside the class list and start the detached builder. False when the JVM's
    facts cannot be read or the builder cannot start (the list is then removed)."""
    list_path = archive.list_path(pid)
    # The class list exists from the JVM's start when it records one; else it writes the top.
    top = not os.path.exists(list_path)
    try:
        jvm = spark.sparkContext._jvm
        recording = {
            "archive_dir": archive.directory, "key": archive.key, "java": archive.java,
            "class_list": list_path, "top": archive.top_tmp_path(pid) if top else None,
            "class_path": str(jvm.java.lang.System.getProperty("java.class.path")),
            "options": dump_options(list(
                jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())),
            "jvm_pid": int(spark.sparkContext._gateway.proc.pid),
        }
        recording_path = (archive.top_tmp_path(pid) if top else list_path) + ".json"
        with open(recording_path, "w") as file:
            json.dump(recording, file)
        subprocess.Popen([sys.executable, "-m", "spark_audit.class_archive", recording_path],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except Exception:  # best effort: an audit never fails for its cache
        _remove(list_path, list_path + ".json", archive.top_tmp_path(pid) + ".json")
        return False
    return True


def _remove(*paths: str) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """True once process ``pid`` has exited, False if it still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(JVM_EXIT_POLL_S)
    return True


def dump_command(recording: dict, archive_tmp: str) -> list[str]:
    """``java -Xshare:dump`` over the recorded class list, with the recording JVM's class
    path and module options, into ``archive_tmp``."""
    return [recording["java"], "-Xshare:dump", *recording["options"],
            f"-XX:SharedClassListFile={recording['class_list']}",
            f"-XX:SharedArchiveFile={archive_tmp}", "-cp", recording["class_path"]]


def build(recording_path: str, jvm_exit_wait_s: float = JVM_EXIT_WAIT_S) -> str:
    """The builder (module docstring, step 2). Returns what it did: ``built``, ``exists``,
    ``busy`` (another builder holds the lock), ``jvm running`` or ``failed``."""
    with open(recording_path) as file:
        recording = json.load(file)
    archive = ClassArchive(recording["archive_dir"], recording["key"], recording["java"])
    try:
        if not wait_for_exit(recording["jvm_pid"], jvm_exit_wait_s):
            return "jvm running"
        with open(archive.lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "busy"
            if recording.get("top"):
                if os.path.isfile(archive.top_path) or os.path.exists(archive.top_failed_path):
                    return "exists"
                return _place_top(archive, recording)
            if archive.ready() or os.path.exists(archive.failed_path):
                return "exists"
            return _dump(archive, recording)
    finally:
        _remove(recording["class_list"], recording_path, *filter(None, [recording.get("top")]))


def _dump(archive: ClassArchive, recording: dict) -> str:
    tmp = f"{archive.archive_path}.tmp-{os.getpid()}"
    try:
        done = subprocess.run(dump_command(recording, tmp), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=DUMP_TIMEOUT_S)
        output = done.stdout[-20_000:] + done.stderr[-20_000:]
        ok = done.returncode == 0 and os.path.isfile(tmp)
    except (OSError, subprocess.TimeoutExpired) as exc:
        output, ok = f"{type(exc).__name__}: {exc}", False
    if not ok:
        _remove(tmp)
        with open(archive.failed_path, "w") as file:
            file.write(output)
        return "failed"
    os.replace(tmp, archive.archive_path)
    return "built"


def check_top_command(archive: ClassArchive, recording: dict) -> list[str]:
    """A JVM that must open the archive with the recorded top layer (``-Xshare:on`` fails
    when it cannot), with the recording JVM's class path and options."""
    return [recording["java"], "-Xshare:on", *recording["options"],
            f"-XX:SharedArchiveFile={archive.archive_path}:{recording['top']}",
            "-cp", recording["class_path"], "-version"]


def _place_top(archive: ClassArchive, recording: dict) -> str:
    if not os.path.isfile(recording["top"]):
        output, ok = "the recording JVM wrote no top layer", False
    else:
        try:
            done = subprocess.run(check_top_command(archive, recording), stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=DUMP_TIMEOUT_S)
            output, ok = done.stdout[-20_000:] + done.stderr[-20_000:], done.returncode == 0
        except (OSError, subprocess.TimeoutExpired) as exc:
            output, ok = f"{type(exc).__name__}: {exc}", False
    if not ok:
        with open(archive.top_failed_path, "w") as file:
            file.write(output)
        return "failed"
    os.replace(recording["top"], archive.top_path)
    return "built"


def main(argv: list[str]) -> int:
    """``python -m spark_audit.class_archive <recording.json>``: the detached builder."""
    try:
        os.nice(BUILDER_NICENESS)
    except OSError:
        pass
    print(build(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
