"""Qwen2.5-Omni token2wav networks, loaded by prefix, driven window by window.

The network modules are transformers' own (`Qwen2_5OmniToken2WavDiTModel`,
`Qwen2_5OmniToken2WavBigVGANModel`); this module composes their parts so that one forward
carries several windows of different requests: each window has its own codes, noise slice,
voice and length, and the windows lie end to end, attention (the DiT's only op that mixes
positions) running per window. The ODE (fixed-grid RK4 with the
model's sway-shifted time grid and classifier-free guidance) is run here, as the model
defines it, so a window's mel depends only on its own codes and noise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from omnistage.stages.ar.loader import checkpoint_files
from omnistage.stages.omni.token2wav_dit import PackedDiT
from omnistage.stages.omni.token2wav_vocoder import PackedBigVGAN

SAMPLE_RATE = 24_000


@dataclass(frozen=True)
class Voice:
    """One speaker of spk_dict.pt, with its speaker-encoder outputs computed once."""

    name: str
    cond: torch.Tensor  # [enc_emb_dim] x-vector the DiT reads at every frame
    ref_mel: torch.Tensor  # [T, mel_dim] reference mel
    spk_vec: torch.Tensor  # [enc_dim] ECAPA(ref_mel)
    null_spk_vec: torch.Tensor  # [enc_dim] ECAPA(zeros): the unconditioned half of guidance


@dataclass(frozen=True)
class OdeSettings:
    """How the flow-matching ODE is integrated (the model's defaults)."""

    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0


@dataclass
class DitWindow:
    """A block-aligned span of one request to decode: its codes and their noise rows."""

    codes: torch.Tensor  # [n] int64
    noise: torch.Tensor  # [repeats * n, mel_dim] float32
    voice: Voice


def time_grid(settings: OdeSettings, device: torch.device) -> torch.Tensor:
    t = torch.linspace(0, 1, settings.num_steps, device=device, dtype=torch.float32)
    if settings.sway_coefficient is not None:
        t += settings.sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


def rk4_solve(velocity, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Integrate dx/dt = velocity(t, x) over `grid` with the 3/8-rule RK4 step the model uses
    (four evaluations per interval, same arithmetic order)."""
    third, two_thirds = 1 / 3, 2 / 3
    for t0, t1 in zip(grid[:-1], grid[1:]):
        dt = t1 - t0
        k1 = velocity(t0, x)
        k2 = velocity(t0 + dt * third, x + dt * k1 * third)
        k3 = velocity(t0 + dt * two_thirds, x + dt * (k2 - k1 * third))
        k4 = velocity(t1, x + dt * (k1 - k2 + k3))
        x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
    return x


class Token2WavNet:
    """The DiT and BigVGAN of one checkpoint, with its voices, on one device (float32)."""

    def __init__(self, dit, bigvgan, voices: dict[str, dict[str, torch.Tensor]], device: torch.device):
        self.dit = dit.to(device=device, dtype=torch.float32).eval()
        self.bigvgan = bigvgan.to(device=device, dtype=torch.float32).eval()
        self.packed_dit = PackedDiT(self.dit, device)
        self.packed_bigvgan = PackedBigVGAN(self.bigvgan, device)
        self.device = device
        cfg = dit.config
        self.block_frames = int(cfg.block_size)
        self.repeats = int(cfg.repeats)
        self.mel_dim = int(cfg.mel_dim)
        self.num_codes = int(cfg.num_embeds)  # valid code ids: 0 .. num_embeds - 1
        self.max_frames = int(cfg.max_position_embeddings)
        self.samples_per_frame = math.prod(bigvgan.config.upsample_rates)
        self.voices = {name: self._voice(name, entry) for name, entry in voices.items()}

    @torch.inference_mode()
    def _voice(self, name: str, entry: dict[str, torch.Tensor]) -> Voice:
        ref_mel = entry["ref_mel"].to(self.device, torch.float32).reshape(1, -1, self.mel_dim)
        encoder = self.dit.input_embed.spk_encoder
        return Voice(
            name=name,
            cond=entry["cond"].to(self.device, torch.float32).reshape(-1),
            ref_mel=ref_mel[0],
            spk_vec=encoder(ref_mel)[0],
            null_spk_vec=encoder(torch.zeros_like(ref_mel))[0],
        )

    # -- DiT ------------------------------------------------------------------------------
    def _conditioning(self, windows: list[DitWindow], cfg: bool) -> dict[str, torch.Tensor]:
        """Per-frame inputs that stay fixed along the ODE, the windows' frames end to end:
        [frames] rows, or [2 * frames] with guidance (conditioned rows first, then the
        unconditioned ones)."""
        dev = self.device
        codes = torch.cat([w.codes.to(dev) for w in windows])[None]
        lengths = torch.tensor([w.noise.shape[0] for w in windows], device=dev)
        embed = self.dit.text_embed
        code_embed = embed(codes)[0]
        spk = torch.repeat_interleave(torch.stack([w.voice.cond for w in windows]), lengths, dim=0)
        vec = torch.repeat_interleave(torch.stack([w.voice.spk_vec for w in windows]), lengths, dim=0)
        if cfg:
            code_embed = torch.cat([code_embed, embed(codes, drop_code=True)[0]])
            spk = torch.cat([spk, torch.zeros_like(spk)])
            null = torch.stack([w.voice.null_spk_vec for w in windows])
            vec = torch.cat([vec, torch.repeat_interleave(null, lengths, dim=0)])
        return {"code_embed": code_embed, "speaker": spk, "spk_vec": vec}

    @torch.inference_mode()
    def sample_mels(self, windows: list[DitWindow], settings: OdeSettings) -> list[torch.Tensor]:
        """Solve the ODE for a batch of windows in shared forwards, laid end to end (no
        padding); each window's mel [frames, mel_dim] (on the device)."""
        lengths = [w.noise.shape[0] for w in windows]
        if max(lengths) > self.max_frames:
            raise ValueError(f"a window of {max(lengths)} mel frames exceeds the DiT's {self.max_frames}")
        guided = settings.guidance_scale >= 1e-5
        inputs = self.packed_dit.prepare(self._conditioning(windows, guided), lengths, guided)
        x = torch.cat([w.noise.to(self.device) for w in windows])
        scale = settings.guidance_scale

        def velocity(t, state):
            out = self.packed_dit.forward(state, t, inputs)
            if not guided:
                return out
            conditioned, null = torch.chunk(out, 2, dim=0)
            return conditioned + (conditioned - null) * scale

        mel = rk4_solve(velocity, x, time_grid(settings, self.device))
        return list(torch.split(mel, lengths))

    # -- BigVGAN --------------------------------------------------------------------------
    @torch.inference_mode()
    def vocode(self, mels: list[torch.Tensor]) -> torch.Tensor:
        """Waveforms [b, frames * samples_per_frame] (CPU) of equally long mel windows."""
        batch = torch.stack(mels).transpose(1, 2)  # [b, mel_dim, frames]
        return self.packed_bigvgan(batch).cpu()


# -- loading ------------------------------------------------------------------------------
def token2wav_config(model_path: str):
    """(Qwen2_5OmniToken2WavConfig, default weight prefix) of a full Qwen2.5-Omni directory
    ("token2wav.") or of a standalone token2wav one ("")."""
    from transformers import Qwen2_5OmniToken2WavConfig

    raw = json.loads((Path(model_path) / "config.json").read_text())
    if "token2wav_config" in raw:
        return Qwen2_5OmniToken2WavConfig(**raw["token2wav_config"]), "token2wav."
    if "dit_config" in raw:
        return Qwen2_5OmniToken2WavConfig(**{k: raw[k] for k in ("dit_config", "bigvgan_config") if k in raw}), ""
    raise ValueError(f"{model_path}/config.json holds no token2wav config (token2wav_config or dit_config)")


def _prefixed_state(model_path: str, prefix: str) -> dict[str, torch.Tensor]:
    state = {}
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = f.get_tensor(key)
    return state


def load_voices(model_path: str, voices_file: str | None = None) -> dict[str, dict[str, torch.Tensor]]:
    path = Path(voices_file) if voices_file else Path(model_path) / "spk_dict.pt"
    if not path.exists():
        raise FileNotFoundError(f"no voices: {path} does not exist")
    voices = torch.load(path, map_location="cpu", weights_only=True)
    bad = [name for name, v in voices.items() if not {"cond", "ref_mel"} <= set(v)]
    if bad or not voices:
        raise ValueError(f"{path}: every voice needs 'cond' and 'ref_mel' (bad: {bad or 'no voices'})")
    return voices


def load_token2wav(
    model_path: str,
    device: torch.device,
    weight_prefix: str | None = None,
    voices_file: str | None = None,
) -> Token2WavNet:
    """Build the DiT and BigVGAN from `model_path` and fill them from the tensors named
    `<prefix>code2wav_dit_model.*` / `<prefix>code2wav_bigvgan_model.*` (strict)."""
    from transformers import Qwen2_5OmniToken2WavModel

    config, default_prefix = token2wav_config(model_path)
    prefix = default_prefix if weight_prefix is None else weight_prefix
    config._attn_implementation = "sdpa"
    model = Qwen2_5OmniToken2WavModel(config)
    state = _prefixed_state(model_path, prefix)
    if not state:
        raise ValueError(f"checkpoint {model_path} has no tensors under the prefix {prefix!r}")
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys:
        raise ValueError(
            f"checkpoint {model_path} (prefix {prefix!r}) lacks {len(result.missing_keys)} token2wav weights, "
            f"e.g. {result.missing_keys[:3]}"
        )
    return Token2WavNet(
        model.code2wav_dit_model, model.code2wav_bigvgan_model, load_voices(model_path, voices_file), device
    )
