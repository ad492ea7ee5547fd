"""The jobs package's shared state: statuses, the job record, events, and the configuration."""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELED)


# Event types a job's log holds; a webhook may subscribe to any of WEBHOOK_EVENTS.
EVENT_TYPES = ("queued", "started", "progress", "preview", "output", "retry", "completed", "failed", "canceled")
WEBHOOK_EVENTS = ("started", "progress", "completed", "failed", "canceled")
DEFAULT_WEBHOOK_EVENTS = ("completed", "failed", "canceled")


@dataclass
class Job:
    id: str
    model: str
    inputs: dict[str, Any]
    params: dict[str, Any]
    status: JobStatus = JobStatus.QUEUED
    priority: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    webhook: dict[str, Any] | None = None  # {"url", "events", "secret"?}
    output_format: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    progress_done: int = 0
    progress_total: int = 0
    outputs: dict[str, Any] = field(default_factory=dict)  # port -> {"file", "media_type", ...} or JSON value
    error: dict[str, Any] | None = None
    attempts: int = 0  # how many times the job was started (a rerun after a crash counts)
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    expires_at: float | None = None
    cancel_requested: bool = False
    api: str = "jobs"  # the API that created it: "jobs" or "videos"
    owner: str | None = None  # digest of the API key that created it (None: an open server)
    request_digest: str | None = None  # of the request, when it came with an idempotency key


@dataclass
class Admitted:
    """What the store made of one submitted job, decided in the transaction that stored it."""

    job: Job
    created: bool  # False: the idempotency key was used before, `job` is that earlier job
    queue_position: int | None = None  # for a created job: queued jobs of its model ahead of it
    refused: str | None = None  # the owner's queue is full: the job was not stored


@dataclass
class JobEvent:
    seq: int  # global, increasing: the SSE event id
    job_id: str
    type: str
    data: dict[str, Any]
    created_at: float


@dataclass
class EventRecord:
    """An event to append, with what the same transaction changes on its job and, when the job's
    webhook takes this event, the message for the outbox ({"url", "secret", "payload"})."""

    job_id: str
    type: str
    data: dict[str, Any]
    webhook: dict[str, Any] | None = None
    job_update: dict[str, Any] | None = None


@dataclass
class Delivery:
    """One webhook message in the outbox: its id is the `webhook-id` every retry repeats."""

    id: str
    job_id: str
    event_type: str
    url: str
    payload: str  # the exact JSON body signed and sent
    secret: str | None
    status: str = "pending"  # pending | delivered | failed | disabled
    attempts: int = 0
    next_attempt_at: float = 0.0
    created_at: float = field(default_factory=time.time)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


@dataclass
class JobsConfig:
    """Where jobs live and how they run. `from_env()` reads OMNISTAGE_JOBS_* variables."""

    directory: Path  # holds jobs.sqlite3 and outputs/
    retention_s: float = 24 * 3600.0  # outputs (and the job record) kept this long after finishing
    max_running_per_model: int = 8  # jobs handed to one pipeline's admission at a time
    on_interrupt: str = "rerun"  # a job running when the server died: "rerun" or "fail"
    webhook_secrets: tuple[str, ...] = ()  # whsec_...; every one signs (rotation)
    webhook_schedule_s: tuple[float, ...] = (0, 5, 300, 1800, 7200, 18000, 36000)
    webhook_jitter: float = 0.1  # each wait is stretched by up to this fraction, at random
    webhook_timeout_s: float = 10.0
    webhook_allow: tuple[str, ...] = ()  # networks (CIDR) a webhook may reach though private
    sweep_interval_s: float = 60.0
    max_queued_per_key: int | None = None  # queued jobs one API key may have (None: no limit)
    db_url: str | None = None  # postgresql+psycopg://...: a store shared by several servers
    max_attempts: int = 3  # runs of a job whose stage worker died under it (retries + 1)
    retry_backoff_s: float = 1.0  # wait before the first such retry; doubled for each next one
    webhook_resolver: str | None = None  # "host[:port]" of a DNS server for webhook hosts (None: the system's)

    def __post_init__(self) -> None:
        if self.on_interrupt not in ("rerun", "fail"):
            raise ValueError(f"on_interrupt must be 'rerun' or 'fail', not {self.on_interrupt!r}")
        if self.max_queued_per_key is not None and self.max_queued_per_key < 1:
            raise ValueError("max_queued_per_key must be at least 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.max_running_per_model < 1:
            raise ValueError("max_running_per_model must be at least 1")
        for secret in self.webhook_secrets:
            if not secret.startswith("whsec_"):
                raise ValueError("webhook secrets look like whsec_<base64>")

    @property
    def db_path(self) -> Path:
        return self.directory / "jobs.sqlite3"

    @property
    def outputs_dir(self) -> Path:
        return self.directory / "outputs"

    @classmethod
    def from_env(cls) -> JobsConfig:
        env = os.environ
        # relative to the server's working directory: two servers started in different
        # directories never share (and lock each other out of) one jobs database
        directory = Path(env.get("OMNISTAGE_JOBS_DIR") or "omnistage-jobs").absolute()
        schedule = env.get("OMNISTAGE_WEBHOOK_SCHEDULE")
        return cls(
            directory=directory,
            retention_s=_env_float("OMNISTAGE_JOBS_RETENTION_S", 24 * 3600.0),
            max_running_per_model=int(env.get("OMNISTAGE_JOBS_MAX_RUNNING", "8")),
            on_interrupt=env.get("OMNISTAGE_JOBS_ON_INTERRUPT", "rerun"),
            webhook_secrets=tuple(s for s in env.get("OMNISTAGE_WEBHOOK_SECRETS", "").split(",") if s),
            webhook_schedule_s=tuple(float(s) for s in schedule.split(",")) if schedule else cls.webhook_schedule_s,
            webhook_jitter=_env_float("OMNISTAGE_WEBHOOK_JITTER", 0.1),
            webhook_timeout_s=_env_float("OMNISTAGE_WEBHOOK_TIMEOUT_S", 10.0),
            webhook_allow=tuple(s for s in env.get("OMNISTAGE_WEBHOOK_ALLOW", "").split(",") if s),
            sweep_interval_s=_env_float("OMNISTAGE_JOBS_SWEEP_S", 60.0),
            max_queued_per_key=int(env["OMNISTAGE_JOBS_MAX_QUEUED_PER_KEY"])
            if env.get("OMNISTAGE_JOBS_MAX_QUEUED_PER_KEY")
            else None,
            db_url=env.get("OMNISTAGE_JOBS_DB") or None,
            max_attempts=int(env.get("OMNISTAGE_JOBS_MAX_ATTEMPTS", "3")),
            retry_backoff_s=_env_float("OMNISTAGE_JOBS_RETRY_BACKOFF_S", 1.0),
            webhook_resolver=env.get("OMNISTAGE_WEBHOOK_RESOLVER") or None,
        )
