"""JobService: submit, cancel and describe jobs; owns the scheduler, the webhook sender and the
retention sweep for the lifetime of the app.

State transitions and their events run on the event loop's thread (the store calls are
short), so a cancel can never race the scheduler's claim of the same job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from omnistage.errors import InvalidRequestError, NotFoundError, OmnistageError
from omnistage.serving.errors import ModelNotFoundError
from omnistage.serving.jobs.model import DEFAULT_WEBHOOK_EVENTS, WEBHOOK_EVENTS, Job, JobsConfig, JobStatus
from omnistage.serving.jobs.outputs import delete_outputs, output_formats
from omnistage.serving.jobs.scheduler import Scheduler
from omnistage.serving.jobs.ssrf import check_destination, parse_allow_list
from omnistage.serving.jobs.store import JobStore, SQLiteJobStore
from omnistage.serving.jobs.webhooks import WebhookSender

log = logging.getLogger("omnistage.jobs")


class JobConflictError(OmnistageError):
    status = 409
    code = "job_finished"


class JobNotFoundError(NotFoundError):
    code = "job_not_found"

    def __init__(self, job_id: str):
        super().__init__(f"No job with id {job_id!r} (it may have expired).")
        self.param = "id"


class JobService:
    def __init__(self, registry: Any, config: JobsConfig, store: JobStore | None = None):
        self.registry = registry
        self.config = config
        self.store = store if store is not None else SQLiteJobStore(config.db_path)
        self.allow = parse_allow_list(config.webhook_allow)
        self.scheduler = Scheduler(self)
        self.sender = WebhookSender(self.store, config)
        self.changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self.stopping = False  # set by stop(): running jobs go back to the queue, not to canceled

    # -- lifetime -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.config.outputs_dir.mkdir(parents=True, exist_ok=True)
        self.recover()
        for coro in (self.scheduler.run(), self.sender.run(), self._sweep()):
            self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        self.stopping = True
        for task in [*self._tasks, *self.scheduler.running.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self.scheduler.running.values(), return_exceptions=True)
        self.store.close()

    def recover(self) -> None:
        """Jobs the last server left in_progress (it died): queue them again or fail them."""
        for job in self.store.interrupted_jobs():
            if self.config.on_interrupt == "rerun":
                log.info("job %s was interrupted; running it again", job.id)
                self.emit(job.id, "queued", {"reason": "interrupted"}, webhook=False,
                          job_update={"status": JobStatus.QUEUED, "started_at": None})  # fmt: skip
            else:
                error = {"message": "the server stopped while this job ran", "code": "interrupted", "param": None}
                self.finish(job.id, JobStatus.FAILED, error=error)

    async def _sweep(self) -> None:
        while True:
            for job in await asyncio.to_thread(self.store.expired_jobs, time.time()):
                await asyncio.to_thread(delete_outputs, self.config.outputs_dir, job.id)
                await asyncio.to_thread(self.store.delete_job, job.id)
            await asyncio.sleep(self.config.sweep_interval_s)

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, *, model: str, inputs: dict, params: dict, webhook: dict | None, metadata: dict,
               priority: int, output_format: dict, idempotency_key: str | None,
               api: str = "jobs") -> tuple[Job, bool]:  # fmt: skip
        """Validate and store a job; an idempotency key seen before returns that job (and False)."""
        if idempotency_key is not None:
            existing = self.store.job_by_key(idempotency_key)
            if existing is not None:
                return existing, False
        self._check_inputs(model, inputs, output_format)
        if webhook is not None:
            webhook = self._check_webhook(webhook)
        job = Job(
            id=f"job_{uuid.uuid4().hex}", model=model, inputs=inputs, params=params, priority=priority,
            metadata=metadata, webhook=webhook, output_format=output_format, idempotency_key=idempotency_key,
            api=api,
        )  # fmt: skip
        job, created = self.store.create_job(job)
        if created:
            self.scheduler.wake.set()
            self.notify()
        return job, created

    def _check_inputs(self, model: str, inputs: dict, output_format: dict) -> None:
        from omnistage.serving.routes.pipelines import _to_inputs

        entry = self.registry.entry(model)
        if entry is None:
            raise ModelNotFoundError(model, self.registry.names())
        spec = entry.spec if entry.spec is not None else getattr(entry.pipeline, "spec", None)
        if spec is not None:
            _to_inputs(spec, inputs)
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
        check_destination(webhook["url"], self.allow)
        return {"url": webhook["url"], "events": list(events), "secret": secret}

    def get(self, job_id: str) -> Job:
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFoundError(job_id)
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.status.finished:
            raise JobConflictError(f"job {job_id} is already {job.status.value}; only queued or running jobs cancel")
        self.store.update_job(job_id, cancel_requested=True)
        if job.status is JobStatus.QUEUED:
            self.finish(job_id, JobStatus.CANCELED)
        elif not self.scheduler.cancel(job_id):  # in_progress but not ours: a rerun after restart
            self.finish(job_id, JobStatus.CANCELED)
        return self.get(job_id)

    # -- events -------------------------------------------------------------------------------------
    def emit(self, job_id: str, type: str, data: dict, *, webhook: bool = True, job_update: dict | None = None):
        job = self.store.get_job(job_id)
        if job is None:
            return None
        delivery = None
        if webhook and job.webhook is not None and type in job.webhook.get("events", ()):
            if job_update:  # the webhook shows the job as this event leaves it
                for name, value in job_update.items():
                    setattr(job, name, value)
            payload = {"type": f"job.{type}", "timestamp": _iso(time.time()), "data": self.job_json(job)}
            delivery = {"url": job.webhook["url"], "secret": job.webhook.get("secret"), "payload": json.dumps(payload)}
        event = self.store.record_event(job_id, type, data, webhook=delivery, job_update=job_update)
        if delivery is not None:
            self.sender.wake.set()
        self.notify()
        return event

    def progress(self, job_id: str, done: int, total: int, stage: str | None) -> None:
        data = {"done": done, "total": total, "percent": _percent(done, total), "stage": stage}
        self.emit(job_id, "progress", data, job_update={"progress_done": done, "progress_total": total})

    def finish(self, job_id: str, status: JobStatus, *, error: dict | None = None, outputs: dict | None = None):
        now = time.time()
        update: dict[str, Any] = {"status": status, "finished_at": now, "expires_at": now + self.config.retention_s}
        if error is not None:
            update["error"] = error
        if outputs is not None:
            update["outputs"] = outputs
        data: dict[str, Any] = {"status": status.value}
        if error is not None:
            data["error"] = error
        self.emit(job_id, status.value, data, job_update=update)

    def notify(self) -> None:
        async def notify():
            async with self.changed:
                self.changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(notify())
        except RuntimeError:  # no loop (tests driving the service directly)
            pass

    # -- the public shape -----------------------------------------------------------------------------
    def output_urls(self, job_id: str, record: dict) -> list[dict]:
        return [
            {"url": f"/v1/jobs/{job_id}/outputs/{f['name']}", "media_type": f["media_type"], "bytes": f["bytes"]}
            for f in record["files"]
        ]

    def job_json(self, job: Job) -> dict[str, Any]:
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
            "queue_position": self.store.queue_position(job) if job.status is JobStatus.QUEUED else None,
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
                "attempts": self.store.attempts_for_job(job.id),
            }
        return out


def _percent(done: int, total: int) -> int:
    return int(100 * done / total) if total else 0


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
