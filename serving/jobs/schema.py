"""The job store's schema, one definition for every database: versioned migrations written
once with a few dialect placeholders, and the conversion between a `Job` and a table row.

Placeholders: `{real}` a double-precision float (timestamps), `{serial}` an auto-increasing
integer primary key. SQLite records the version in PRAGMA user_version, PostgreSQL in a
one-row table; both apply the same list in order.
"""

from __future__ import annotations

import json
from typing import Any

from omnistage.serving.jobs.model import Job, JobStatus

# Each entry moves the schema one version up; never edit a released entry, append a new one.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY, model TEXT NOT NULL, status TEXT NOT NULL, priority INTEGER NOT NULL,
        inputs TEXT NOT NULL, params TEXT NOT NULL, metadata TEXT NOT NULL, webhook TEXT,
        output_format TEXT NOT NULL, idempotency_key TEXT UNIQUE,
        progress_done INTEGER NOT NULL DEFAULT 0, progress_total INTEGER NOT NULL DEFAULT 0,
        outputs TEXT NOT NULL DEFAULT '{{}}', error TEXT, attempts INTEGER NOT NULL DEFAULT 0,
        created_at {real} NOT NULL, started_at {real}, finished_at {real}, expires_at {real},
        cancel_requested INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX jobs_queue ON jobs (model, status, priority DESC, created_at);
    CREATE TABLE job_events (
        seq {serial}, job_id TEXT NOT NULL, type TEXT NOT NULL,
        data TEXT NOT NULL, created_at {real} NOT NULL
    );
    CREATE INDEX job_events_job ON job_events (job_id, seq);
    CREATE TABLE webhook_outbox (
        id TEXT PRIMARY KEY, job_id TEXT NOT NULL, event_type TEXT NOT NULL, url TEXT NOT NULL,
        payload TEXT NOT NULL, secret TEXT, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at {real} NOT NULL, created_at {real} NOT NULL
    );
    CREATE INDEX webhook_outbox_due ON webhook_outbox (status, next_attempt_at);
    CREATE TABLE webhook_attempts (
        id {serial}, delivery_id TEXT NOT NULL, job_id TEXT NOT NULL,
        at {real} NOT NULL, status_code INTEGER, latency_ms {real} NOT NULL, error TEXT
    );
    CREATE INDEX webhook_attempts_job ON webhook_attempts (job_id);
    CREATE TABLE disabled_endpoints (url TEXT PRIMARY KEY, at {real} NOT NULL, reason TEXT NOT NULL);
    """,
    # 2: which API created the job (jobs, videos), so /v1/videos lists only its own
    """
    ALTER TABLE jobs ADD COLUMN api TEXT NOT NULL DEFAULT 'jobs';
    CREATE INDEX jobs_api ON jobs (api, created_at);
    """,
    # 3: the API key that owns a job (a digest, never the key); which server runs a job and until
    # when its claim holds, and the same lease on an outbox message being delivered (shared stores)
    """
    ALTER TABLE jobs ADD COLUMN owner TEXT;
    CREATE INDEX jobs_owner ON jobs (owner, status);
    ALTER TABLE jobs ADD COLUMN runner TEXT;
    ALTER TABLE jobs ADD COLUMN lease_until {real};
    ALTER TABLE webhook_outbox ADD COLUMN claimed_until {real} NOT NULL DEFAULT 0;
    """,
    # 4: a digest of the request that created a job under an idempotency key, so the same key
    # with another request is refused instead of answered with the first request's job
    """
    ALTER TABLE jobs ADD COLUMN request_digest TEXT;
    """,
]

DIALECT_TYPES = {
    "sqlite": {"real": "REAL", "serial": "INTEGER PRIMARY KEY AUTOINCREMENT"},
    "postgresql": {"real": "DOUBLE PRECISION", "serial": "BIGSERIAL PRIMARY KEY"},
}


def migration_statements(dialect: str, number: int) -> list[str]:
    """Migration `number` (1-based) for `dialect`, one SQL statement per item."""
    script = MIGRATIONS[number - 1].format(**DIALECT_TYPES[dialect])
    return [s.strip() for s in script.split(";") if s.strip()]


JSON_FIELDS = ("inputs", "params", "metadata", "webhook", "output_format", "outputs", "error")
JOB_COLUMNS = (
    "id model status priority inputs params metadata webhook output_format idempotency_key progress_done "
    "progress_total outputs error attempts created_at started_at finished_at expires_at cancel_requested api owner "
    "request_digest"
).split()
STORE_ONLY_COLUMNS = ("runner", "lease_until")  # in the table, not on Job


def row_to_job(row: Any) -> Job:
    values = {name: row[name] for name in JOB_COLUMNS}
    for name in JSON_FIELDS:
        raw = values[name]
        values[name] = json.loads(raw) if raw is not None else None
    values["status"] = JobStatus(values["status"])
    values["cancel_requested"] = bool(values["cancel_requested"])
    return Job(**values)


def job_values(job: Job) -> dict[str, Any]:
    values = {name: getattr(job, name) for name in JOB_COLUMNS}
    values["status"] = job.status.value
    values["cancel_requested"] = int(job.cancel_requested)
    for name in JSON_FIELDS:
        if values[name] is not None:
            values[name] = json.dumps(values[name])
    return values


def column_values(fields: dict[str, Any]) -> dict[str, Any]:
    """`update_job` keyword arguments as column values (JSON encoded, enums and bools lowered)."""
    values = {}
    for name, value in fields.items():
        if name not in JOB_COLUMNS and name not in STORE_ONLY_COLUMNS:
            raise KeyError(f"jobs has no column {name!r}")
        if name in JSON_FIELDS and value is not None:
            value = json.dumps(value)
        elif isinstance(value, JobStatus):
            value = value.value
        elif isinstance(value, bool):
            value = int(value)
        values[name] = value
    return values
