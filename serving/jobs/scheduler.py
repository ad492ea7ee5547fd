"""The scheduler: moves queued jobs from the store into the runtime's admission, and runs them.

Per model, at most `max_running_per_model` jobs are in the runtime at once; the rest wait in
the store (a burst of thousands of jobs costs rows, not memory). A job in the runtime is one
`pipeline.stream()`; its chunks become the job's progress, preview and output events, and its
end becomes completed or failed. Cancelling a running job cancels its task, which closes the
stream: the runtime aborts the request in every stage (the denoiser drops it at its next step
boundary and frees its slot).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from omnistage.errors import OmnistageError, WorkerDiedError
from omnistage.serving.errors import storage_full
from omnistage.serving.jobs.live import LiveAudio, LiveVideo
from omnistage.serving.jobs.model import Job, JobStatus
from omnistage.serving.jobs.outputs import output_formats, write_outputs
from omnistage.serving.media import DEFAULT_FPS, DEFAULT_SAMPLE_RATE
from omnistage.stages.contracts import combine_chunks

if TYPE_CHECKING:
    from omnistage.serving.jobs.service import JobService

log = logging.getLogger("omnistage.jobs")

IDLE_POLL_S = 0.5  # with nothing to start, how often the store is looked at anyway
LEASE_S = 20.0  # a running job stays this server's this long past its last renewal
RENEW_S = 2.0  # how often leases are renewed (and cancels asked on another server are seen)


class Scheduler:
    def __init__(self, service: JobService):
        self.service = service
        self.running: dict[str, asyncio.Task] = {}  # job id -> its task
        self.live: dict[str, LiveVideo | LiveAudio] = {}  # job id -> its media being streamed
        self.wake = asyncio.Event()
        self._models: dict[str, str] = {}
        self._claiming = False  # a claim is in the store's thread: its jobs have no task yet
        self._cancel_after_claim: set[str] = set()

    def running_for(self, model: str) -> int:
        return sum(1 for job_id, model_of in self._models.items() if model_of == model and job_id in self.running)

    async def run(self) -> None:
        renewed = time.monotonic()
        while True:
            self.wake.clear()
            await self._start_what_fits()
            if time.monotonic() - renewed >= RENEW_S:
                renewed = time.monotonic()
                await self._renew()
            try:
                async with asyncio.timeout(IDLE_POLL_S):  # no task per wake-up, as wait_for makes
                    await self.wake.wait()
            except TimeoutError:
                pass

    async def _start_what_fits(self) -> None:
        store, registry = self.service.store, self.service.registry
        limit = self.service.config.max_running_per_model
        if registry.draining or all(self.running_for(m) >= limit for m in registry.names()):
            return  # nothing could start: under a burst of submissions, no store query per wake-up
        for model in await asyncio.to_thread(store.queued_models):
            entry = registry.entry(model)
            if entry is None or not entry.is_ready() or registry.draining:
                continue  # waits in the store until the pipeline is ready
            room = limit - self.running_for(model)
            if room <= 0:
                continue
            self._claiming = True
            try:
                claimed = await asyncio.to_thread(
                    store.claim_queued, model, room, self.service.runner, time.time() + LEASE_S
                )
            finally:
                self._claiming = False
            for job in claimed:
                self._models[job.id] = model
                task = asyncio.create_task(self._run_job(job, entry), name=f"job-{job.id}")
                self.running[job.id] = task
                task.add_done_callback(lambda _t, job_id=job.id: self._finished(job_id))
                if job.id in self._cancel_after_claim:  # canceled while the claim was in flight
                    task.cancel()
            self._cancel_after_claim.clear()

    async def _renew(self) -> None:
        """Keep this server's claim on its running jobs; cancel those a client canceled through
        another server sharing the store."""
        store = self.service.store
        canceled = await asyncio.to_thread(store.renew_leases, self.service.runner, time.time() + LEASE_S)
        for job_id in canceled:
            self.cancel(job_id)

    def _finished(self, job_id: str) -> None:
        self.running.pop(job_id, None)
        self._models.pop(job_id, None)
        self.wake.set()

    def cancel(self, job_id: str) -> bool:
        """Cancel a running job's task: True when this server runs it (or is claiming jobs, so
        that it may: the job's task is canceled as soon as it exists)."""
        task = self.running.get(job_id)
        if task is None:
            if self._claiming:
                self._cancel_after_claim.add(job_id)
            return self._claiming
        task.cancel()
        return True

    async def _run_job(self, job: Job, entry: Any) -> None:
        """Run the job; a stage worker that died under it (the runtime restarts it) costs a retry
        after a backoff, up to `max_attempts` runs, then the job fails with that error."""
        service, config = self.service, self.service.config
        try:
            while True:
                died = await self._attempt(job, entry.pipeline)
                if died is None:
                    return
                if job.attempts >= config.max_attempts:
                    died["message"] += f" (the job ran {job.attempts} times; max_attempts is {config.max_attempts})"
                    await service.finish(job.id, JobStatus.FAILED, error=died)
                    return
                wait = config.retry_backoff_s * 2 ** (job.attempts - 1)
                log.info("job %s: attempt %d lost its worker; retrying in %.1f s", job.id, job.attempts, wait)
                data = {"attempt": job.attempts, "next_attempt": job.attempts + 1, "in_s": wait, "error": died}
                await service.emit(job.id, "retry", data, webhook=False, job_update={"progress_done": 0})
                await asyncio.sleep(wait)
                while not entry.is_ready():  # the runtime is still restarting the worker
                    await asyncio.sleep(0.1)
                job.attempts += 1
        except asyncio.CancelledError:
            if service.stopping:  # the server stops, not the client: the next start runs it again
                await service.emit(job.id, "queued", {"reason": "server stopped"}, webhook=False,
                                   job_update={"status": JobStatus.QUEUED, "started_at": None})  # fmt: skip
            else:
                await service.finish(job.id, JobStatus.CANCELED, error=None)
            raise
        except Exception as err:  # noqa: BLE001 - the store refused the job's events (say, a full disk)
            await service.finish_when_stored(job.id, _failure(job, err))

    async def _attempt(self, job: Job, pipeline: Any) -> dict | None:
        """One run of the job, finished as completed or failed; except when a stage worker died
        under it and a retry can help: then its error, and the job stays in_progress."""
        service = self.service
        await service.emit(job.id, "started", {"attempt": job.attempts}, job_update={"attempts": job.attempts})
        live = self._live_video(job, pipeline)
        try:
            return await self._run_attempt(job, pipeline, live)
        finally:  # only now: a stream client that sees the end then finds the job ended too
            if live is not None:
                live.done = True
                self.live.pop(job.id, None)
                service.notify()

    async def _run_attempt(self, job: Job, pipeline: Any, live: LiveVideo | LiveAudio | None) -> dict | None:
        service = self.service
        try:
            outputs = await self._stream(job, pipeline, live)
            whole = await asyncio.to_thread(live.finish) if live is not None else None
            prebuilt = {live.port: whole} if whole else {}  # a muxed video is the file; audio is written whole
            formats = output_formats(pipeline.spec, job.output_format)
            record = await asyncio.to_thread(
                write_outputs, job.id, outputs, formats, service.config.outputs_dir, prebuilt
            )
        except OmnistageError as err:
            error = {"message": str(err), "code": err.code, "param": getattr(err, "param", None), "status": err.status}
            if isinstance(err, WorkerDiedError) and err.retryable:
                return error
            await service.finish(job.id, JobStatus.FAILED, error=error)
            return None
        except Exception as err:  # noqa: BLE001 - a job's failure must not stop the scheduler
            await service.finish(job.id, JobStatus.FAILED, error=_failure(job, err))
            return None
        for port, value in record.items():
            if isinstance(value, dict) and "files" in value:
                # the job's record lists its files in the same transaction, so a client that
                # fetches a URL as soon as this event names it finds the file
                urls = service.output_urls(job.id, value)
                await service.emit(job.id, "output", {"port": port, "urls": urls}, job_update={"outputs": record})
        await service.finish(job.id, JobStatus.COMPLETED, outputs=record)
        return None

    def _live_video(self, job: Job, pipeline: Any) -> LiveVideo | LiveAudio | None:
        """The job's first MP4 video or WAV/PCM audio port, sent to stream clients as it is made
        (serving/jobs/live.py)."""
        for port, media in output_formats(pipeline.spec, job.output_format).items():
            if media.port_type == "video" and media.format == "mp4":
                live = self.live[job.id] = LiveVideo(port, float(media.option("fps", DEFAULT_FPS)))
                return live
            if media.port_type == "audio" and media.format in ("wav", "pcm"):
                rate = int(media.option("sample_rate", DEFAULT_SAMPLE_RATE))
                live = self.live[job.id] = LiveAudio(port, rate, media.format)
                return live
        return None

    async def _stream(self, job: Job, pipeline: Any, live: LiveVideo | None) -> dict[str, Any]:
        from omnistage.serving.routes.pipelines import _to_inputs
        from omnistage.serving.tenancy import salted

        inputs = _to_inputs(pipeline.spec, job.inputs)
        chunks: dict[str, list[Any]] = {p: [] for p in pipeline.spec.outputs}
        params = salted(pipeline.spec, job.params, job.owner)  # one key's prompts never warm another's cache
        stream = pipeline.stream(inputs, params, request_id=f"{job.id}-{job.attempts}")
        last_percent: tuple[Any, int] | None = None
        last_step: tuple[int, int] | None = None
        try:
            async for chunk in stream:
                if chunk.progress is not None and tuple(chunk.progress) != last_step:
                    done, total = last_step = tuple(chunk.progress)
                    # one event per percent (and the first and last step): a 1,000-step job
                    # writes ~100 progress rows to the store, not 1,000
                    percent = (chunk.stage, int(100 * done / total) if total else done)
                    if percent != last_percent or done == total:
                        last_percent = percent
                        await self.service.progress(job.id, done, total, stage=chunk.stage)
                if chunk.port is not None and chunk.data is not None:
                    chunks.setdefault(chunk.port, []).append(chunk.data)
                    if live is not None and chunk.port == live.port and await asyncio.to_thread(live.push, chunk.data):
                        self.service.notify()
                    if not chunk.final:
                        index = len(chunks[chunk.port]) - 1
                        data = {"port": chunk.port, "chunk": index}
                        await self.service.emit(job.id, "preview", data, webhook=False)
        finally:
            await stream.aclose()
        return {p: combine_chunks(c) for p, c in chunks.items()}


def _failure(job: Job, err: Exception) -> dict:
    """The error of a job that failed on something other than a clear OmnistageError."""
    if storage_full(err):
        log.error("job %s failed: storage full: %s", job.id, err)
        message = "the server's storage is full (its job store or output directory); the job's outputs were not kept"
        return {"message": message, "code": "storage_full", "param": None, "status": 507}
    log.exception("job %s failed", job.id, exc_info=err)
    return {"message": f"{type(err).__name__}: {err}", "code": "internal_error", "param": None, "status": 500}
