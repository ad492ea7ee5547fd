"""A real PostgreSQL server for the tests: Debian's binaries (scripts/system-deps.sh installs
them), a cluster initialised in a temporary directory, started on a free port and stopped
(immediate mode) at teardown. As root, initdb and postgres run as `nobody`."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass


def postgres_bin() -> str | None:
    """The newest /usr/lib/postgresql/<v>/bin holding initdb, pg_ctl and postgres, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[-3]))
    return os.path.dirname(found[-1]) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    bin_dir: str
    directory: str
    port: int
    as_user: list[str]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=timeout)

    def start(self) -> None:
        data = os.path.join(self.directory, "data")
        self._run(f"{self.bin_dir}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = os.path.join(self.directory, "postgres.log")
        self._run(f"{self.bin_dir}/pg_ctl", "-D", data, "-o", options, "-l", log, "-w", "-t", "120", "start")

    def create_database(self, name: str) -> str:
        """A fresh database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def stop(self) -> None:
        data = os.path.join(self.directory, "data")
        try:
            self._run(f"{self.bin_dir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop", timeout=60)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pid_file = os.path.join(data, "postmaster.pid")
            if os.path.exists(pid_file):
                with open(pid_file) as f:
                    os.kill(int(f.readline()), 9)
        shutil.rmtree(self.directory, ignore_errors=True)


def start_postgres() -> PostgresServer | str:
    """A running server, or the reason there is none (for pytest.skip)."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        return "PostgreSQL is not installed (scripts/system-deps.sh installs Debian's postgresql)"
    directory = tempfile.mkdtemp(prefix="omnistage-pg-")
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root
        if shutil.which("runuser") is None:
            return "running as root without runuser: cannot start PostgreSQL as another user"
        shutil.chown(directory, "nobody")
        as_user = ["runuser", "-u", "nobody", "--"]
    server = PostgresServer(bin_dir, directory, _free_port(), as_user)
    try:
        server.start()
    except subprocess.CalledProcessError as exc:
        server.stop()
        return f"PostgreSQL did not start: {exc.stderr.decode(errors='replace')[-500:]}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    return "PostgreSQL did not accept connections"
