"""The adapter interface between the generic diffusion stages and one model family.

The three diffusion stages (text_encoder, denoiser, vae_decoder) and the step engine know
nothing about SD3, FLUX or Wan. Everything family-specific sits behind three small adapter
classes, one per stage, registered per family in `adapters/__init__.py`:

- TextEncoderAdapter.encode(prompts, max_sequence_length) -> EncodedPrompts, batched over
  every prompt (positive and negative) of every request in a text-encoder step.
- DenoiserAdapter: turns one request (GenerationParams + TextConditioning) into a DenoiseState
  (its own latents, generator, scheduler copy and per-row conditioning), runs ONE transformer
  forward for a list of states that share a bucket, and hands back VAE-layout latents.
- VaeAdapter: latents -> pixels ([n, H, W, 3] images or [n, F, H, W, 3] video), optionally in
  chunks along the first output axis (video frames) so the first chunk leaves early.

Data crossing stage boundaries (see docs/diffusion.md):
  text_encoder -> denoiser: `prompt_embeds` [R, S, D] and `pooled_prompt_embeds` [R, P]
      (optional), plus `prompt_mask` [R, S] for families that use one; R = 1 (prompt) or
      2 (prompt, negative prompt) - row 0 is always the prompt. One row per PROMPT: the
      denoiser repeats it num_images_per_prompt times, as diffusers does.
  denoiser -> vae_decoder: `latents` in the VAE's layout ([n, C, h, w] or [n, C, f, h, w]),
      not yet un-scaled (the VAE adapter applies scaling/shift factors from its own config).
Every stage receives the same per-request generation params (GENERATION_PARAMS) under its
own stage name and reads what it needs; unknown keys are refused.
"""

from __future__ import annotations

import random
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from omnistage.errors import InvalidRequestError
from omnistage.kernels import triton as triton_kernels
from omnistage.stages.params import MAX_SEED, MIN_SEED, Param, ParamSet


class ComponentLoading:
    """Hook shared by the three adapter kinds: load a component the generic way or not."""

    # components that may be missing (model_index.json null or folder absent)
    optional_components: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def load_override(cls, name: str, folder: Any, dtype: torch.dtype) -> Any | None:
        """Return the loaded component to bypass loading.load_component (e.g. a model that
        needs special handling), or None to use the generic from_pretrained path."""
        return None


# -- parameters -------------------------------------------------------------------------------

OUTPUT_TYPES = ("uint8", "float")
MAX_PARTIAL_IMAGES = 8

# Per-request generation params: every diffusion stage (text_encoder, denoiser, vae_decoder)
# accepts the same set under its own stage name and reads what it needs. None = the family's
# default, resolved by the adapter.
GENERATION_PARAMS = ParamSet(
    "diffusion request",
    (
        Param("prompt", "string", "", "The prompt (the text_encoder takes it from its input port)."),
        Param("negative_prompt", "string", None, "Negative prompt for classifier-free guidance.", nullable=True),
        Param("width", "integer", None, "Output width in pixels; default: the family's.", minimum=1, nullable=True),
        Param("height", "integer", None, "Output height in pixels; default: the family's.", minimum=1, nullable=True),
        Param("num_frames", "integer", None, "Video frames; default: the family's.", minimum=1, nullable=True),
        Param(
            "num_inference_steps", "integer", None, "Sampler steps; default: the family's.", minimum=1, nullable=True
        ),
        Param(
            "guidance_scale",
            "number",
            None,
            "Classifier-free guidance scale; default: the family's.",
            minimum=0,
            nullable=True,
        ),
        Param(
            "true_cfg_scale", "number", None, "True CFG scale (FLUX with a negative prompt).", minimum=0, nullable=True
        ),
        Param(
            "seed",
            "integer",
            None,
            "Seed of this request's own generator; default: a fresh one.",
            minimum=MIN_SEED,
            maximum=MAX_SEED,
            nullable=True,
        ),
        Param("num_images_per_prompt", "integer", 1, "Samples per prompt.", minimum=1),
        Param(
            "max_sequence_length",
            "integer",
            None,
            "Text tokens per prompt; default: the family's.",
            minimum=1,
            nullable=True,
        ),
        Param(
            "output_type",
            "string",
            "uint8",
            "uint8 pixels in [0, 255] or float pixels in [0, 1].",
            choices=OUTPUT_TYPES,
        ),
        Param(
            "strength",
            "number",
            None,
            "Image-to-image (an `image` input given): how far the image is noised, 0-1; default 0.6.",
            minimum=0,
            maximum=1,
            nullable=True,
        ),
        Param(
            "partial_images",
            "integer",
            0,
            "Previews decoded from the denoiser's estimate at evenly spaced steps (its `preview` port).",
            minimum=0,
            maximum=MAX_PARTIAL_IMAGES,
        ),
    ),
)

# Stage params every diffusion stage kind takes (how its components load).
LOADING_PARAMS = (
    Param(
        "family", "string", None, "Model family (sd3, flux, wan); default: detected from the checkpoint.", nullable=True
    ),
    Param("components", "mapping", None, "Component name -> local folder overriding the checkpoint's.", nullable=True),
)


@dataclass
class GenerationParams:
    """One request's generation parameters (GENERATION_PARAMS), named as the diffusers
    pipelines name them. None means "the family's default" (resolved by the adapter).
    `output_type`: "uint8" (default, [0,255] pixels) or "float" ([0,1] float32 pixels, what
    diffusers' "np" gives)."""

    prompt: str = ""
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None
    num_images_per_prompt: int = 1
    max_sequence_length: int | None = None
    output_type: str = "uint8"
    strength: float | None = None
    partial_images: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> GenerationParams:
        """Check against GENERATION_PARAMS (unknown keys are refused); raise InvalidRequestError."""
        return cls(**GENERATION_PARAMS.validate(raw))

    def resolved_seed(self) -> int:
        """The seed this request draws its latents with (a fresh one when none was given)."""
        if self.seed is None:
            self.seed = random.randrange(2**63)
        return self.seed


# -- text encoder -----------------------------------------------------------------------------


@dataclass
class EncodedPrompts:
    """Output of TextEncoderAdapter.encode for a list of prompts, row i = prompt i."""

    embeds: torch.Tensor  # [B, S, D]
    pooled: torch.Tensor | None = None  # [B, P]
    mask: torch.Tensor | None = None  # [B, S]
    warnings: list[list[str]] = field(default_factory=list)  # per prompt (truncation notices)


class TextEncoderAdapter(ComponentLoading):
    """Encodes prompts for one family. Rows must not depend on their batch mates."""

    family: ClassVar[str] = ""

    def __init__(self, components: dict[str, Any], device: torch.device, dtype: torch.dtype):
        self.components = components
        self.device = device
        self.dtype = dtype

    # component names (keys of model_index.json) this adapter loads
    component_names: ClassVar[tuple[str, ...]] = ()

    def default_max_sequence_length(self) -> int:
        raise NotImplementedError

    def max_allowed_sequence_length(self) -> int:
        return 512

    def uses_negative_prompt(self, params: GenerationParams) -> bool:
        """Whether this request needs the negative prompt encoded (row 1)."""
        raise NotImplementedError

    def encode(self, prompts: list[str], max_sequence_length: int) -> EncodedPrompts:
        raise NotImplementedError


# -- denoiser ---------------------------------------------------------------------------------


@dataclass
class TextConditioning:
    """What the denoiser receives from the text encoder for one request (rows: prompt[, negative])."""

    embeds: torch.Tensor  # [R, S, D]
    pooled: torch.Tensor | None = None  # [R, P]
    mask: torch.Tensor | None = None  # [R, S]

    @property
    def has_negative(self) -> bool:
        return self.embeds.shape[0] > 1


@dataclass
class DenoiseState:
    """One request inside the step engine: everything it needs between steps.

    `rows` is how many samples this request adds to a transformer forward
    (num_images * 2 with classifier-free guidance in the same forward, else num_images);
    `row_inputs` holds tensors with `rows` leading rows that the adapter concatenates across
    the batch; `shared` holds tensors that every member of the bucket has identical (rope ids).
    """

    request_id: str
    params: GenerationParams
    latents: torch.Tensor  # [n, ...] in the transformer's layout (packed for FLUX)
    scheduler: Any  # this request's own scheduler copy (timesteps set, step index advancing)
    timesteps: torch.Tensor  # [T]
    generator: torch.Generator
    bucket: Hashable  # requests with equal buckets can share one forward
    rows: int
    tokens_per_row: int  # latent tokens per row (for max_latent_tokens budgets)
    row_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    guidance: float = 1.0  # CFG scale applied when do_cfg
    do_cfg: bool = False
    step_index: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_step_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # adapter-private

    @property
    def total_steps(self) -> int:
        return int(self.timesteps.shape[0])

    @property
    def done(self) -> bool:
        return self.step_index >= self.total_steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.step_index]

    @property
    def cost(self) -> int:
        return self.rows * self.tokens_per_row


class DenoiserAdapter(ComponentLoading):
    """One family's denoising: request preparation, one batched forward, scheduler step.

    Subclasses implement `prepare`, `model_forward` and `finish`; `forward` and `step` are
    shared. Contract the step engine relies on: a state's result never depends on which other
    states share its forward (each owns its generator and scheduler), and states with equal
    `bucket` can always be passed to one `forward` call together.
    """

    family: ClassVar[str] = ""
    component_names: ClassVar[tuple[str, ...]] = ("transformer", "scheduler", "vae")
    # families whose prepare() takes an init image (img2img) and which decode previews
    # (`estimate` and `decode_preview`, steps listed in state.extra["preview_steps"])
    image_input: ClassVar[bool] = False
    previews: ClassVar[bool] = False

    def __init__(self, components: dict[str, Any], device: torch.device, dtype: torch.dtype):
        self.components = components
        self.device = device
        self.dtype = dtype
        self.transformer = components["transformer"]
        self.scheduler_template = components["scheduler"]
        if triton_kernels.selected(device):  # on CUDA by default; OMNISTAGE_TRITON=0 keeps diffusers'
            from omnistage.stages.diffusion.fused_norms import fuse_adaln

            fuse_adaln(self.transformer)

    # -- per request ----------------------------------------------------------------------
    def prepare(self, request_id: str, params: GenerationParams, text: TextConditioning) -> DenoiseState:
        """Validate family rules (raise InvalidRequestError), draw latents with the request's
        own generator, give it its own scheduler with timesteps set."""
        raise NotImplementedError

    def finish(self, state: DenoiseState) -> torch.Tensor:
        """Final latents in the VAE's layout."""
        raise NotImplementedError

    # -- per step -------------------------------------------------------------------------
    def model_forward(self, states: list[DenoiseState]) -> torch.Tensor:
        """ONE transformer call over all rows of `states` (same bucket), per-row timesteps.
        Returns the raw model output with sum(state.rows) rows, in state order."""
        raise NotImplementedError

    def batched_rows(self, states: list[DenoiseState]) -> dict[str, torch.Tensor]:
        """`row_inputs` of `states` concatenated in state order. The last result per bucket
        is cached: between joins and leaves a bucket's batch is the same requests step after
        step, and re-concatenating large text conditioning every step is pure overhead."""
        ids = tuple(s.request_id for s in states)
        cache = self.__dict__.setdefault("_row_cache", {})
        hit = cache.get(states[0].bucket)
        if hit is not None and hit[0] == ids:
            return hit[1]
        keys = states[0].row_inputs.keys()
        rows = {k: torch.cat([s.row_inputs[k] for s in states]) for k in keys}
        cache[states[0].bucket] = (ids, rows)
        return rows

    def forget(self, request_id: str) -> None:
        """A request left the engine: drop cached batches that hold its rows."""
        cache = self.__dict__.get("_row_cache", {})
        for bucket, (ids, _) in list(cache.items()):
            if request_id in ids:
                del cache[bucket]

    @torch.no_grad()
    def forward(self, states: list[DenoiseState]) -> list[torch.Tensor]:
        """Guided model output per state, shaped like state.latents."""
        out = self.model_forward(states)
        results: list[torch.Tensor] = []
        offset = 0
        for s in states:
            part = out[offset : offset + s.rows]
            offset += s.rows
            results.append(self.guide(s, part))
        return results

    def guide(self, state: DenoiseState, out: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance: rows are [uncond x n, cond x n] when state.do_cfg."""
        if not state.do_cfg:
            return out
        uncond, cond = out.chunk(2)
        return uncond + state.guidance * (cond - uncond)

    def step(self, state: DenoiseState, model_output: torch.Tensor) -> None:
        """Advance one request by one sampler step with its own scheduler."""
        if state.step_index in state.extra.get("preview_steps", ()):
            state.extra["preview"] = self.estimate(state, model_output)
        kwargs = {"generator": state.generator} if _step_takes_generator(state.scheduler) else {}
        state.latents = state.scheduler.step(model_output, state.timestep, state.latents, return_dict=False, **kwargs)[
            0
        ]
        state.step_index += 1

    def estimate(self, state: DenoiseState, model_output: torch.Tensor) -> torch.Tensor:
        """The clean latents the sampler expects, before this step (for previews)."""
        raise NotImplementedError

    def decode_preview(self, latents: torch.Tensor) -> torch.Tensor:
        """`estimate`'s latents as uint8 pixels [n, H, W, 3]."""
        raise NotImplementedError

    # -- helpers for subclasses -----------------------------------------------------------
    def new_scheduler(self, num_inference_steps: int, **set_timesteps_kwargs: Any):
        """A private scheduler copy with its timesteps set (device: where latents live)."""
        sched = type(self.scheduler_template).from_config(self.scheduler_template.config)
        sched.set_timesteps(num_inference_steps, device=self.device, **set_timesteps_kwargs)
        if hasattr(sched, "set_begin_index"):
            sched.set_begin_index(0)
        return sched

    @staticmethod
    def check_size(height: int, width: int, multiple: int) -> None:
        """Sizes must be multiples of the VAE factor x patch size (diffusers' check_inputs)."""
        if height % multiple or width % multiple:
            raise InvalidRequestError(
                f"height and width must be multiples of {multiple} (VAE factor x patch size), got "
                f"{height}x{width}; e.g. {height - height % multiple or multiple}x{width - width % multiple or multiple}",
                param="height" if height % multiple else "width",
            )

    def draw_latents(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """As diffusers' randn_tensor with a CPU generator: drawn on the CPU, then moved."""
        return torch.randn(shape, generator=generator, device="cpu", dtype=self.dtype).to(self.device)

    @staticmethod
    def make_generator(params: GenerationParams) -> torch.Generator:
        return torch.Generator("cpu").manual_seed(params.resolved_seed())


def _step_takes_generator(scheduler: Any) -> bool:
    """Stochastic schedulers draw noise from the request's generator; others take none."""
    import inspect

    cls = type(scheduler)
    cached = cls.__dict__.get("_omnistage_step_takes_generator")
    if cached is None:
        cached = "generator" in inspect.signature(cls.step).parameters
        cls._omnistage_step_takes_generator = cached
    return cached


# -- VAE --------------------------------------------------------------------------------------


class VaeAdapter(ComponentLoading):
    """Latents -> pixels for one family.

    `decode_batch` decodes latents of several requests stacked along dim 0 (same shape) and
    returns float pixels in [0, 1], channels last. `decode_chunks` may instead yield one
    request's output in pieces along its first output axis (frames), for streaming video;
    the default yields everything at once.
    """

    family: ClassVar[str] = ""
    component_names: ClassVar[tuple[str, ...]] = ("vae",)
    output_port: ClassVar[str] = "image"

    def __init__(self, components: dict[str, Any], device: torch.device, dtype: torch.dtype, options: dict[str, Any]):
        self.components = components
        self.device = device
        self.dtype = dtype
        self.options = options  # stage params (tiling, chunking knobs)
        self.vae = components["vae"]

    def batch_key(self, latents: torch.Tensor, params: GenerationParams) -> Hashable | None:
        """Requests with equal non-None keys decode in one batched call; None = alone, chunked."""
        return tuple(latents.shape[1:])

    def decode_batch(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode_chunks(self, latents: torch.Tensor, params: GenerationParams) -> Iterator[torch.Tensor]:
        yield self.decode_batch(latents)


def to_output(pixels: torch.Tensor, output_type: str) -> torch.Tensor:
    """[0,1] float pixels -> the requested output type (uint8 rounds as diffusers' numpy_to_pil)."""
    if output_type == "float":
        return pixels.float().cpu().contiguous()
    return (pixels.float() * 255).round().clamp(0, 255).to(torch.uint8).cpu().contiguous()
