"""The spend ledger's database: SQLite under the data root (one host), or PostgreSQL (several hosts).

Both behind what the ledger's SQL needs: `execute`/`executemany` with `?` parameters returning a DB-API
cursor, and write transactions that take one database-wide write lock up front, so that two processes
can never both take the same headroom under a cap. SQLite: BEGIN IMMEDIATE. PostgreSQL: a transaction-
scoped advisory lock on the ledger's schema; READ COMMITTED then shows each statement every commit made
before the lock was granted, which is what SQLite's single writer gives. The ledger's SQL is the dialect
both share (upserts with ON CONFLICT, no two-argument min); the schema's column types are widened for
PostgreSQL (`real` is single precision there, `integer` 32 bits).

SQLite in WAL mode needs the processes on one host: its locks and shared memory do not work over a
network filesystem. Hosts that share a data root (Kubernetes pods on several nodes) set
EAGLE3_LEDGER_URL to a PostgreSQL database (the Dagster instance's may be used: the ledger keeps to its
own schema, `eagle3_spend`).
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

LEDGER_URL_ENV = "EAGLE3_LEDGER_URL"
POSTGRES_SCHEMA = "eagle3_spend"
# URL schemes of PostgreSQL with psycopg2, the driver dagster-postgres uses (the instance's URL is checked against
# them too).
POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg2")

try:  # what a failed statement or commit raises, whichever database the ledger is in
    import psycopg2

    DATABASE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, psycopg2.Error)
except ImportError:  # without the `postgres` extra the ledger is SQLite only
    DATABASE_ERRORS = (sqlite3.Error,)


class Cursor(Protocol):
    @property
    def description(self) -> Any: ...  # read-only, as sqlite3's and psycopg2's cursors have it

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Any: ...


class Connection(Protocol):
    """What the ledger's operations are given: SQL in with `?` parameters, a DB-API cursor out."""

    def execute(self, sql: str, params: Any = ()) -> Cursor: ...

    def executemany(self, sql: str, rows: Any) -> Cursor: ...


class SqliteDatabase:
    """One connection to the ledger's SQLite file, in WAL mode (readers never wait for the writer)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.location = str(self.path)
        self.conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
        self.conn.execute("pragma journal_mode = wal")
        self.conn.execute("pragma synchronous = normal")
        self.conn.execute("pragma busy_timeout = 60000")

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        return self.conn.executemany(sql, rows)

    def begin(self) -> None:
        self.conn.execute("begin immediate")  # the write lock up front, across processes

    def commit(self) -> None:
        self.conn.execute("commit")

    def rollback(self) -> None:
        self.conn.execute("rollback")

    def schema(self, ddl: str) -> str:
        return ddl

    def close(self) -> None:
        self.conn.close()


class PostgresDatabase:
    """One psycopg2 connection (autocommit, explicit transactions) with the ledger's schema on its search path.

    A connection lost between statements (the server restarted, a proxy dropped it while idle) is made again
    for the next statement, so a long-lived process (the code server's credit sensor) recovers by itself; one
    lost inside a transaction fails that transaction, which nothing then commits.
    """

    def __init__(self, url: str, schema: str = POSTGRES_SCHEMA):
        parts = urlsplit(url)
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        if parts.username:
            netloc = f"{parts.username}@{netloc}"
        self.location = urlunsplit((parts.scheme, netloc, parts.path, "", ""))  # without the password
        # psycopg2 takes libpq's URL: the SQLAlchemy driver suffix (postgresql+psycopg2://) is not libpq's.
        self._dsn = url.replace("postgresql+psycopg2://", "postgresql://", 1)
        self.schema_name = schema
        self._lock_key = f"eagle3 spend ledger {schema}"
        self._in_transaction = False
        self._connect()
        self.begin()  # under the write lock: processes starting together create the schema once
        try:
            self.execute(f'create schema if not exists "{schema}"')
        except BaseException:
            self.rollback()
            raise
        self.commit()

    def _connect(self) -> None:
        import psycopg2  # the `postgres` extra

        self.conn = psycopg2.connect(self._dsn, application_name=f"eagle3 spend ledger pid {os.getpid()}")
        self.conn.autocommit = True
        self._run(f'set search_path to "{self.schema_name}"')

    def _run(self, sql: str, params: Any = ()) -> Any:
        cur = self.conn.cursor()
        if params:
            cur.execute(_pyformat(sql), tuple(params))
        else:
            cur.execute(sql)
        return cur

    def execute(self, sql: str, params: Any = ()) -> Any:
        import psycopg2

        if self.conn.closed and not self._in_transaction:
            self._connect()
        try:
            return self._run(sql, params)
        except psycopg2.OperationalError:
            if self._in_transaction or not self.conn.closed:
                raise
            self._connect()  # dropped between statements: this statement once more, on a new connection
            return self._run(sql, params)

    def executemany(self, sql: str, rows: Any) -> Any:
        cur = self.conn.cursor()
        cur.executemany(_pyformat(sql), [tuple(r) for r in rows])
        return cur

    def begin(self) -> None:
        self.execute("begin")
        self._in_transaction = True
        try:
            # Every writer of this ledger, on any host, queues here: BEGIN IMMEDIATE's guarantee.
            self.execute("select pg_advisory_xact_lock(hashtext(?))", (self._lock_key,))
        except BaseException:
            self.rollback()
            raise

    def commit(self) -> None:
        try:
            self._run("commit")
        finally:
            self._in_transaction = False

    def rollback(self) -> None:
        try:
            if not self.conn.closed:
                self._run("rollback")
        finally:
            self._in_transaction = False

    def schema(self, ddl: str) -> str:
        ddl = re.sub(r"\breal\b", "double precision", ddl)
        return re.sub(r"\binteger\b", "bigint", ddl)

    def close(self) -> None:
        self.conn.close()


def _pyformat(sql: str) -> str:
    """`?` parameters as psycopg2's `%s` (the ledger's SQL has no `%` and no `?` inside literals)."""
    if "%" in sql:
        raise ValueError(f"a literal % in ledger SQL would be read as a parameter: {sql!r}")
    return sql.replace("?", "%s")


Database = SqliteDatabase | PostgresDatabase


def is_database_url(where: str | os.PathLike[str]) -> bool:
    return isinstance(where, str) and urlsplit(where).scheme in POSTGRES_SCHEMES


def connect(where: str | os.PathLike[str]) -> Database:
    """A PostgreSQL URL, or the path of an SQLite file."""
    return PostgresDatabase(str(where)) if is_database_url(where) else SqliteDatabase(where)
