"""The omnistage system of the diffusion benchmark: the real runtime on a 3-stage graph.

text_encoder -> denoiser (step-level batching) -> vae_decoder, one worker process per stage,
requests replayed at their arrival offsets through `Pipeline.stream`. The first denoise
step's time comes from the first progress event (sent when that step ends) minus the
denoiser's p50 step time.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omnistage.bench.diffusion_baselines import (
    GUIDANCE_SCALE,
    MAX_SEQUENCE_LENGTH,
    BenchRequest,
    RequestRecord,
    RunResult,
)

if TYPE_CHECKING:
    from omnistage.bench.diffusion import BenchConfig


def omnistage_yaml(model_dir: Path, cfg: BenchConfig) -> str:
    return f"""
name: bench-diffusion
description: diffusion benchmark pipeline (SD3 architecture, fixed denoiser)
inputs: {{prompt: text}}
outputs: {{image: image}}
stages:
  text_encoder:
    kind: text_encoder
    model: {model_dir}
    pool: {{devices: [cpu], threads: 1, dtype: float32}}
    batching: {{policy: dynamic, max_batch_size: {2 * cfg.max_batch_size}, max_wait_ms: 1}}
  denoiser:
    kind: denoiser
    model: {model_dir}
    pool: {{devices: [cpu], threads: {cfg.threads}, dtype: float32}}
    batching: {{policy: step, max_batch_size: {cfg.max_batch_size}}}
  vae:
    kind: vae_decoder
    model: {model_dir}
    pool: {{devices: [cpu], threads: 1, dtype: float32}}
    batching: {{policy: dynamic, max_batch_size: {cfg.max_batch_size}, max_wait_ms: 1}}
edges:
  - {{from: inputs.prompt, to: text_encoder.prompt}}
  - {{from: text_encoder.prompt_embeds, to: denoiser.prompt_embeds}}
  - {{from: text_encoder.pooled_prompt_embeds, to: denoiser.pooled_prompt_embeds}}
  - {{from: denoiser.latents, to: vae.latents}}
  - {{from: vae.image, to: outputs.image}}
"""


def start_omnistage(model_dir: Path, cfg: BenchConfig):
    from omnistage import Pipeline

    path = Path(tempfile.mkdtemp(prefix="omnistage-bench-")) / "bench-diffusion.yaml"
    path.write_text(omnistage_yaml(model_dir, cfg))
    return Pipeline.from_yaml(str(path), ready_timeout=900)


def _generation(r: BenchRequest) -> dict:
    return {
        "width": r.size,
        "height": r.size,
        "num_inference_steps": r.steps,
        "seed": r.seed,
        "guidance_scale": GUIDANCE_SCALE,
        "negative_prompt": "",
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "output_type": "float",
    }


def run_omnistage(pipe, requests: list[BenchRequest]) -> RunResult:
    """Replay requests (arrival offsets) through Pipeline.stream; first step from progress events."""
    from omnistage.stages.diffusion import stage_params

    before = _denoiser_step_ms(pipe)
    wait_before = _denoiser_wait_totals(pipe)
    first_progress: dict[int, float] = {}

    async def one(r: BenchRequest, t0: float, rec: RequestRecord) -> None:
        delay = t0 + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async for chunk in pipe.stream({"prompt": r.prompt}, stage_params(pipe, _generation(r))):
            if chunk.progress is not None and r.index not in first_progress:
                first_progress[r.index] = time.perf_counter()
            if chunk.port == "image" and chunk.data is not None:
                rec.image = chunk.data[0].permute(2, 0, 1).float()
        rec.finish = time.perf_counter()

    async def main() -> tuple[dict[int, RequestRecord], float]:
        t0 = time.perf_counter()
        records = {r.index: RequestRecord(r.index, t0 + r.arrival_s) for r in requests}
        await asyncio.gather(*(one(r, t0, records[r.index]) for r in requests))
        return records, t0

    records, t0 = asyncio.run(main())
    wall = max(rec.finish for rec in records.values()) - t0
    step_ms = _denoiser_step_ms(pipe) or before
    # The first denoise step ends when its progress event is sent: subtract one typical step.
    for idx, rec in records.items():
        rec.first_step = max(rec.arrival, first_progress.get(idx, rec.finish) - step_ms / 1000.0)
    wait_after = _denoiser_wait_totals(pipe)
    served = wait_after[1] - wait_before[1]
    engine_wait = (wait_after[0] - wait_before[0]) / served if served > 0 else float("nan")
    return RunResult(
        [records[r.index] for r in requests], wall, {"step_ms_p50": step_ms, "denoiser_queue_wait_ms_mean": engine_wait}
    )


def _denoiser_wait_totals(pipe) -> tuple[float, float]:
    """(sum of ms, count) of the denoiser's own queue waits (its admission -> first step),
    from its cumulative mean and its completed count (every completed request had a first step)."""
    try:
        stats = pipe.stage_stats()["denoiser"]
        count = float(stats.get("completed", 0.0))
        return float(stats.get("queue_wait_ms_mean", 0.0)) * count, count
    except Exception:  # noqa: BLE001 - stats are best effort
        return 0.0, 0.0


def _denoiser_step_ms(pipe) -> float:
    try:
        return float(pipe.stage_stats()["denoiser"]["step_ms_p50"])
    except Exception:  # noqa: BLE001 - stats are best effort
        return 0.0
