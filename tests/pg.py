"""A throwaway PostgreSQL cluster for tests: initdb in a temp dir, listen on 127.0.0.1 only.

``find_pg_bin()`` locates ``initdb``/``pg_ctl``; ``PgCluster`` starts and stops one cluster. As
root (sessions and CI), initdb refuses to run, so the directory is given to the ``postgres`` user
and the binaries run through ``runuser -u postgres --``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import re
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

PG_USER = "postgres"
ROOT_PREFIX = "pyqmq-pg-"
# File in a cluster's directory holding the pid of the test process that owns it.
OWNER_FILE = "owner.pid"
PG_DATABASE = "pyqmq_test"
# Seconds pg_ctl waits for the server to start or stop.
PG_CTL_TIMEOUT_S = 60


DATABASE_NAME_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")


async def create_database(admin_url: str, name: str) -> None:
    """Create database ``name`` through ``admin_url`` (any existing database of the cluster)."""
    import asyncpg

    if not DATABASE_NAME_RE.fullmatch(name):
        raise ValueError(f"database name {name!r} does not match {DATABASE_NAME_RE.pattern}")
    connection = await asyncpg.connect(admin_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()


class PgUnavailable(Exception):
    """The machine cannot run a throwaway PostgreSQL (no binaries, no postgres user)."""


def find_pg_bin() -> Path:
    """Return the directory holding ``initdb`` and ``pg_ctl`` (PATH first, then Debian's layout)."""
    on_path = shutil.which("initdb")
    if on_path:
        # /usr/local/bin/initdb is often a link into /usr/lib/postgresql/<v>/bin; use the real dir.
        for directory in (Path(on_path).resolve().parent, Path(on_path).parent):
            if _has_pg_ctl(directory):
                return directory
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if _has_pg_ctl(Path(candidate)):
            return Path(candidate)
    raise PgUnavailable(
        "PostgreSQL binaries (initdb, pg_ctl) are not on PATH nor in /usr/lib/postgresql/*/bin; "
        "install the postgresql package to run the PostgreSQL tests"
    )


def _has_pg_ctl(directory: Path) -> bool:
    """True when ``directory`` holds both initdb and pg_ctl."""
    return (directory / "initdb").exists() and (directory / "pg_ctl").exists()


def _alive(pid: int) -> bool:
    """True when process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PgCluster:
    """One PostgreSQL cluster in a temp directory; ``start()`` then ``stop()`` (or ``with``)."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        self.bin_dir = bin_dir or find_pg_bin()
        self.port = 0
        self.root: Path | None = None
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            try:
                self._pw = pwd.getpwnam(PG_USER)
            except KeyError:
                raise PgUnavailable(f"running as root but there is no {PG_USER!r} user") from None
            if shutil.which("runuser") is None:
                raise PgUnavailable("running as root but runuser is not installed")

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory."""
        assert self.root is not None, "cluster not started"
        return self.root / "data"

    @property
    def url(self) -> str:
        """asyncpg URL of the test database."""
        return self.url_of(PG_DATABASE)

    def _user(self) -> str:
        """The database superuser: the OS user initdb ran as."""
        return PG_USER if self._as_postgres else pwd.getpwuid(os.geteuid()).pw_name

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL binary (as the postgres user when we are root); raise on failure."""
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", PG_USER, "--", *cmd]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=PG_CTL_TIMEOUT_S * 2)
        if result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def start(self) -> str:
        """Create the cluster, start it, create the test database; return its URL."""
        self.reap_orphans()
        self.root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))
        (self.root / OWNER_FILE).write_text(str(os.getpid()))
        try:
            if self._as_postgres:
                os.chown(self.root, self._pw.pw_uid, self._pw.pw_gid)
            self._run("initdb", "-D", str(self.data_dir), "-A", "trust", "-U", self._user(),
                      "-E", "UTF8", "--no-sync")
            self.port = free_port()
            options = f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
            self._run("pg_ctl", "-D", str(self.data_dir), "-o", options, "-l",
                      str(self.root / "server.log"), "-w", "-t", str(PG_CTL_TIMEOUT_S), "start")
            self.create_database(PG_DATABASE)
        except BaseException:
            self.stop()
            raise
        return self.url

    def create_database(self, name: str) -> str:
        """Create a database in the cluster and return its URL (callable under a running loop)."""
        # A thread of its own, because pytest may set this up while an event loop is running.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, create_database(self.url_of("postgres"), name)).result()
        return self.url_of(name)

    def url_of(self, database: str) -> str:
        """asyncpg URL of ``database`` in this cluster."""
        return f"postgresql+asyncpg://{self._user()}@127.0.0.1:{self.port}/{database}"

    def reap_orphans(self) -> None:
        """Stop and remove clusters left by test runs that were killed before their teardown."""
        for root in Path(tempfile.gettempdir()).glob(ROOT_PREFIX + "*"):
            try:
                owner = int((root / OWNER_FILE).read_text())
            except (OSError, ValueError):
                continue
            if _alive(owner):
                continue
            orphan = PgCluster.__new__(PgCluster)
            orphan.__dict__.update(self.__dict__)
            orphan.root = root
            orphan.stop()

    def stop(self) -> None:
        """Stop the server at once and remove its directory."""
        if self.root is None:
            return
        if (self.data_dir / "postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass  # the directory goes anyway; a stray server dies with its socket dir
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def __enter__(self) -> PgCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
