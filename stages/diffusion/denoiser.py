"""Stage kind `denoiser`: step-level continuous batching over per-request scheduler state.

add() validates the request (the checkpoint's size range with its defaults filled in,
stages/diffusion/limits.py; the stage param `defaults` restates them per pipeline; and the
stage params max_inference_steps
(default 1000), max_images_per_prompt (64), max_frames (1024), max_pixels (4096x4096)) and
prepares its DenoiseState (latents from its own generator, its own scheduler); every step() runs one shared transformer forward through the StepEngine
and emits progress (step i of n) for each request in it, and the final latents when done.
"""

from __future__ import annotations

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Emission, Port, StageEngine, StageRequest
from omnistage.stages.contracts import error_emission
from omnistage.stages.diffusion.adapters.base import (
    GENERATION_PARAMS,
    LOADING_PARAMS,
    GenerationParams,
    TextConditioning,
)
from omnistage.stages.diffusion.limits import defaults_problem
from omnistage.stages.diffusion.loading import build_adapter
from omnistage.stages.diffusion.step_engine import StepEngine
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage

STAGE_PARAMS = ParamSet(
    "denoiser",
    LOADING_PARAMS
    + (
        Param("max_inference_steps", "integer", 1000, "Largest num_inference_steps a request may ask.", minimum=1),
        Param("max_images_per_prompt", "integer", 64, "Largest num_images_per_prompt.", minimum=1),
        Param("max_frames", "integer", 1024, "Largest num_frames.", minimum=1),
        Param("max_pixels", "integer", 4096 * 4096, "Largest width x height.", minimum=1),
        Param(
            "aging_factor",
            "number",
            4.0,
            "A bucket passed over for this many times its own work is served next.",
            minimum=0,
        ),
        Param(
            "aging_wait_s",
            "number",
            None,
            "Or: a bucket not served for this many seconds is served next.",
            minimum=0,
            nullable=True,
        ),
        Param(
            "defaults",
            "mapping",
            None,
            "This pipeline's defaults for what a request leaves out ({height, width, num_frames, "
            "num_inference_steps, guidance_scale}); default: the model family's, fitted to the checkpoint.",
            nullable=True,
            check=defaults_problem,
        ),
    ),
)


@register_stage("denoiser")
class DenoiserStage(StageEngine):
    inputs = {
        "prompt_embeds": Port("embeddings"),
        "pooled_prompt_embeds": Port("embeddings", optional=True),
        "prompt_mask": Port("tensor", optional=True),
    }
    outputs = {"latents": Port("latents")}
    batching_policies = ("step",)
    needs_model = True
    stage_params = STAGE_PARAMS
    request_params = GENERATION_PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.adapter = build_adapter(ctx, "DENOISER")
        p = STAGE_PARAMS.validate(ctx.params)
        self.adapter.limits = self.adapter.limits.with_defaults(p["defaults"])
        self.engine = StepEngine(
            self.adapter,
            max_batch_size=ctx.batching.max_batch_size,
            max_latent_tokens=ctx.batching.max_latent_tokens,
            aging_factor=p["aging_factor"],
            aging_wait_s=p["aging_wait_s"],
        )
        self.step_log = self.engine.step_log
        self._errors: list[Emission] = []
        # request-size limits (stage params): a request beyond them fails as invalid_request
        self.limits = {
            "num_inference_steps": p["max_inference_steps"],
            "num_images_per_prompt": p["max_images_per_prompt"],
            "num_frames": p["max_frames"],
        }
        self.max_pixels = p["max_pixels"]

    def _check_limits(self, params: GenerationParams) -> None:
        for key, limit in self.limits.items():
            value = getattr(params, key)
            if value is not None and value > limit:
                raise InvalidRequestError(f"{key} must be <= {limit} on this server, got {value}", param=key)
        if params.width and params.height and params.width * params.height > self.max_pixels:
            raise InvalidRequestError(
                f"width x height must be <= {self.max_pixels} pixels on this server, got "
                f"{params.width}x{params.height}",
                param="width",
            )

    def add(self, request: StageRequest) -> None:
        rid = request.request_id
        try:
            params = GenerationParams.from_dict(request.params)
            self._check_limits(params)
            embeds = request.inputs.get("prompt_embeds")
            if embeds is None:
                raise ValueError("denoiser request without prompt_embeds")
            text = TextConditioning(
                embeds=embeds,
                pooled=request.inputs.get("pooled_prompt_embeds"),
                mask=request.inputs.get("prompt_mask"),
            )
            if self.engine.state(rid) is not None:
                raise ValueError(f"request {rid!r} is already denoising")
            state = self.adapter.prepare(rid, params, text)
        except Exception as exc:  # noqa: BLE001 - this request fails alone (invalid: 400, else 500)
            self._errors.append(error_emission(rid, exc))
            return
        self.engine.add(state)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._errors = [e for e in self._errors if e.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self._errors) or self.engine.has_work()

    def num_requests(self) -> int:
        return self.engine.num_requests()

    def step(self) -> list[Emission]:
        emissions, self._errors = self._errors, []
        for ev in self.engine.step():
            if ev.error is not None:
                emissions.append(Emission(ev.request_id, error=ev.error, error_kind=ev.error_kind, finished=True))
            elif ev.finished:
                emissions.append(
                    Emission(ev.request_id, outputs={"latents": ev.latents}, finished=True, progress=ev.progress)
                )
            else:
                emissions.append(Emission(ev.request_id, progress=ev.progress))
        return emissions

    def stats(self) -> dict[str, float]:
        return self.engine.stats()
