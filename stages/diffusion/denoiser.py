"""Stage kind `denoiser`: step-level continuous batching over per-request scheduler state.

add() validates the request (family rules, and the stage params max_inference_steps
(default 1000), max_images_per_prompt (64), max_frames (1024), max_pixels (4096x4096)) and
prepares its DenoiseState (latents from its own generator, its own scheduler); every step() runs one shared transformer forward through the StepEngine
and emits progress (step i of n) for each request in it, and the final latents when done.
"""

from __future__ import annotations

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Emission, Port, StageEngine, StageRequest
from omnistage.stages.diffusion.adapters.base import GenerationParams, TextConditioning
from omnistage.stages.diffusion.loading import build_adapter
from omnistage.stages.diffusion.step_engine import StepEngine
from omnistage.stages.registry import register_stage


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

    def __init__(self, ctx):
        super().__init__(ctx)
        self.adapter = build_adapter(ctx, "DENOISER")
        b = ctx.batching
        p = ctx.params or {}
        self.engine = StepEngine(
            self.adapter,
            max_batch_size=int(getattr(b, "max_batch_size", 8) or 8),
            max_latent_tokens=getattr(b, "max_latent_tokens", None),
            **{k: p[k] for k in ("aging_factor", "aging_wait_s") if p.get(k) is not None},  # else its defaults
        )
        self.step_log = self.engine.step_log
        self._errors: list[Emission] = []
        # request-size limits (stage params): a request beyond them fails as invalid_request
        self.limits = {
            "num_inference_steps": int(p.get("max_inference_steps", 1000)),
            "num_images_per_prompt": int(p.get("max_images_per_prompt", 64)),
            "num_frames": int(p.get("max_frames", 1024)),
        }
        self.max_pixels = int(p.get("max_pixels", 4096 * 4096))

    @classmethod
    def validate_params(cls, params):
        problems = []
        for key in ("max_inference_steps", "max_images_per_prompt", "max_frames", "max_pixels"):
            value = (params or {}).get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                problems.append(f"{key} must be a positive integer, got {value!r}")
        for key in ("aging_factor", "aging_wait_s"):
            value = (params or {}).get(key)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
                problems.append(f"{key} must be a number >= 0, got {value!r}")
        return problems

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
        except InvalidRequestError as exc:
            self._errors.append(
                Emission(rid, error=str(exc), error_kind="invalid_request", finished=True, param=exc.param)
            )
            return
        except Exception as exc:  # noqa: BLE001
            self._errors.append(Emission(rid, error=f"{type(exc).__name__}: {exc}", finished=True))
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
