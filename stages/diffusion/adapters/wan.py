"""Wan 2.1 text-to-video adapters: UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan.

Matches diffusers' WanPipeline (same seed -> same frames):
- prompts are cleaned as WanPipeline does, encoded to `max_sequence_length` tokens, and the
  embeddings past each prompt's real length are zeroed (not masked: Wan's cross-attention
  sees the zero rows, so the sequence length is part of the denoiser bucket);
- classifier-free guidance runs uncond and cond rows in the same transformer forward;
- the VAE decodes latent frame by latent frame through its causal feature cache, exactly as
  AutoencoderKLWan._decode does, so `decode_chunks` can hand out the first frames (1 frame
  for the first latent frame, then 4 per latent frame) before the rest are decoded, and
  the concatenation equals decoding at once.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.diffusion.adapters.base import (
    DenoiserAdapter,
    DenoiseState,
    EncodedPrompts,
    GenerationParams,
    TextConditioning,
    TextEncoderAdapter,
    VaeAdapter,
)
from omnistage.stages.diffusion.limits import GenerationDefaults, ModelLimits, SizeRange

log = logging.getLogger(__name__)

DEFAULT_HEIGHT = 480
DEFAULT_WIDTH = 832
DEFAULT_FRAMES = 81
DEFAULT_STEPS = 50
DEFAULT_GUIDANCE = 5.0
DEFAULT_MAX_SEQUENCE_LENGTH = 226


def model_limits(transformer: dict[str, Any], vae: dict[str, Any]) -> ModelLimits:
    """WanTransformer3DModel's range: sizes on multiples of the VAE's spatial factor x patch,
    at most rope_max_seq_len patches per axis (its RoPE table; latent frames too), frame
    counts 4k+1 (the VAE's temporal factor). Defaults: WanPipeline's 480x832, 81 frames,
    scaled into the range when the checkpoint cannot take them."""
    temporal = int(vae.get("scale_factor_temporal") or 4)
    spatial = int(vae.get("scale_factor_spatial") or 8)
    p_t, p_h, p_w = (int(x) for x in (transformer.get("patch_size") or (1, 2, 2)))
    rope = int(transformer.get("rope_max_seq_len") or 1024)
    sizes = SizeRange(
        height_multiple=spatial * p_h,
        width_multiple=spatial * p_w,
        max_height=rope * p_h * spatial,
        max_width=rope * p_w * spatial,
        frame_step=temporal,
        max_frames=(rope * p_t - 1) * temporal + 1,
    )
    height, width = sizes.fit(DEFAULT_HEIGHT, DEFAULT_WIDTH)
    frames = sizes.fit_frames(DEFAULT_FRAMES)
    defaults = GenerationDefaults(height, width, DEFAULT_STEPS, DEFAULT_GUIDANCE, num_frames=frames)
    return ModelLimits("wan", defaults, sizes)


def clean_prompt(text: str) -> str:
    """WanPipeline's prompt cleaning (ftfy when installed, html unescape, whitespace)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(text)


def load_wan_transformer(folder, dtype: torch.dtype = torch.float32):
    """WanTransformer3DModel from a diffusers folder without `accelerate`.

    diffusers insists on low_cpu_mem_usage for models with fp32-kept modules and turns it
    off when accelerate is missing, so `from_pretrained` raises there. This builds the model
    from its config, loads the (possibly sharded) safetensors strictly, casts to `dtype` and
    keeps `_keep_in_fp32_modules` in float32 as from_pretrained would.
    """
    import json
    from pathlib import Path

    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    folder = Path(folder)
    model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["diffusion_pytorch_model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(folder / name))
    model.load_state_dict(state, strict=True)
    keep = model._keep_in_fp32_modules or []
    if dtype != torch.float32:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not any(k in name for k in keep):
                tensor.data = tensor.data.to(dtype)
    return model.eval()


def _install_loader_fallback() -> None:
    """Make WanTransformer3DModel.from_pretrained work without accelerate (see above).
    Only the ValueError diffusers raises in that case is caught; everything else is untouched."""
    from diffusers import WanTransformer3DModel

    original = WanTransformer3DModel.from_pretrained.__func__
    if getattr(original, "_omnistage_fallback", False):
        return

    def from_pretrained(cls, path, *args, **kwargs):
        try:
            return original(cls, path, *args, **kwargs)
        except ValueError as exc:
            if "low_cpu_mem_usage" not in str(exc) or kwargs.get("subfolder") or args:
                raise
            dtype = kwargs.get("torch_dtype") or kwargs.get("dtype") or torch.float32
            return load_wan_transformer(path, dtype)

    from_pretrained._omnistage_fallback = True  # type: ignore[attr-defined]
    WanTransformer3DModel.from_pretrained = classmethod(from_pretrained)


_install_loader_fallback()


class WanTextEncoder(TextEncoderAdapter):
    family = "wan"
    component_names = ("tokenizer", "text_encoder")

    def __init__(self, components: dict[str, Any], device: torch.device, dtype: torch.dtype):
        super().__init__(components, device, dtype)
        self.tokenizer = components["tokenizer"]
        self.text_encoder = components["text_encoder"]

    def default_max_sequence_length(self) -> int:
        return DEFAULT_MAX_SEQUENCE_LENGTH

    def max_allowed_sequence_length(self) -> int:
        return 512

    def uses_negative_prompt(self, params: GenerationParams) -> bool:
        guidance = DEFAULT_GUIDANCE if params.guidance_scale is None else params.guidance_scale
        return guidance > 1.0

    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int) -> EncodedPrompts:
        cleaned = [clean_prompt(p or "") for p in prompts]
        tok = self.tokenizer(
            cleaned,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        warnings = self._truncation_warnings(cleaned, max_sequence_length)
        ids = tok.input_ids.to(self.device)
        mask = tok.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state.to(self.dtype)
        # WanPipeline keeps each prompt's first seq_len rows and zero-pads the rest.
        keep = mask.gt(0).unsqueeze(-1)
        embeds = torch.where(keep, hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
        return EncodedPrompts(embeds=embeds, pooled=None, mask=None, warnings=warnings)

    def _truncation_warnings(self, prompts: list[str], max_len: int) -> list[list[str]]:
        out: list[list[str]] = []
        for text in prompts:
            ids = self.tokenizer(text, add_special_tokens=True).input_ids
            if len(ids) > max_len:
                removed = self.tokenizer.decode(ids[max_len - 1 : -1])
                out.append([f"prompt truncated to {max_len} tokens; removed: {removed!r}"])
            else:
                out.append([])
        return out


class WanDenoiser(DenoiserAdapter):
    family = "wan"
    component_names = ("transformer", "scheduler")

    def __init__(self, components: dict[str, Any], device: torch.device, dtype: torch.dtype):
        super().__init__(components, device, dtype)
        # the VAE's scale factors, from the loaded VAE or just its config.json (WanPipeline's
        # defaults when neither is there)
        if components.get("vae") is not None:
            vae_cfg = dict(components["vae"].config)
        else:
            vae_cfg = dict(components.get("vae_config") or {})
        self.scale_temporal = int(vae_cfg.get("scale_factor_temporal") or 4)
        self.scale_spatial = int(vae_cfg.get("scale_factor_spatial") or 8)
        cfg = self.transformer.config
        self.patch = tuple(cfg.patch_size)
        self.in_channels = int(cfg.in_channels)
        self.limits = model_limits(dict(cfg), vae_cfg)

    def prepare(self, request_id: str, params: GenerationParams, text: TextConditioning) -> DenoiseState:
        settings = self.limits.resolve(params)
        height, width, frames = settings.height, settings.width, settings.num_frames
        steps = settings.num_inference_steps
        guidance = settings.guidance_scale
        do_cfg = guidance > 1.0
        if do_cfg and not text.has_negative:
            raise InvalidRequestError("guidance_scale > 1 needs the negative prompt encoding (row 1)")
        n = params.num_images_per_prompt
        generator = self.make_generator(params)
        latent_frames = (frames - 1) // self.scale_temporal + 1
        shape = (n, self.in_channels, latent_frames, height // self.scale_spatial, width // self.scale_spatial)
        # WanPipeline draws latents in float32 whatever the transformer dtype is.
        latents = torch.randn(shape, generator=generator, device="cpu", dtype=torch.float32).to(self.device)
        scheduler = self.new_scheduler(steps)
        pos = text.embeds[:1].to(self.device, self.dtype).expand(n, -1, -1)
        if do_cfg:
            neg = text.embeds[1:2].to(self.device, self.dtype).expand(n, -1, -1)
            context = torch.cat([neg, pos])  # rows: [uncond x n, cond x n], as guide() expects
        else:
            context = pos
        seq_len = int(text.embeds.shape[1])
        tokens = latent_frames * (shape[3] // self.patch[1]) * (shape[4] // self.patch[2])
        return DenoiseState(
            request_id=request_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            generator=generator,
            bucket=("wan", shape[1:], seq_len),
            rows=context.shape[0],
            tokens_per_row=tokens,
            row_inputs={"encoder_hidden_states": context.contiguous()},
            guidance=guidance,
            do_cfg=do_cfg,
        )

    def model_forward(self, states: list[DenoiseState]) -> torch.Tensor:
        dtype = self.transformer.dtype
        hidden, times, context = [], [], []
        for s in states:
            reps = 2 if s.do_cfg else 1
            lat = s.latents.to(dtype)
            hidden.append(lat.repeat(reps, 1, 1, 1, 1) if reps > 1 else lat)
            times.append(s.timestep.reshape(1).expand(s.rows))
            context.append(s.row_inputs["encoder_hidden_states"])
        return self.transformer(
            hidden_states=torch.cat(hidden),
            timestep=torch.cat(times).to(self.device),
            encoder_hidden_states=torch.cat(context).to(dtype),
            return_dict=False,
        )[0]

    def step(self, state: DenoiseState, model_output: torch.Tensor) -> None:
        # Real Wan 2.1 checkpoints ship UniPCMultistepScheduler, whose step() takes no
        # generator; its multistep history lives in the request's own scheduler copy.
        if self._step_takes_generator(state.scheduler):
            return super().step(state, model_output)
        state.latents = state.scheduler.step(model_output, state.timestep, state.latents, return_dict=False)[0]
        state.step_index += 1

    @staticmethod
    def _step_takes_generator(scheduler) -> bool:
        import inspect

        cls = type(scheduler)
        cached = getattr(cls, "_omnistage_step_takes_generator", None)
        if cached is None:
            cached = "generator" in inspect.signature(cls.step).parameters
            cls._omnistage_step_takes_generator = cached
        return cached

    def finish(self, state: DenoiseState) -> torch.Tensor:
        return state.latents


class WanVae(VaeAdapter):
    """AutoencoderKLWan decode. options: `chunk_latent_frames` (latent frames per streamed
    chunk, default 1), `tiling` (bool, spatial tiling for large frames: then the whole video
    decodes through diffusers' tiled path and is handed out in frame chunks afterwards)."""

    family = "wan"
    component_names = ("vae",)
    output_port = "video"

    def __init__(self, components: dict[str, Any], device: torch.device, dtype: torch.dtype, options: dict[str, Any]):
        super().__init__(components, device, dtype, options)
        cfg = self.vae.config
        self.latents_mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        self.latents_inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        self.chunk_latent_frames = max(1, int(options.get("chunk_latent_frames", 1)))
        if options.get("tiling"):
            tile = options.get("tile_sample_size")
            stride = options.get("tile_sample_stride")
            self.vae.enable_tiling(
                tile_sample_min_height=tile,
                tile_sample_min_width=tile,
                tile_sample_stride_height=stride,
                tile_sample_stride_width=stride,
            )

    def batch_key(self, latents: torch.Tensor, params: GenerationParams) -> Hashable | None:
        return None  # videos decode alone, in temporal chunks

    def _unscale(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(self.device, self.vae.dtype)
        mean = self.latents_mean.to(z.device, z.dtype)
        inv_std = self.latents_inv_std.to(z.device, z.dtype)
        return z / inv_std + mean  # the same two ops as WanPipeline

    @staticmethod
    def _to_pixels(video: torch.Tensor) -> torch.Tensor:
        """[n, 3, F, H, W] in [-1, 1] -> [n, F, H, W, 3] in [0, 1] (VideoProcessor's denormalize)."""
        return (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float()

    def _uses_tiling(self, z: torch.Tensor) -> bool:
        vae = self.vae
        if not vae.use_tiling:
            return False
        ratio = vae.spatial_compression_ratio
        return z.shape[-1] > vae.tile_sample_min_width // ratio or z.shape[-2] > vae.tile_sample_min_height // ratio

    @torch.no_grad()
    def decode_batch(self, latents: torch.Tensor) -> torch.Tensor:
        video = self.vae.decode(self._unscale(latents), return_dict=False)[0]
        return self._to_pixels(video)

    @torch.no_grad()
    def decode_chunks(self, latents: torch.Tensor, params: GenerationParams) -> Iterator[torch.Tensor]:
        """One request's video. n == 1: frames along dim 0, [f, H, W, 3] per chunk, the first
        chunk ready after the first latent frame decodes. n > 1: one [n, F, H, W, 3] piece
        (frames are not the first axis then, so the chunks are joined before they leave)."""
        z = self._unscale(latents)
        if self._uses_tiling(z):
            chunks = iter([self.vae.decode(z, return_dict=False)[0]])
        else:
            chunks = decode_wan_temporal_chunks(self.vae, z, self.chunk_latent_frames)
        if z.shape[0] > 1:
            yield self._to_pixels(torch.cat(list(chunks), dim=2))
            return
        for video in chunks:
            yield self._to_pixels(video)[0]


@torch.no_grad()
def decode_wan_temporal_chunks(vae, z: torch.Tensor, latent_frames_per_chunk: int = 1) -> Iterator[torch.Tensor]:
    """Decode un-scaled Wan latents [n, C, F, h, w] in temporal chunks, yielding [n, 3, f, H, W]
    clamped to [-1, 1].

    Runs the decoder one latent frame at a time through a causal feature cache, the same
    calls AutoencoderKLWan._decode makes, so the concatenated chunks equal `vae.decode`. The
    cache belongs to this generator (not to the VAE object), so several videos can decode
    interleaved, one chunk each per VAE stage step.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify

    counts = getattr(vae, "_cached_conv_counts", None) or {}
    num_convs = counts.get("decoder") or sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
    feat_map: list = [None] * num_convs
    num_frames = z.shape[2]
    x = vae.post_quant_conv(z)
    pending: list[torch.Tensor] = []
    for i in range(num_frames):
        conv_idx = [0]
        out = vae.decoder(x[:, :, i : i + 1], feat_cache=feat_map, feat_idx=conv_idx, first_chunk=(i == 0))
        pending.append(out)
        if len(pending) == latent_frames_per_chunk or i == num_frames - 1:
            chunk = torch.cat(pending, dim=2)
            pending = []
            if vae.config.patch_size is not None:
                chunk = unpatchify(chunk, patch_size=vae.config.patch_size)
            yield torch.clamp(chunk, min=-1.0, max=1.0)


TEXT_ENCODER = WanTextEncoder
DENOISER = WanDenoiser
VAE = WanVae
