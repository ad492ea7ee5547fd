"""The job store on PostgreSQL (SQLAlchemy 2 with psycopg 3), shared by several servers.

The same SqlJobStore and the same migrations as SQLite (store.py, schema.py); what differs
is here: a connection pool, the schema version in a one-row table, migrations serialised by
an advisory lock (two servers starting together), and claims that lock the rows they take
with FOR UPDATE SKIP LOCKED, so two servers claiming at once take different jobs and
different outbox messages.
"""

from __future__ import annotations

from contextlib import contextmanager

from omnistage.serving.jobs.schema import MIGRATIONS, migration_statements
from omnistage.serving.jobs.store import SqlJobStore

MIGRATION_LOCK = 7_315_240_115  # pg_advisory_xact_lock key: one migrating server at a time


def engine_url(url: str) -> str:
    """postgresql://... (or postgres://) -> postgresql+psycopg://... (the driver this uses)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


class PostgresDatabase:
    dialect = "postgresql"
    shared = True
    inline_writes = False  # each statement is a network round trip: never on the event loop
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, pool_size: int = 4):
        from sqlalchemy import create_engine, text

        self._text = text
        self.engine = create_engine(engine_url(url), pool_size=pool_size, pool_pre_ping=True)

    def read(self, sql: str, params: dict | None = None) -> list[dict]:
        with self.engine.connect() as conn:
            result = conn.execute(self._text(sql), params or {})
            return [dict(r) for r in result.mappings()] if result.returns_rows else []

    @contextmanager
    def transaction(self):
        with self.engine.begin() as conn:
            yield _Writer(conn, self._text)

    def schema_version(self) -> int:
        rows = self.read("SELECT to_regclass('omnistage_schema') IS NOT NULL AS present")
        if not rows[0]["present"]:
            return 0
        rows = self.read("SELECT version FROM omnistage_schema")
        return rows[0]["version"] if rows else 0

    def migrate(self) -> None:
        with self.transaction() as tx:
            tx.execute("SELECT pg_advisory_xact_lock(:key)", {"key": MIGRATION_LOCK})
            tx.execute("CREATE TABLE IF NOT EXISTS omnistage_schema (version INTEGER NOT NULL)")
            rows = tx.execute("SELECT version FROM omnistage_schema")
            if not rows:
                tx.execute("INSERT INTO omnistage_schema (version) VALUES (0)")
            version = rows[0]["version"] if rows else 0
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"the jobs database has schema version {version}; this omnistage knows {len(MIGRATIONS)}"
                )
            for number in range(version + 1, len(MIGRATIONS) + 1):
                for statement in migration_statements(self.dialect, number):
                    tx.execute(statement)
                tx.execute("UPDATE omnistage_schema SET version = :v", {"v": number})

    def close(self) -> None:
        self.engine.dispose()


class _Writer:
    def __init__(self, conn, text):
        self._conn, self._text = conn, text

    def execute(self, sql: str, params: dict | None = None) -> list[dict]:
        result = self._conn.execute(self._text(sql), params or {})
        return [dict(r) for r in result.mappings()] if result.returns_rows else []


class PostgresJobStore(SqlJobStore):
    """SqlJobStore on a PostgreSQL database several servers share."""

    def __init__(self, url: str):
        super().__init__(PostgresDatabase(url))
