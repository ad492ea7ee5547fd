"""The systems omnistage is measured against, all in this process on the same pipeline object.

- serial FIFO: the diffusers pipeline called one request at a time in arrival order;
- request-level batching: the waiting requests with the same shape and steps as the head of
  the queue run as one pipeline call (one generator per request, as diffusers takes them);
- ideal: a bare loop (no processes, no scheduler objects, no queues) pushing the same
  requests through the same denoiser in full batches of `max_batch_size` images: a slot that
  frees is refilled at once, text encoding and VAE decoding are batched in the same sizes.

Every system records per request: arrival, first denoise step start (a forward pre-hook on
the transformer), finish, and the image.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

GUIDANCE_SCALE = 4.5
MAX_SEQUENCE_LENGTH = 77


@dataclass
class BenchRequest:
    index: int
    prompt: str
    seed: int
    size: int  # width = height
    steps: int
    arrival_s: float = 0.0  # offset from the start of the run

    @property
    def shape_key(self) -> tuple[int, int]:
        return (self.size, self.steps)


@dataclass
class RequestRecord:
    index: int
    arrival: float  # absolute perf_counter time
    first_step: float | None = None
    finish: float | None = None
    image: torch.Tensor | None = None  # [3, H, W] float in [0, 1]

    @property
    def latency_s(self) -> float:
        return self.finish - self.arrival

    @property
    def queue_wait_s(self) -> float:
        return self.first_step - self.arrival


@dataclass
class RunResult:
    records: list[RequestRecord]
    wall_s: float
    extra: dict = field(default_factory=dict)


class _FirstForwardProbe:
    """Marks the wall time of the first transformer forward after `arm()`."""

    def __init__(self, transformer):
        self.armed_at: float | None = None
        self.first: float | None = None
        self._handle = transformer.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self.first is None:
            self.first = time.perf_counter()

    def arm(self) -> None:
        self.first = None

    def close(self) -> None:
        self._handle.remove()


def service_times(result: RunResult) -> list[float]:
    """Per-request service time of a serial run: finish minus the later of its arrival and the
    previous request's finish (latency would also count the queueing behind earlier requests)."""
    out, free_at = [], None
    for rec in sorted(result.records, key=lambda r: r.finish):
        start = rec.arrival if free_at is None else max(rec.arrival, free_at)
        out.append(rec.finish - start)
        free_at = rec.finish
    return out


def call_pipeline(pipe, requests: list[BenchRequest]) -> torch.Tensor:
    """One diffusers call for requests of equal size and steps: [B, 3, H, W] in [0, 1]."""
    r0 = requests[0]
    return pipe(
        prompt=[r.prompt for r in requests],
        negative_prompt=[""] * len(requests),
        height=r0.size,
        width=r0.size,
        num_inference_steps=r0.steps,
        guidance_scale=GUIDANCE_SCALE,
        generator=[torch.Generator("cpu").manual_seed(r.seed) for r in requests],
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        output_type="pt",
    ).images


def _replay(requests: list[BenchRequest], serve_loop, t0: float) -> dict[int, RequestRecord]:
    """Feed requests into a queue at their arrival offsets while `serve_loop(q, records)` serves."""
    records = {r.index: RequestRecord(r.index, t0 + r.arrival_s) for r in requests}
    q: queue.Queue = queue.Queue()
    worker = threading.Thread(target=serve_loop, args=(q, records, len(requests)), daemon=True)
    worker.start()
    for r in sorted(requests, key=lambda r: r.arrival_s):
        delay = t0 + r.arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        q.put(r)
    worker.join()
    return records


def run_serial(pipe, requests: list[BenchRequest]) -> RunResult:
    probe = _FirstForwardProbe(pipe.transformer)

    def serve(q, records, total):
        for _ in range(total):
            r = q.get()
            probe.arm()
            image = call_pipeline(pipe, [r])[0]
            rec = records[r.index]
            rec.first_step, rec.finish, rec.image = probe.first, time.perf_counter(), image

    t0 = time.perf_counter()
    try:
        records = _replay(requests, serve, t0)
    finally:
        probe.close()
    return RunResult([records[r.index] for r in requests], time.perf_counter() - t0)


def run_request_batching(pipe, requests: list[BenchRequest], max_batch_size: int) -> RunResult:
    probe = _FirstForwardProbe(pipe.transformer)
    calls: list[int] = []

    def serve(q, records, total):
        waiting: list[BenchRequest] = []
        done = 0
        while done < total:
            if not waiting:
                waiting.append(q.get())
            while True:  # everything that has arrived by now
                try:
                    waiting.append(q.get_nowait())
                except queue.Empty:
                    break
            head = waiting[0]
            batch = [r for r in waiting if r.shape_key == head.shape_key][:max_batch_size]
            waiting = [r for r in waiting if r not in batch]
            probe.arm()
            images = call_pipeline(pipe, batch)
            now = time.perf_counter()
            for r, image in zip(batch, images):
                rec = records[r.index]
                rec.first_step, rec.finish, rec.image = probe.first, now, image
            calls.append(len(batch))
            done += len(batch)

    t0 = time.perf_counter()
    try:
        records = _replay(requests, serve, t0)
    finally:
        probe.close()
    return RunResult([records[r.index] for r in requests], time.perf_counter() - t0, {"batch_sizes": calls})


@torch.no_grad()
def run_ideal(pipe, requests: list[BenchRequest], max_batch_size: int) -> RunResult:
    """Saturation only (all requests present at t0): the bare batched loop."""
    t0 = time.perf_counter()
    records = {r.index: RequestRecord(r.index, t0) for r in requests}
    sched_cls, sched_cfg = type(pipe.scheduler), pipe.scheduler.config
    transformer, vae = pipe.transformer, pipe.vae
    # 1) text: prompts of max_batch_size requests per encoder call
    cond: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for start in range(0, len(requests), max_batch_size):
        chunk = requests[start : start + max_batch_size]
        pe, ne, pp, npp = pipe.encode_prompt(
            prompt=[r.prompt for r in chunk],
            prompt_2=None,
            prompt_3=None,
            negative_prompt=[""] * len(chunk),
            do_classifier_free_guidance=True,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        for i, r in enumerate(chunk):
            cond[r.index] = (pe[i], ne[i], pp[i], npp[i])
    # 2) denoise: slots refilled as soon as a request finishes; groups by latent size
    scale = pipe.vae_scale_factor
    sigmas_for: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    finished: dict[int, torch.Tensor] = {}
    for size in sorted({r.size for r in requests}):
        todo = [r for r in requests if r.size == size]
        active: list[dict] = []
        while todo or active:
            while todo and len(active) < max_batch_size:
                r = todo.pop(0)
                if r.steps not in sigmas_for:
                    s = sched_cls.from_config(sched_cfg)
                    s.set_timesteps(r.steps)
                    sigmas_for[r.steps] = (s.sigmas.clone(), s.timesteps.clone())
                lat = torch.randn(
                    (1, transformer.config.in_channels, size // scale, size // scale),
                    generator=torch.Generator("cpu").manual_seed(r.seed),
                )
                active.append({"r": r, "x": lat, "i": 0, "sig": sigmas_for[r.steps]})
            x = torch.cat([a["x"] for a in active])
            sig = torch.stack([a["sig"][0][a["i"]] for a in active])
            sig_next = torch.stack([a["sig"][0][a["i"] + 1] for a in active])
            ts = torch.stack([a["sig"][1][a["i"]] for a in active])
            emb = torch.stack([cond[a["r"].index][1] for a in active] + [cond[a["r"].index][0] for a in active])
            pooled = torch.stack([cond[a["r"].index][3] for a in active] + [cond[a["r"].index][2] for a in active])
            for a in active:
                if records[a["r"].index].first_step is None:
                    records[a["r"].index].first_step = time.perf_counter()
            out = transformer(
                hidden_states=torch.cat([x, x]),
                timestep=torch.cat([ts, ts]),
                encoder_hidden_states=emb,
                pooled_projections=pooled,
                return_dict=False,
            )[0]
            uncond, text = out.chunk(2)
            guided = uncond + GUIDANCE_SCALE * (text - uncond)
            x = x + (sig_next - sig).view(-1, 1, 1, 1) * guided
            still = []
            for k, a in enumerate(active):
                a["x"], a["i"] = x[k : k + 1], a["i"] + 1
                if a["i"] == a["r"].steps:
                    finished[a["r"].index] = a["x"]
                else:
                    still.append(a)
            active = still
    # 3) decode in batches of max_batch_size per size
    for size in sorted({r.size for r in requests}):
        group = [r for r in requests if r.size == size]
        for start in range(0, len(group), max_batch_size):
            chunk = group[start : start + max_batch_size]
            z = torch.cat([finished[r.index] for r in chunk])
            z = z / vae.config.scaling_factor + vae.config.shift_factor
            images = pipe.image_processor.postprocess(vae.decode(z, return_dict=False)[0], output_type="pt")
            now = time.perf_counter()
            for r, image in zip(chunk, images):
                records[r.index].finish, records[r.index].image = now, image
    return RunResult([records[r.index] for r in requests], time.perf_counter() - t0)
