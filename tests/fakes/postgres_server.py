"""A throwaway PostgreSQL server for tests: initdb in a temporary folder, `postgres` on a free loopback port in
its own process group, stopped by its pid (fast shutdown, then SIGKILL). Debian's server binaries are looked up
on PATH, then in /usr/lib/postgresql/<version>/bin. PostgreSQL refuses to run as root, so as root it runs as the
`postgres` user, in a folder that user owns."""

from __future__ import annotations

import getpass
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from support import free_port, port_open, wait_for


def server_binaries() -> Path | None:
    """The folder holding initdb and postgres, or None."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(os.path.realpath(found)).parent
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / "initdb").exists() and (folder / "postgres").exists():
            return folder
    return None


class PostgresServer:
    def __init__(self) -> None:
        binaries = server_binaries()
        if binaries is None:
            raise RuntimeError("PostgreSQL server binaries not found (initdb, postgres): apt-get install postgresql")
        self.bin: Path = binaries
        self.user = "postgres" if os.geteuid() == 0 else getpass.getuser()
        self.root = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "server.log"

    def _as_server_user(self) -> dict:
        if os.geteuid() != 0:
            return {}
        entry = pwd.getpwnam(self.user)
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def start(self) -> PostgresServer:
        if os.geteuid() == 0:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        env = dict(os.environ, LC_ALL="C.UTF-8", LANG="C.UTF-8")
        subprocess.run(
            [
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            env=env,
            cwd=self.root,
            timeout=300,
            **self._as_server_user(),
        )
        # fsync off: a test database need not survive a power cut. Unix socket in our folder, not /var/run.
        cmd = [
            str(self.bin / "postgres"),
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"unix_socket_directories={self.root}",
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=300",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.root,
                start_new_session=True,
                **self._as_server_user(),
            )
        try:
            wait_for(
                lambda: self.proc.poll() is not None or (port_open(self.port) and self._accepts()),
                120,
                "PostgreSQL to accept connections",
                every=0.2,
            )
        except AssertionError:
            self.stop()
            raise
        if self.proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        return self

    def _accepts(self) -> bool:
        import psycopg2

        try:
            psycopg2.connect(self.url("postgres"), connect_timeout=2).close()
            return True
        except psycopg2.OperationalError:  # "the database system is starting up"
            return False

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A fresh, empty database; its URL."""
        import psycopg2

        conn = psycopg2.connect(self.url("postgres"))
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(f'drop database if exists "{name}" with (force)')
                cur.execute(f'create database "{name}"')
        finally:
            conn.close()
        return self.url(name)

    def stop(self) -> None:
        """SIGINT is PostgreSQL's fast shutdown (clients are disconnected); SIGKILL the group if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)
