"""JobStore: where jobs, their event log, the webhook outbox and its attempts live.

`JobStore` is the interface the scheduler, the webhook outbox and the routes use; a shared
database for several replicas implements the same methods. `SQLiteJobStore` is the default:
one file in WAL mode, schema versions applied in order (PRAGMA user_version). A job's status
change, its event and the webhook messages for that event are written in one transaction, so
a crash leaves either all three or none.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from omnistage.serving.jobs.model import Delivery, Job, JobEvent, JobStatus

# Each entry moves the schema one version up; never edit a released entry, append a new one.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY, model TEXT NOT NULL, status TEXT NOT NULL, priority INTEGER NOT NULL,
        inputs TEXT NOT NULL, params TEXT NOT NULL, metadata TEXT NOT NULL, webhook TEXT,
        output_format TEXT NOT NULL, idempotency_key TEXT UNIQUE,
        progress_done INTEGER NOT NULL DEFAULT 0, progress_total INTEGER NOT NULL DEFAULT 0,
        outputs TEXT NOT NULL DEFAULT '{}', error TEXT, attempts INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL, started_at REAL, finished_at REAL, expires_at REAL,
        cancel_requested INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX jobs_queue ON jobs (model, status, priority DESC, created_at);
    CREATE TABLE job_events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, type TEXT NOT NULL,
        data TEXT NOT NULL, created_at REAL NOT NULL
    );
    CREATE INDEX job_events_job ON job_events (job_id, seq);
    CREATE TABLE webhook_outbox (
        id TEXT PRIMARY KEY, job_id TEXT NOT NULL, event_type TEXT NOT NULL, url TEXT NOT NULL,
        payload TEXT NOT NULL, secret TEXT, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at REAL NOT NULL, created_at REAL NOT NULL
    );
    CREATE INDEX webhook_outbox_due ON webhook_outbox (status, next_attempt_at);
    CREATE TABLE webhook_attempts (
        id INTEGER PRIMARY KEY AUTOINCREMENT, delivery_id TEXT NOT NULL, job_id TEXT NOT NULL,
        at REAL NOT NULL, status_code INTEGER, latency_ms REAL NOT NULL, error TEXT
    );
    CREATE INDEX webhook_attempts_job ON webhook_attempts (job_id);
    CREATE TABLE disabled_endpoints (url TEXT PRIMARY KEY, at REAL NOT NULL, reason TEXT NOT NULL);
    """,
    # 2: which API created the job (jobs, videos), so /v1/videos lists only its own
    """
    ALTER TABLE jobs ADD COLUMN api TEXT NOT NULL DEFAULT 'jobs';
    CREATE INDEX jobs_api ON jobs (api, created_at);
    """,
]

_JSON_FIELDS = ("inputs", "params", "metadata", "webhook", "output_format", "outputs", "error")
_JOB_COLUMNS = (
    "id model status priority inputs params metadata webhook output_format idempotency_key progress_done "
    "progress_total outputs error attempts created_at started_at finished_at expires_at cancel_requested api"
).split()


class JobStore(Protocol):
    def create_job(self, job: Job) -> tuple[Job, bool]: ...
    def get_job(self, job_id: str) -> Job | None: ...
    def job_by_key(self, key: str) -> Job | None: ...
    def queued_models(self) -> list[str]: ...
    def next_delivery_at(self) -> float | None: ...
    def list_jobs(
        self, limit: int, after: str | None = None, model: str | None = None, api: str | None = None
    ) -> list[Job]: ...
    def queue_position(self, job: Job) -> int: ...
    def claim_queued(self, model: str, limit: int) -> list[Job]: ...
    def update_job(self, job_id: str, **fields: Any) -> None: ...
    def record_event(
        self, job_id: str, type: str, data: dict, *, webhook: dict | None = None, job_update: dict | None = None
    ) -> JobEvent: ...
    def events_after(self, job_id: str, seq: int) -> list[JobEvent]: ...
    def due_deliveries(self, now: float, limit: int) -> list[Delivery]: ...
    def record_attempt(
        self,
        delivery: Delivery,
        *,
        status_code: int | None,
        latency_ms: float,
        error: str | None,
        outcome: str,
        next_attempt_at: float = 0.0,
    ) -> None: ...
    def attempts_for_job(self, job_id: str) -> list[dict]: ...
    def deliveries_for_job(self, job_id: str) -> list[Delivery]: ...
    def disable_endpoint(self, url: str, reason: str) -> None: ...
    def endpoint_disabled(self, url: str) -> bool: ...
    def interrupted_jobs(self) -> list[Job]: ...
    def expired_jobs(self, now: float) -> list[Job]: ...
    def delete_job(self, job_id: str) -> None: ...
    def close(self) -> None: ...


def _row_to_job(row: sqlite3.Row) -> Job:
    values = dict(row)
    for name in _JSON_FIELDS:
        raw = values[name]
        values[name] = json.loads(raw) if raw is not None else None
    values["status"] = JobStatus(values["status"])
    values["cancel_requested"] = bool(values["cancel_requested"])
    return Job(**values)


def _job_values(job: Job) -> dict[str, Any]:
    values = {name: getattr(job, name) for name in _JOB_COLUMNS}
    values["status"] = job.status.value
    values["cancel_requested"] = int(job.cancel_requested)
    for name in _JSON_FIELDS:
        if values[name] is not None:
            values[name] = json.dumps(values[name])
    return values


class SQLiteJobStore:
    """JobStore on one SQLite file. Safe to share between threads (one connection, one lock)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a process kill
        self._migrate()

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        with self._lock:
            version = self.schema_version
            if version > len(MIGRATIONS):
                raise RuntimeError(f"{self.path} has schema version {version}; this omnistage knows {len(MIGRATIONS)}")
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                self._db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {number};\nCOMMIT;")

    def _tx(self):
        return _Transaction(self._db, self._lock)

    # -- jobs ---------------------------------------------------------------------------------------
    def create_job(self, job: Job) -> tuple[Job, bool]:
        """Insert `job`; with an idempotency key already used, the existing job and False."""
        values = _job_values(job)
        sql = f"INSERT INTO jobs ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})"
        with self._tx() as db:
            if job.idempotency_key is not None:
                row = db.execute("SELECT * FROM jobs WHERE idempotency_key = ?", (job.idempotency_key,)).fetchone()
                if row is not None:
                    return _row_to_job(row), False
            db.execute(sql, tuple(values.values()))
            db.execute(
                "INSERT INTO job_events (job_id, type, data, created_at) VALUES (?, 'queued', ?, ?)",
                (job.id, json.dumps({"status": "queued"}), job.created_at),
            )
        return job, True

    def get_job(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _row_to_job(row) if row is not None else None

    def job_by_key(self, key: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE idempotency_key = ?", (key,)).fetchone()
        return _row_to_job(row) if row is not None else None

    def list_jobs(
        self, limit: int, after: str | None = None, model: str | None = None, api: str | None = None
    ) -> list[Job]:
        """Newest first; `after`: a job id, the page starts past it; `api`: only jobs it created."""
        clauses, args = [], []
        if api is not None:
            clauses.append("api = ?")
            args.append(api)
        if after is not None:
            clauses.append("(created_at, id) < (SELECT created_at, id FROM jobs WHERE id = ?)")
            args.append(after)
        if model is not None:
            clauses.append("model = ?")
            args.append(model)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM jobs {where} ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit)
            ).fetchall()
        return [_row_to_job(r) for r in rows]

    def queue_position(self, job: Job) -> int:
        """How many queued jobs of the same model run before this one (0: next)."""
        with self._lock:
            return self._db.execute(
                "SELECT COUNT(*) FROM jobs WHERE model = ? AND status = 'queued' AND id != ? AND "
                "(priority > ? OR (priority = ? AND (created_at, id) < (?, ?)))",
                (job.model, job.id, job.priority, job.priority, job.created_at, job.id),
            ).fetchone()[0]

    def claim_queued(self, model: str, limit: int) -> list[Job]:
        """Move up to `limit` queued jobs of `model` (highest priority, then oldest) to in_progress."""
        now = time.time()
        with self._tx() as db:
            rows = db.execute(
                "SELECT * FROM jobs WHERE model = ? AND status = 'queued' ORDER BY priority DESC, created_at, id "
                "LIMIT ?",
                (model, limit),
            ).fetchall()
            for row in rows:
                db.execute(
                    "UPDATE jobs SET status = 'in_progress', started_at = ?, attempts = attempts + 1, "
                    "progress_done = 0 WHERE id = ?",
                    (now, row["id"]),
                )
        jobs = [_row_to_job(r) for r in rows]
        for job in jobs:
            job.status, job.started_at, job.attempts, job.progress_done = (
                JobStatus.IN_PROGRESS,
                now,
                job.attempts + 1,
                0,
            )
        return jobs

    def queued_models(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT model FROM jobs WHERE status = 'queued'")]

    def update_job(self, job_id: str, **fields: Any) -> None:
        with self._tx() as db:
            _update(db, job_id, fields)

    def interrupted_jobs(self) -> list[Job]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE status = 'in_progress'").fetchall()
        return [_row_to_job(r) for r in rows]

    def expired_jobs(self, now: float) -> list[Job]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            ).fetchall()
        return [_row_to_job(r) for r in rows]

    def delete_job(self, job_id: str) -> None:
        with self._tx() as db:
            for table, column in (("job_events", "job_id"), ("webhook_attempts", "job_id"), ("jobs", "id")):
                db.execute(f"DELETE FROM {table} WHERE {column} = ?", (job_id,))
            db.execute("DELETE FROM webhook_outbox WHERE job_id = ? AND status != 'pending'", (job_id,))

    # -- events and the outbox ----------------------------------------------------------------------
    def record_event(
        self, job_id: str, type: str, data: dict, *, webhook: dict | None = None, job_update: dict | None = None
    ) -> JobEvent:
        """Append an event; in the same transaction update the job and queue its webhook message.

        `webhook`: {"url", "secret", "payload"} when this event goes to the job's endpoint."""
        now = time.time()
        with self._tx() as db:
            if job_update:
                _update(db, job_id, job_update)
            cur = db.execute(
                "INSERT INTO job_events (job_id, type, data, created_at) VALUES (?, ?, ?, ?)",
                (job_id, type, json.dumps(data), now),
            )
            if webhook is not None:
                disabled = db.execute("SELECT 1 FROM disabled_endpoints WHERE url = ?", (webhook["url"],)).fetchone()
                if disabled is None:
                    db.execute(
                        "INSERT INTO webhook_outbox (id, job_id, event_type, url, payload, secret, status, "
                        "next_attempt_at, created_at) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                        (f"msg_{uuid.uuid4().hex}", job_id, type, webhook["url"], webhook["payload"],
                         webhook.get("secret"), now, now),
                    )  # fmt: skip
        return JobEvent(cur.lastrowid, job_id, type, data, now)

    def events_after(self, job_id: str, seq: int) -> list[JobEvent]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq", (job_id, seq)
            ).fetchall()
        return [JobEvent(r["seq"], r["job_id"], r["type"], json.loads(r["data"]), r["created_at"]) for r in rows]

    def due_deliveries(self, now: float, limit: int) -> list[Delivery]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM webhook_outbox WHERE status = 'pending' AND next_attempt_at <= ? "
                "ORDER BY next_attempt_at, created_at LIMIT ?",
                (now, limit),
            ).fetchall()
        return [Delivery(**dict(r)) for r in rows]

    def next_delivery_at(self) -> float | None:
        with self._lock:
            row = self._db.execute(
                "SELECT MIN(next_attempt_at) FROM webhook_outbox WHERE status = 'pending'"
            ).fetchone()
        return row[0]

    def deliveries_for_job(self, job_id: str) -> list[Delivery]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM webhook_outbox WHERE job_id = ? ORDER BY created_at", (job_id,)
            ).fetchall()
        return [Delivery(**dict(r)) for r in rows]

    def record_attempt(
        self,
        delivery: Delivery,
        *,
        status_code: int | None,
        latency_ms: float,
        error: str | None,
        outcome: str,
        next_attempt_at: float = 0.0,
    ) -> None:
        """One delivery attempt; `outcome` is the message's new status (pending: retry at next_attempt_at)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO webhook_attempts (delivery_id, job_id, at, status_code, latency_ms, error) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (delivery.id, delivery.job_id, time.time(), status_code, latency_ms, error),
            )
            db.execute(
                "UPDATE webhook_outbox SET status = ?, attempts = attempts + 1, next_attempt_at = ? WHERE id = ?",
                (outcome, next_attempt_at, delivery.id),
            )

    def attempts_for_job(self, job_id: str) -> list[dict]:
        with self._lock:
            rows = self._db.execute(
                "SELECT a.delivery_id, o.event_type, a.at, a.status_code, a.latency_ms, a.error FROM webhook_attempts a "
                "JOIN webhook_outbox o ON o.id = a.delivery_id WHERE a.job_id = ? ORDER BY a.id",
                (job_id,),
            ).fetchall()
        return [dict(r) for r in rows]

    def disable_endpoint(self, url: str, reason: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO disabled_endpoints (url, at, reason) VALUES (?, ?, ?)",
                (url, time.time(), reason),
            )
            db.execute("UPDATE webhook_outbox SET status = 'disabled' WHERE url = ? AND status = 'pending'", (url,))

    def endpoint_disabled(self, url: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM disabled_endpoints WHERE url = ?", (url,)).fetchone() is not None

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _update(db: sqlite3.Connection, job_id: str, fields: dict[str, Any]) -> None:
    values = {}
    for name, value in fields.items():
        if name not in _JOB_COLUMNS:
            raise KeyError(f"jobs has no column {name!r}")
        if name in _JSON_FIELDS and value is not None:
            value = json.dumps(value)
        elif isinstance(value, JobStatus):
            value = value.value
        elif isinstance(value, bool):
            value = int(value)
        values[name] = value
    assignments = ", ".join(f"{name} = ?" for name in values)
    db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values.values(), job_id))


class _Transaction:
    """`with store._tx() as db:` one BEGIN IMMEDIATE ... COMMIT under the store's lock."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock):
        self._db, self._lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        return self._db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        finally:
            self._lock.release()
