"""JobStore: where jobs, their event log, the webhook outbox and its attempts live.

`JobStore` is the interface the scheduler, the webhook outbox and the routes use. `SqlJobStore`
implements it once, with the same SQL (named parameters) for every database, over a small
`Database` adapter: `SQLiteDatabase` (the default: one file in WAL mode) here, and the
PostgreSQL one in store_pg.py for several servers sharing jobs. The schema and its migrations
are in schema.py.

A job's status change, its event and the webhook messages for that event are written in one
transaction, so a crash leaves either all three or none. Claims (queued jobs by a scheduler,
due outbox messages by a sender) are atomic: on a shared database two servers never take the
same row (PostgreSQL's FOR UPDATE SKIP LOCKED; SQLite's BEGIN IMMEDIATE holds the only write
lock). A claimed outbox message carries a lease, so a sender that dies mid-delivery leaves it
to another after the lease.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from omnistage.serving.jobs.model import Admitted, Delivery, EventRecord, Job, JobEvent, JobStatus
from omnistage.serving.jobs.schema import MIGRATIONS, column_values, job_values, migration_statements, row_to_job

__all__ = ["MIGRATIONS", "Database", "JobStore", "SQLiteDatabase", "SQLiteJobStore", "SqlJobStore", "open_store"]

_DELIVERY_FIELDS = "id job_id event_type url payload secret status attempts next_attempt_at created_at".split()


class JobStore(Protocol):
    shared: bool  # several servers use it at once (leases decide who runs and delivers what)
    inline_writes: bool  # a small write transaction is local and quick: it may run on the event loop

    def create_jobs(self, jobs: list[Job], max_queued_per_owner: int | None = None) -> list[Admitted]: ...
    def create_job(self, job: Job) -> tuple[Job, bool]: ...
    def get_job(self, job_id: str) -> Job | None: ...
    def job_by_key(self, key: str) -> Job | None: ...
    def queued_models(self) -> list[str]: ...
    def list_jobs(self, limit: int, after: str | None = None, model: str | None = None,
                  api: str | None = None, owner: str | None = None) -> list[Job]: ...  # fmt: skip
    def queue_position(self, job: Job) -> int: ...
    def claim_queued(self, model: str, limit: int, runner: str = "", lease_until: float | None = None) -> list[Job]: ...
    def renew_leases(self, runner: str, lease_until: float) -> list[str]: ...
    def update_job(self, job_id: str, **fields: Any) -> None: ...
    def record_event(self, job_id: str, type: str, data: dict, *, webhook: dict | None = None,
                     job_update: dict | None = None) -> JobEvent: ...  # fmt: skip
    def record_events(self, records: list[EventRecord]) -> list[JobEvent]: ...
    def request_cancel(self, job_id: str) -> JobStatus | None: ...
    def events_after(self, job_id: str, seq: int) -> list[JobEvent]: ...
    def claim_deliveries(self, now: float, limit: int, lease_s: float) -> list[Delivery]: ...
    def release_deliveries(self, ids: list[str]) -> None: ...
    def next_delivery_at(self) -> float | None: ...
    def record_attempt(self, delivery: Delivery, *, status_code: int | None, latency_ms: float,
                       error: str | None, outcome: str, next_attempt_at: float = 0.0) -> None: ...  # fmt: skip
    def attempts_for_job(self, job_id: str) -> list[dict]: ...
    def deliveries_for_job(self, job_id: str) -> list[Delivery]: ...
    def disable_endpoint(self, url: str, reason: str) -> None: ...
    def endpoint_disabled(self, url: str) -> bool: ...
    def interrupted_jobs(self, now: float = math.inf) -> list[Job]: ...
    def expired_jobs(self, now: float) -> list[Job]: ...
    def delete_job(self, job_id: str) -> None: ...
    def close(self) -> None: ...


class Database(Protocol):
    """What SqlJobStore needs of a database: reads, write transactions, its migrations."""

    dialect: str
    shared: bool
    inline_writes: bool
    skip_locked: str  # appended to a claim's SELECT: " FOR UPDATE SKIP LOCKED" where rows lock

    def read(self, sql: str, params: dict | None = None) -> list[dict]: ...
    def transaction(self): ...  # context manager -> a Writer (execute(sql, params) -> rows)
    def schema_version(self) -> int: ...
    def migrate(self) -> None: ...
    def close(self) -> None: ...


class SqlJobStore:
    """JobStore over any Database: the same queries for SQLite and PostgreSQL."""

    def __init__(self, db: Database):
        self.db = db
        self.shared = db.shared
        self.inline_writes = db.inline_writes
        db.migrate()
        if not self.shared:  # a lone server starting: no sender of its own holds a claim yet
            with db.transaction() as tx:
                tx.execute("UPDATE webhook_outbox SET claimed_until = 0 WHERE claimed_until > 0")

    @property
    def schema_version(self) -> int:
        return self.db.schema_version()

    # -- jobs ---------------------------------------------------------------------------------------
    def create_jobs(self, jobs: list[Job], max_queued_per_owner: int | None = None) -> list[Admitted]:
        """Store `jobs` in one transaction (a group commit). Per job: an idempotency key used
        before gives the earlier job; an owner with `max_queued_per_owner` queued jobs is refused."""
        results: list[Admitted] = []
        with self.db.transaction() as tx:
            queued_by_owner: dict[str | None, int] = {}
            ahead: dict[tuple[str, int], int] = {}  # (model, priority) -> queued ahead of its next job
            for job in jobs:
                if job.idempotency_key is not None:
                    rows = tx.execute("SELECT * FROM jobs WHERE idempotency_key = :k", {"k": job.idempotency_key})
                    if rows:
                        results.append(Admitted(row_to_job(rows[0]), created=False))
                        continue
                if max_queued_per_owner is not None and job.owner is not None:
                    if job.owner not in queued_by_owner:
                        rows = tx.execute(
                            "SELECT COUNT(*) AS n FROM jobs WHERE owner = :o AND status = 'queued'", {"o": job.owner}
                        )
                        queued_by_owner[job.owner] = rows[0]["n"]
                    if queued_by_owner[job.owner] >= max_queued_per_owner:
                        results.append(Admitted(job, created=False, refused="queue_full"))
                        continue
                    queued_by_owner[job.owner] += 1
                values = job_values(job)
                inserted = tx.execute(
                    f"INSERT INTO jobs ({', '.join(values)}) VALUES ({', '.join(':' + k for k in values)}) "
                    "ON CONFLICT DO NOTHING RETURNING id",
                    values,
                )
                if not inserted:  # another server stored the same idempotency key meanwhile
                    rows = tx.execute("SELECT * FROM jobs WHERE idempotency_key = :k", {"k": job.idempotency_key})
                    results.append(Admitted(row_to_job(rows[0]), created=False))
                    continue
                tx.execute(
                    "INSERT INTO job_events (job_id, type, data, created_at) VALUES (:id, 'queued', :data, :at)",
                    {"id": job.id, "data": json.dumps({"status": "queued"}), "at": job.created_at},
                )
                key = (job.model, job.priority)
                if key not in ahead:  # one count per (model, priority) a batch touches
                    ahead[key] = self._queue_position(tx.execute, job)
                position = ahead[key]
                for model, priority in ahead:  # this job runs before later ones of its model at <= priority
                    if model == job.model and priority <= job.priority:
                        ahead[(model, priority)] += 1
                results.append(Admitted(job, created=True, queue_position=position))
        return results

    def create_job(self, job: Job) -> tuple[Job, bool]:
        """Insert `job`; with an idempotency key already used, the existing job and False."""
        admitted = self.create_jobs([job])[0]
        return admitted.job, admitted.created

    def get_job(self, job_id: str) -> Job | None:
        rows = self.db.read("SELECT * FROM jobs WHERE id = :id", {"id": job_id})
        return row_to_job(rows[0]) if rows else None

    def job_by_key(self, key: str) -> Job | None:
        rows = self.db.read("SELECT * FROM jobs WHERE idempotency_key = :k", {"k": key})
        return row_to_job(rows[0]) if rows else None

    def list_jobs(self, limit: int, after: str | None = None, model: str | None = None,
                  api: str | None = None, owner: str | None = None) -> list[Job]:  # fmt: skip
        """Newest first; `after`: a job id, the page starts past it; `api`, `owner`: only theirs."""
        clauses, params = [], {"limit": limit}
        for name, value in (("api", api), ("model", model), ("owner", owner)):
            if value is not None:
                clauses.append(f"{name} = :{name}")
                params[name] = value
        if after is not None:
            clauses.append("(created_at, id) < (SELECT created_at, id FROM jobs WHERE id = :after)")
            params["after"] = after
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self.db.read(f"SELECT * FROM jobs {where} ORDER BY created_at DESC, id DESC LIMIT :limit", params)
        return [row_to_job(r) for r in rows]

    def queue_position(self, job: Job) -> int:
        """How many queued jobs of the same model run before this one (0: next)."""
        return self._queue_position(self.db.read, job)

    @staticmethod
    def _queue_position(run, job: Job) -> int:
        # two index range counts (a higher priority; the same priority, older) rather than one OR
        params = {"m": job.model, "p": job.priority, "c": job.created_at, "id": job.id}
        higher = run("SELECT COUNT(*) AS n FROM jobs WHERE model = :m AND status = 'queued' AND priority > :p", params)
        older = run(
            "SELECT COUNT(*) AS n FROM jobs WHERE model = :m AND status = 'queued' AND priority = :p "
            "AND (created_at, id) < (:c, :id)",
            params,
        )
        return higher[0]["n"] + older[0]["n"]

    def claim_queued(self, model: str, limit: int, runner: str = "", lease_until: float | None = None) -> list[Job]:
        """Move up to `limit` queued jobs of `model` (highest priority, then oldest) to in_progress,
        run by `runner` until `lease_until` unless renewed."""
        now = time.time()
        with self.db.transaction() as tx:
            rows = tx.execute(
                "SELECT * FROM jobs WHERE model = :m AND status = 'queued' AND cancel_requested = 0 "
                f"ORDER BY priority DESC, created_at, id LIMIT :limit{self.db.skip_locked}",
                {"m": model, "limit": limit},
            )
            for row in rows:
                tx.execute(
                    "UPDATE jobs SET status = 'in_progress', started_at = :now, attempts = attempts + 1, "
                    "progress_done = 0, runner = :runner, lease_until = :lease WHERE id = :id",
                    {"now": now, "runner": runner, "lease": lease_until, "id": row["id"]},
                )
        jobs = [row_to_job(r) for r in rows]
        for job in jobs:
            job.status, job.started_at, job.attempts, job.progress_done = (
                JobStatus.IN_PROGRESS,
                now,
                job.attempts + 1,
                0,
            )
        return jobs

    def renew_leases(self, runner: str, lease_until: float) -> list[str]:
        """Extend the leases of `runner`'s running jobs; returns the ids whose cancel was asked."""
        with self.db.transaction() as tx:
            tx.execute(
                "UPDATE jobs SET lease_until = :lease WHERE runner = :runner AND status = 'in_progress'",
                {"lease": lease_until, "runner": runner},
            )
            rows = tx.execute(
                "SELECT id FROM jobs WHERE runner = :runner AND status = 'in_progress' AND cancel_requested = 1",
                {"runner": runner},
            )
        return [r["id"] for r in rows]

    def request_cancel(self, job_id: str) -> JobStatus | None:
        """Mark the job's cancel as asked; returns its status at that moment (None: no such job).
        A queued job marked here is never claimed afterwards."""
        with self.db.transaction() as tx:
            tx.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = :id", {"id": job_id})
            rows = tx.execute("SELECT status FROM jobs WHERE id = :id", {"id": job_id})
        return JobStatus(rows[0]["status"]) if rows else None

    def queued_models(self) -> list[str]:
        return [r["model"] for r in self.db.read("SELECT DISTINCT model FROM jobs WHERE status = 'queued'")]

    def update_job(self, job_id: str, **fields: Any) -> None:
        with self.db.transaction() as tx:
            _update(tx, job_id, fields)

    def interrupted_jobs(self, now: float = math.inf) -> list[Job]:
        """Jobs in_progress whose runner's lease ended before `now` (inf: every running job)."""
        if math.isinf(now):
            rows = self.db.read("SELECT * FROM jobs WHERE status = 'in_progress'")
        else:
            rows = self.db.read(
                "SELECT * FROM jobs WHERE status = 'in_progress' AND (lease_until IS NULL OR lease_until < :now)",
                {"now": now},
            )
        return [row_to_job(r) for r in rows]

    def expired_jobs(self, now: float) -> list[Job]:
        rows = self.db.read("SELECT * FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= :now", {"now": now})
        return [row_to_job(r) for r in rows]

    def delete_job(self, job_id: str) -> None:
        with self.db.transaction() as tx:
            for table, column in (("job_events", "job_id"), ("webhook_attempts", "job_id"), ("jobs", "id")):
                tx.execute(f"DELETE FROM {table} WHERE {column} = :id", {"id": job_id})
            tx.execute("DELETE FROM webhook_outbox WHERE job_id = :id AND status != 'pending'", {"id": job_id})

    # -- events and the outbox ----------------------------------------------------------------------
    def record_event(self, job_id: str, type: str, data: dict, *, webhook: dict | None = None,
                     job_update: dict | None = None) -> JobEvent:  # fmt: skip
        """Append an event; in the same transaction update the job and queue its webhook message.

        `webhook`: {"url", "secret", "payload"} when this event goes to the job's endpoint."""
        return self.record_events([EventRecord(job_id, type, data, webhook, job_update)])[0]

    def record_events(self, records: list[EventRecord]) -> list[JobEvent]:
        """Append events in one transaction (a group commit), each with its job update and
        webhook message: a crash keeps all of them or none."""
        now = time.time()
        events = []
        with self.db.transaction() as tx:
            disabled: dict[str, bool] = {}
            for r in records:
                if r.job_update:
                    _update(tx, r.job_id, r.job_update)
                seq = tx.execute(
                    "INSERT INTO job_events (job_id, type, data, created_at) VALUES (:id, :type, :data, :at) "
                    "RETURNING seq",
                    {"id": r.job_id, "type": r.type, "data": json.dumps(r.data), "at": now},
                )[0]["seq"]
                events.append(JobEvent(seq, r.job_id, r.type, r.data, now))
                if r.webhook is None:
                    continue
                url = r.webhook["url"]
                if url not in disabled:
                    disabled[url] = bool(
                        tx.execute("SELECT 1 AS x FROM disabled_endpoints WHERE url = :url", {"url": url})
                    )
                if not disabled[url]:
                    tx.execute(
                        "INSERT INTO webhook_outbox (id, job_id, event_type, url, payload, secret, status, "
                        "next_attempt_at, created_at) VALUES (:id, :job, :type, :url, :payload, :secret, 'pending', "
                        ":now, :now)",
                        {"id": f"msg_{uuid.uuid4().hex}", "job": r.job_id, "type": r.type, "url": url,
                         "payload": r.webhook["payload"], "secret": r.webhook.get("secret"), "now": now},
                    )  # fmt: skip
        return events

    def events_after(self, job_id: str, seq: int) -> list[JobEvent]:
        rows = self.db.read(
            "SELECT * FROM job_events WHERE job_id = :id AND seq > :seq ORDER BY seq", {"id": job_id, "seq": seq}
        )
        return [JobEvent(r["seq"], r["job_id"], r["type"], json.loads(r["data"]), r["created_at"]) for r in rows]

    def claim_deliveries(self, now: float, limit: int, lease_s: float) -> list[Delivery]:
        """Take up to `limit` due messages for `lease_s` seconds: no other sender gets them until
        their attempt is recorded or the lease ends."""
        with self.db.transaction() as tx:
            rows = tx.execute(
                "SELECT * FROM webhook_outbox WHERE status = 'pending' AND next_attempt_at <= :now "
                f"AND claimed_until <= :now ORDER BY next_attempt_at, created_at LIMIT :limit{self.db.skip_locked}",
                {"now": now, "limit": limit},
            )
            for row in rows:
                tx.execute(
                    "UPDATE webhook_outbox SET claimed_until = :until WHERE id = :id",
                    {"until": now + lease_s, "id": row["id"]},
                )
        return [Delivery(**{k: r[k] for k in _DELIVERY_FIELDS}) for r in rows]

    def release_deliveries(self, ids: list[str]) -> None:
        """Give claimed messages back without an attempt (their sender stopped short of them)."""
        with self.db.transaction() as tx:
            for delivery_id in ids:
                tx.execute("UPDATE webhook_outbox SET claimed_until = 0 WHERE id = :id", {"id": delivery_id})

    def next_delivery_at(self) -> float | None:
        rows = self.db.read(
            "SELECT MIN(CASE WHEN claimed_until > next_attempt_at THEN claimed_until ELSE next_attempt_at END) AS t "
            "FROM webhook_outbox WHERE status = 'pending'"
        )
        return rows[0]["t"]

    def deliveries_for_job(self, job_id: str) -> list[Delivery]:
        rows = self.db.read("SELECT * FROM webhook_outbox WHERE job_id = :id ORDER BY created_at", {"id": job_id})
        return [Delivery(**{k: r[k] for k in _DELIVERY_FIELDS}) for r in rows]

    def record_attempt(self, delivery: Delivery, *, status_code: int | None, latency_ms: float,
                       error: str | None, outcome: str, next_attempt_at: float = 0.0) -> None:  # fmt: skip
        """One delivery attempt; `outcome` is the message's new status (pending: retry at next_attempt_at)."""
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO webhook_attempts (delivery_id, job_id, at, status_code, latency_ms, error) "
                "VALUES (:d, :j, :at, :code, :ms, :error)",
                {"d": delivery.id, "j": delivery.job_id, "at": time.time(), "code": status_code, "ms": latency_ms,
                 "error": error},
            )  # fmt: skip
            tx.execute(
                "UPDATE webhook_outbox SET status = :outcome, attempts = attempts + 1, next_attempt_at = :next, "
                "claimed_until = 0 WHERE id = :id",
                {"outcome": outcome, "next": next_attempt_at, "id": delivery.id},
            )

    def attempts_for_job(self, job_id: str) -> list[dict]:
        return self.db.read(
            "SELECT a.delivery_id, o.event_type, a.at, a.status_code, a.latency_ms, a.error FROM webhook_attempts a "
            "JOIN webhook_outbox o ON o.id = a.delivery_id WHERE a.job_id = :id ORDER BY a.id",
            {"id": job_id},
        )

    def disable_endpoint(self, url: str, reason: str) -> None:
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO disabled_endpoints (url, at, reason) VALUES (:url, :at, :reason) "
                "ON CONFLICT (url) DO UPDATE SET at = excluded.at, reason = excluded.reason",
                {"url": url, "at": time.time(), "reason": reason},
            )
            tx.execute(
                "UPDATE webhook_outbox SET status = 'disabled' WHERE url = :url AND status = 'pending'", {"url": url}
            )

    def endpoint_disabled(self, url: str) -> bool:
        return bool(self.db.read("SELECT 1 AS x FROM disabled_endpoints WHERE url = :url", {"url": url}))

    def close(self) -> None:
        self.db.close()


def _update(tx, job_id: str, fields: dict[str, Any]) -> None:
    values = column_values(fields)
    assignments = ", ".join(f"{name} = :{name}" for name in values)
    tx.execute(f"UPDATE jobs SET {assignments} WHERE id = :job_id_", {**values, "job_id_": job_id})


class SQLiteDatabase:
    """One SQLite file in WAL mode: a writing connection and a reading one, each shared by
    threads under its own lock, so a read never waits for a write transaction (WAL readers see
    the last commit)."""

    dialect = "sqlite"
    shared = False  # one server per jobs directory (the routes' lock file)
    inline_writes = True  # a local file in WAL mode: a small transaction takes about a millisecond
    skip_locked = ""  # BEGIN IMMEDIATE already holds the database's only write lock

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a process kill
        self._read_lock = threading.Lock()
        self._reader = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._reader.row_factory = sqlite3.Row

    def read(self, sql: str, params: dict | None = None) -> list[dict]:
        with self._read_lock:
            return [dict(r) for r in self._reader.execute(sql, params or {}).fetchall()]

    @contextmanager
    def transaction(self):
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def execute(self, sql: str, params: dict | None = None) -> list[dict]:
        """Inside `transaction()` only (the caller holds the lock)."""
        return [dict(r) for r in self._db.execute(sql, params or {}).fetchall()]

    def schema_version(self) -> int:
        with self._lock:
            return self._db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> None:
        version = self.schema_version()
        if version > len(MIGRATIONS):
            raise RuntimeError(f"{self.path} has schema version {version}; this omnistage knows {len(MIGRATIONS)}")
        with self._lock:
            for number in range(version + 1, len(MIGRATIONS) + 1):
                script = ";\n".join(migration_statements("sqlite", number))
                self._db.executescript(f"BEGIN;\n{script};\nPRAGMA user_version = {number};\nCOMMIT;")

    def close(self) -> None:
        with self._lock, self._read_lock:
            self._db.close()
            self._reader.close()


class SQLiteJobStore(SqlJobStore):
    """The default store: SqlJobStore on one SQLite file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        super().__init__(SQLiteDatabase(path))


def open_store(url: str | None, sqlite_path: Path) -> SqlJobStore:
    """The store a server uses: PostgreSQL when `url` names one, else the SQLite file."""
    if url:
        from omnistage.serving.jobs.store_pg import PostgresJobStore

        return PostgresJobStore(url)
    return SQLiteJobStore(sqlite_path)
