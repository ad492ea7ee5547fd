"""A tiny standalone token2wav checkpoint for the token2wav tests.

The real DiT structure (22 layers, block 24, look-ahead [10], look-back [0, 20], repeats 2) at
a toy width and BigVGAN with the real upsample rates, re-drawn with torch's default init (the
model's small default init leaves the waveform near 1e-7, which would hide bugs), saved with
save_pretrained, plus a spk_dict.pt whose two voices have reference mels of different lengths.
"""

from __future__ import annotations

from pathlib import Path

import torch

CODEC_VOCAB = 160
VOICES = ("Chelsie", "Ethan")


def token2wav_config():
    from transformers import Qwen2_5OmniToken2WavConfig

    dit = dict(
        hidden_size=32, num_hidden_layers=22, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
        num_embeds=CODEC_VOCAB, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48],
        enc_attention_channels=8, enc_se_channels=8, dropout=0.0,
    )  # fmt: skip
    return Qwen2_5OmniToken2WavConfig(dit_config=dit, bigvgan_config=dict(upsample_initial_channel=128))


def build_token2wav_checkpoint(out_dir: Path, seed: int = 7) -> Path:
    from transformers import Qwen2_5OmniToken2WavModel

    config = token2wav_config()
    torch.manual_seed(seed)
    model = Qwen2_5OmniToken2WavModel(config).eval()
    for sub in model.modules():
        if sub is not model and hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    model.save_pretrained(str(out_dir))
    g = torch.Generator().manual_seed(seed + 1)
    dit = config.dit_config
    voices = {
        name: {
            "bos_token": 100 + i,
            "cond": torch.randn(1, dit.enc_emb_dim, generator=g),
            "ref_mel": torch.randn(1, 60 + 17 * i, dit.mel_dim, generator=g),
        }
        for i, name in enumerate(VOICES)
    }
    torch.save(voices, Path(out_dir) / "spk_dict.pt")
    return Path(out_dir)


def make_stage(model_path, params=None, max_batch_size: int = 8, prefix: str | None = None):
    from omnistage.bench.omni_token2wav import build_stage

    return build_stage(model_path, max_batch_size, params, prefix)


def decode(stage, requests: dict[str, tuple[list[int], dict]], chunk: int | None = None, max_steps: int = 10_000):
    """Run requests {id: (codes, params)} through the engine protocol, feeding each request's
    codes `chunk` at a time between steps (None: all at once). Returns {id: audio} and
    {id: (error_kind, message)}; audio chunks are checked to be 1-D float32."""
    from omnistage.stages.base import StageRequest

    fed = {}
    for rid, (_, params) in requests.items():
        stage.add(StageRequest(rid, inputs={}, params=params))
        fed[rid] = 0
    audio: dict[str, list[torch.Tensor]] = {rid: [] for rid in requests}
    errors: dict[str, tuple[str, str]] = {}
    finished: set[str] = set()
    for _ in range(max_steps):
        for rid, (codes, _) in requests.items():
            if fed[rid] < len(codes) or fed[rid] == 0:
                n = len(codes) if chunk is None else chunk
                piece = codes[fed[rid] : fed[rid] + n]
                fed[rid] += max(len(piece), 1)
                stage.feed(rid, "codes", piece, last=fed[rid] >= len(codes))
        for em in stage.step():
            if em.error is not None:
                errors[em.request_id] = (em.error_kind, em.error)
                finished.add(em.request_id)
                continue
            if "audio" in em.outputs:
                piece = em.outputs["audio"]
                assert piece.dtype == torch.float32 and piece.ndim == 1
                audio[em.request_id].append(piece)
            if em.finished:
                finished.add(em.request_id)
        if finished >= set(requests):
            break
    else:
        raise AssertionError(f"requests {set(requests) - finished} did not finish")
    return {rid: torch.cat(pieces) if pieces else torch.zeros(0) for rid, pieces in audio.items()}, errors


def snr_db(signal: torch.Tensor, reference: torch.Tensor) -> float:
    err = ((signal.double() - reference.double()) ** 2).sum()
    return float(10 * torch.log10((reference.double() ** 2).sum() / err.clamp_min(1e-300)))
