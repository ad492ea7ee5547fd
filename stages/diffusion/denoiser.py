"""Stage kind `denoiser`: step-level continuous batching over per-request scheduler state.

add() validates the request (the checkpoint's size range with its defaults filled in,
stages/diffusion/limits.py; the stage param `defaults` restates them per pipeline; and the
stage params max_inference_steps
(default 1000), max_images_per_prompt (64), max_frames (1024), max_pixels (4096x4096)) and
prepares its DenoiseState (latents from its own generator, its own scheduler); every step() runs one shared transformer forward through the StepEngine
and emits progress (step i of n) for each request in it, and the final latents when done.
An `image` input makes the request image-to-image (its `strength`, stages/diffusion/img2img.py);
with the stage param `previews`, a request's `partial_images` leave on the streamed `preview`
port as pixels decoded from the denoiser's estimate at evenly spaced steps.
"""

from __future__ import annotations

from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import ABSENT, Emission, Port, StageEngine, StageRequest
from omnistage.stages.contracts import error_emission
from omnistage.stages.diffusion.adapters.base import (
    GENERATION_PARAMS,
    LOADING_PARAMS,
    GenerationParams,
    TextConditioning,
)
from omnistage.stages.diffusion.limits import defaults_problem
from omnistage.stages.diffusion.loading import build_adapter
from omnistage.stages.diffusion.request_caps import CAPS_PARAMS, RequestCaps, check_queued_generation
from omnistage.stages.diffusion.step_engine import StepEngine
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage

STAGE_PARAMS = ParamSet(
    "denoiser",
    LOADING_PARAMS
    + CAPS_PARAMS
    + (
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
            "previews",
            "boolean",
            False,
            "Declare the streamed `preview` output (images decoded at a request's partial_images steps).",
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
        "image": Port("image", optional=True),  # init image: image-to-image
    }
    outputs = {"latents": Port("latents")}
    batching_policies = ("step",)
    needs_model = True
    stage_params = STAGE_PARAMS
    request_params = GENERATION_PARAMS

    @classmethod
    def ports(cls, params: dict[str, Any]):
        outputs = dict(cls.outputs)
        if (params or {}).get("previews"):
            outputs["preview"] = Port("image", streaming=True)
        return dict(cls.inputs), outputs

    @classmethod
    def check_queued(cls, stage, params):
        check_queued_generation(stage, params)

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
        self.caps = RequestCaps.from_stage_params(p)  # a request beyond them fails as invalid_request
        self.previews = bool(p["previews"])
        self._previewed: set[str] = set()

    def _check_limits(self, params: GenerationParams) -> None:
        self.caps.check(params)
        if params.partial_images and not (self.previews and self.adapter.previews):
            why = "has no preview output (stage param previews)" if self.adapter.previews else "cannot preview"
            raise InvalidRequestError(
                f"partial_images: this {self.adapter.family} denoiser {why}", param="partial_images"
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
            image = request.inputs.get("image")
            if image is None:
                state = self.adapter.prepare(rid, params, text)
            elif self.adapter.image_input:
                state = self.adapter.prepare(rid, params, text, image=image)
            else:
                raise InvalidRequestError(f"image: the {self.adapter.family} denoiser has no image-to-image", "image")
        except Exception as exc:  # noqa: BLE001 - this request fails alone (invalid: 400, else 500)
            self._errors.append(error_emission(rid, exc))
            return
        self.engine.add(state)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._previewed.discard(request_id)
        self._errors = [e for e in self._errors if e.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self._errors) or self.engine.has_work()

    def num_requests(self) -> int:
        return self.engine.num_requests()

    def step(self) -> list[Emission]:
        emissions, self._errors = self._errors, []
        for ev in self.engine.step():
            if ev.error is not None:
                self._previewed.discard(ev.request_id)
                emissions.append(Emission(ev.request_id, error=ev.error, error_kind=ev.error_kind, finished=True))
            elif ev.finished:
                outputs = {"latents": ev.latents}
                if self.previews and ev.request_id not in self._previewed:
                    outputs["preview"] = ABSENT
                self._previewed.discard(ev.request_id)
                emissions.append(Emission(ev.request_id, outputs=outputs, finished=True, progress=ev.progress))
            elif ev.preview is not None:
                self._previewed.add(ev.request_id)
                pixels = self.adapter.decode_preview(ev.preview)
                emissions.append(Emission(ev.request_id, outputs={"preview": pixels}, progress=ev.progress))
            else:
                emissions.append(Emission(ev.request_id, progress=ev.progress))
        return emissions

    def stats(self) -> dict[str, float]:
        return self.engine.stats()
