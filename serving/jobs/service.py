"""JobService: submit, cancel and describe jobs; owns the scheduler, the webhook sender and the
retention sweep for the lifetime of the app.

A job's events, with their status changes and webhook messages, are group-committed off the
event loop (`emit` awaits the transaction that holds its event: serving/jobs/group_commit.py).
A cancel marks the job in the store first; the scheduler never claims a marked job, and a
claim already in flight is canceled as soon as it lands (scheduler.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import socket
import time
import uuid
from typing import Any

from omnistage.errors import InvalidRequestError, NotFoundError, OmnistageError
from omnistage.graph.inputs import check_params
from omnistage.serving.errors import ModelNotFoundError
from omnistage.serving.jobs.admission import SubmitBatcher
from omnistage.serving.jobs.changes import ChangeSignal
from omnistage.serving.jobs.group_commit import GroupCommitter
from omnistage.serving.jobs.model import (
    DEFAULT_WEBHOOK_EVENTS,
    WEBHOOK_EVENTS,
    EventRecord,
    Job,
    JobEvent,
    JobsConfig,
    JobStatus,
)
from omnistage.serving.jobs.outputs import delete_outputs, output_files, output_formats
from omnistage.serving.jobs.scheduler import Scheduler
from omnistage.serving.jobs.ssrf import Resolver, check_destination, needs_lookup, parse_allow_list
from omnistage.serving.jobs.store import JobStore, open_store
from omnistage.serving.jobs.webhooks import WebhookSender

log = logging.getLogger("omnistage.jobs")

QUEUE_FULL_RETRY_S = 5  # Retry-After of a 429 for a full per-key queue
UNSTORED_RETRY_S = 1.0  # how often a failure the store refused is written again


class JobConflictError(OmnistageError):
    status = 409
    code = "job_finished"


class JobQueueFullError(OmnistageError):
    status = 429
    code = "job_queue_full"

    def __init__(self, limit: int):
        super().__init__(f"This API key already has {limit} queued jobs (the per-key limit); retry later.")
        self.retry_after = QUEUE_FULL_RETRY_S


class IdempotencyKeyReusedError(OmnistageError):
    status = 422
    code = "idempotency_key_reused"

    def __init__(self, key: str, job_id: str):
        super().__init__(
            f"Idempotency-Key {key!r} was used for another request (job {job_id!r}); a retry must send the "
            "same request, a new request needs a new key."
        )
        self.param = "Idempotency-Key"


def request_digest(**request: Any) -> str:
    """A digest of what a job request asks (canonical JSON): equal for a retry of it."""
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class JobNotFoundError(NotFoundError):
    code = "job_not_found"

    def __init__(self, job_id: str):
        super().__init__(f"No job with id {job_id!r} (it may have expired).")
        self.param = "id"


class OutputNotFoundError(NotFoundError):
    code = "output_not_found"

    def __init__(self, job: Job, name: str):
        names = [f["name"] for f in output_files(job.outputs)]
        have = f"its outputs: {', '.join(names)}" if names else f"it has no output file yet (status {job.status.value})"
        super().__init__(f"Job {job.id!r} has no output {name!r}; {have}.")
        self.param = "name"


class JobService:
    def __init__(self, registry: Any, config: JobsConfig, store: JobStore | None = None):
        self.registry = registry
        self.config = config
        self.store = store if store is not None else open_store(config.db_url, config.db_path)
        self.allow = parse_allow_list(config.webhook_allow)
        self.resolver = Resolver(config.webhook_resolver)
        self.scheduler = Scheduler(self)
        self.sender = WebhookSender(self.store, config, self.resolver)
        self.admission = SubmitBatcher(self.store, config.max_queued_per_key)
        self.events = GroupCommitter(self._write_events, after=self._events_written)
        self._new_messages = False  # the last written batch queued webhook messages
        self.changed = ChangeSignal()
        self._tasks: list[asyncio.Task] = []
        self.runner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # this server, in leases
        self.stopping = False  # set by stop(): running jobs go back to the queue, not to canceled
        self.unstored: dict[str, tuple[dict, float]] = {}  # job id -> (error, at): failed, not yet stored

    # -- lifetime -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.config.outputs_dir.mkdir(parents=True, exist_ok=True)
        self._writers = [asyncio.create_task(self.admission.run()), asyncio.create_task(self.events.run())]
        # alone on its store, every running job was this server's; shared, only lapsed leases are dead
        await self.recover(time.time() if self.store.shared else math.inf)
        for coro in (self.scheduler.run(), self.sender.run(), self._sweep()):
            self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        self.stopping = True
        for task in [*self._tasks, *self.scheduler.running.values()]:
            task.cancel()
        # the running jobs' tasks write their way back to the queue before the writers stop
        await asyncio.gather(*self._tasks, *self.scheduler.running.values(), return_exceptions=True)
        await self.events.idle.wait()
        for task in self._writers:
            task.cancel()
        await asyncio.gather(*self._writers, return_exceptions=True)
        self.store.close()

    async def recover(self, now: float = math.inf) -> None:
        """Jobs a dead server left in_progress: queue them again or fail them. `now`: only those
        whose runner's lease ended before it (a shared store; inf: every one, at a lone start)."""
        for job in await asyncio.to_thread(self.store.interrupted_jobs, now):
            if self.config.on_interrupt == "rerun":
                log.info("job %s was interrupted; running it again", job.id)
                await self.emit(job.id, "queued", {"reason": "interrupted"}, webhook=False,
                                job_update={"status": JobStatus.QUEUED, "started_at": None})  # fmt: skip
            else:
                error = {"message": "the server stopped while this job ran", "code": "interrupted", "param": None}
                await self.finish(job.id, JobStatus.FAILED, error=error)

    async def _sweep(self) -> None:
        while True:
            if self.store.shared:  # another server may have died with jobs running
                await self.recover(time.time())
            for job in await asyncio.to_thread(self.store.expired_jobs, time.time()):
                await asyncio.to_thread(delete_outputs, self.config.outputs_dir, job.id)
                await asyncio.to_thread(self.store.delete_job, job.id)
            await asyncio.sleep(self.config.sweep_interval_s)

    # -- requests -----------------------------------------------------------------------------------
    async def submit(self, *, model: str, inputs: dict, params: dict, webhook: dict | None, metadata: dict,
                     priority: int, output_format: dict, idempotency_key: str | None,
                     api: str = "jobs", owner: str | None = None) -> tuple[Job, bool, dict]:  # fmt: skip
        """Validate and store a job; an idempotency key seen before returns that job (and False).
        Returns (job, created, its JSON shape). Concurrent submissions share one transaction."""
        self._check_request(model, inputs, params, output_format)
        if webhook is not None:
            webhook = self._check_webhook(webhook)
            if needs_lookup(webhook["url"]):  # DNS never runs on the event loop
                await asyncio.to_thread(check_destination, webhook["url"], self.allow, self.resolver)
            else:
                check_destination(webhook["url"], self.allow, self.resolver)
        digest, key = None, idempotency_key
        if idempotency_key is not None:
            key = idempotency_key if owner is None else f"{owner}/{idempotency_key}"  # each API key its own
            digest = request_digest(model=model, inputs=inputs, params=params, webhook=webhook, metadata=metadata,
                                    priority=priority, output_format=output_format, api=api, owner=owner)  # fmt: skip
        job = Job(
            id=f"job_{uuid.uuid4().hex}", model=model, inputs=inputs, params=params, priority=priority,
            metadata=metadata, webhook=webhook, output_format=output_format, idempotency_key=key,
            api=api, owner=owner, request_digest=digest,
        )  # fmt: skip
        admitted = await self.admission.submit(job)
        if admitted.refused is not None:
            raise JobQueueFullError(self.config.max_queued_per_key or 0)
        if not admitted.created:
            earlier = admitted.job.request_digest
            if earlier is not None and earlier != digest:  # (None: stored before digests were kept)
                raise IdempotencyKeyReusedError(idempotency_key or "", admitted.job.id)
            return admitted.job, False, self.job_json(admitted.job)
        self.scheduler.wake.set()
        self.notify()
        return admitted.job, True, self.job_json(admitted.job, queue_position=admitted.queue_position, attempts=[])

    def _check_request(self, model: str, inputs: dict, params: dict, output_format: dict) -> None:
        from omnistage.serving.routes.pipelines import _to_inputs

        entry = self.registry.entry(model)
        if entry is None:
            raise ModelNotFoundError(model, self.registry.names())
        spec = entry.effective_spec
        if spec is not None:
            _to_inputs(spec, inputs)
            # once it is ready its checkpoint is on disk: what the stages would refuse, now
            check_params(spec, params, queued=entry.is_ready())
            output_formats(spec, output_format)

    def _check_webhook(self, webhook: dict) -> dict:
        events = webhook.get("events") or list(DEFAULT_WEBHOOK_EVENTS)
        unknown = [e for e in events if e not in WEBHOOK_EVENTS]
        if unknown:
            raise InvalidRequestError(
                f"webhook.events: unknown event(s) {', '.join(unknown)} (choose from {', '.join(WEBHOOK_EVENTS)})",
                param="webhook.events",
            )
        secret = webhook.get("secret")
        if secret is not None and not secret.startswith("whsec_"):
            raise InvalidRequestError("webhook.secret must look like whsec_<base64>", param="webhook.secret")
        if secret is None and not self.config.webhook_secrets:
            raise InvalidRequestError(
                "this server has no webhook signing secret (OMNISTAGE_WEBHOOK_SECRETS); give webhook.secret",
                param="webhook.secret",
            )
        return {"url": webhook["url"], "events": list(events), "secret": secret}

    def get(self, job_id: str, owner: str | None = None) -> Job:
        """The job; another key's job is as absent as an unknown one (`owner` None: any job)."""
        job = self.store.get_job(job_id)
        if job is None or (owner is not None and job.owner != owner):
            raise JobNotFoundError(job_id)
        if job_id in self.unstored and not job.status.finished:
            job.status, job.error, job.finished_at = JobStatus.FAILED, *self.unstored[job_id]
        return job

    def check_cursor(self, after: str | None, owner: str | None, api: str | None = None) -> None:
        """A list's `after` must name a job the caller can see (of `api`, when given)."""
        if after is None:
            return
        job = self.store.get_job(after)
        if job is None or (owner is not None and job.owner != owner) or (api is not None and job.api != api):
            raise InvalidRequestError(f"after: no job {after!r} to list from (it may have expired)", param="after")

    async def cancel(self, job_id: str, owner: str | None = None) -> Job:
        job = self.get(job_id, owner)
        status = job.status if job.status.finished else await asyncio.to_thread(self.store.request_cancel, job_id)
        if status is None:
            raise JobNotFoundError(job_id)
        if status.finished:
            raise JobConflictError(f"job {job_id} is already {status.value}; only queued or running jobs cancel")
        if status is JobStatus.QUEUED:  # marked: no scheduler claims it any more
            await self.finish(job_id, JobStatus.CANCELED)
        elif not self.scheduler.cancel(job_id) and not self.store.shared:
            await self.finish(job_id, JobStatus.CANCELED)  # in_progress but no task: a rerun after restart
        # on a shared store the server running it sees cancel_requested when it renews its lease
        return self.get(job_id)

    # -- events -------------------------------------------------------------------------------------
    async def emit(self, job_id: str, type: str, data: dict, *, webhook: bool = True,
                   job_update: dict | None = None) -> JobEvent | None:  # fmt: skip
        """Append the event (with its job update and webhook message); returns once it is
        committed, in one transaction with the events emitted meanwhile. None: no such job."""
        return await self.events.submit((EventRecord(job_id, type, data, None, job_update), webhook))

    def _write_events(self, batch: list[tuple[EventRecord, bool]]) -> list[JobEvent | None]:
        """In the writer's thread: each webhook payload shows the job as its event leaves it
        (the batch's earlier updates applied), then one transaction for the whole batch."""
        jobs: dict[str, Job | None] = {}
        records: list[EventRecord | None] = []
        for record, webhook in batch:
            if record.job_id not in jobs:
                jobs[record.job_id] = self.store.get_job(record.job_id)
            job = jobs[record.job_id]
            if job is None:  # deleted meanwhile
                records.append(None)
                continue
            for name, value in (record.job_update or {}).items():
                setattr(job, name, value)
            if webhook and job.webhook is not None and record.type in job.webhook.get("events", ()):
                payload = {"type": f"job.{record.type}", "timestamp": _iso(time.time()), "data": self.job_json(job)}
                hook = job.webhook
                record.webhook = {"url": hook["url"], "secret": hook.get("secret"), "payload": json.dumps(payload)}
            records.append(record)
        written = iter(self.store.record_events([r for r in records if r is not None]))
        self._new_messages = self._new_messages or any(r is not None and r.webhook for r in records)
        return [None if r is None else next(written) for r in records]

    def _events_written(self, results: list) -> None:
        if self._new_messages:  # read after the writer's thread has returned
            self._new_messages = False
            self.sender.wake.set()
        self.notify()

    async def progress(self, job_id: str, done: int, total: int, stage: str | None) -> None:
        data = {"done": done, "total": total, "percent": _percent(done, total), "stage": stage}
        await self.emit(job_id, "progress", data, job_update={"progress_done": done, "progress_total": total})

    async def finish(self, job_id: str, status: JobStatus, *, error: dict | None = None,
                     outputs: dict | None = None) -> None:  # fmt: skip
        now = time.time()
        update: dict[str, Any] = {"status": status, "finished_at": now, "expires_at": now + self.config.retention_s}
        if error is not None:
            update["error"] = error
        if outputs is not None:
            update["outputs"] = outputs
        data: dict[str, Any] = {"status": status.value}
        if error is not None:
            data["error"] = error
        await self.emit(job_id, status.value, data, job_update=update)

    async def finish_when_stored(self, job_id: str, error: dict) -> None:
        """Fail a job whose end the store refused to write (a full disk): the job reads as failed
        at once, and the write is tried again until the store takes it."""
        self.unstored[job_id] = (error, time.time())
        self.notify()
        try:
            while True:
                try:
                    await self.finish(job_id, JobStatus.FAILED, error=error)
                    return
                except Exception as exc:  # noqa: BLE001 - retried until it is stored
                    log.warning("job %s: its failure is not stored yet (%s); retrying", job_id, exc)
                    await asyncio.sleep(UNSTORED_RETRY_S)
        finally:
            self.unstored.pop(job_id, None)

    def notify(self) -> None:
        self.changed.notify()

    # -- the public shape -----------------------------------------------------------------------------
    def output_urls(self, job_id: str, record: dict) -> list[dict]:
        return [
            {"url": f"/v1/jobs/{job_id}/outputs/{f['name']}", "media_type": f["media_type"], "bytes": f["bytes"]}
            for f in record["files"]
        ]

    def job_json(self, job: Job, *, queue_position: int | None = None, attempts: list | None = None) -> dict[str, Any]:
        """The job's public shape. `queue_position`, `attempts`: already known (a fresh job)."""
        outputs = {}
        for port, value in job.outputs.items():
            is_files = isinstance(value, dict) and "files" in value
            outputs[port] = {"files": self.output_urls(job.id, value)} if is_files else value
        out: dict[str, Any] = {
            "id": job.id,
            "object": "job",
            "model": job.model,
            "status": job.status.value,
            "progress": {
                "done": job.progress_done,
                "total": job.progress_total,
                "percent": 100
                if job.status is JobStatus.COMPLETED
                else _percent(job.progress_done, job.progress_total),
            },
            "queue_position": None
            if job.status is not JobStatus.QUEUED
            else queue_position
            if queue_position is not None
            else self.store.queue_position(job),
            "priority": job.priority,
            "created_at": job.created_at,
            "started_at": job.started_at,
            "finished_at": job.finished_at,
            "expires_at": job.expires_at,
            "attempts": job.attempts,
            "outputs": outputs,
            "error": job.error,
            "metadata": job.metadata,
        }
        if job.webhook is not None:
            out["webhook"] = {
                "url": job.webhook["url"],
                "events": job.webhook["events"],
                "attempts": self.store.attempts_for_job(job.id) if attempts is None else attempts,
            }
        return out


def _percent(done: int, total: int) -> int:
    return int(100 * done / total) if total else 0


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
