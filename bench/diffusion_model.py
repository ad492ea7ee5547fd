"""The fixed diffusion benchmark model: an SD3-architecture pipeline in diffusers layout.

The denoiser is fixed by the benchmark definition (nobody tunes it); text encoders and VAE
are tiny. Built with a fixed seed into the omnistage cache on first use and loaded back with
plain diffusers/transformers calls, so the baselines run the stock diffusers pipeline.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.models.unigram_tokenizer import train_unigram_tokenizer

# The benchmark's denoiser: a fixed shape, so figures compare across runs.
DENOISER_CONFIG = dict(
    sample_size=64,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=4,
    attention_head_dim=64,
    num_attention_heads=6,
    caption_projection_dim=384,
    joint_attention_dim=256,
    pooled_projection_dim=128,
)
CLIP_TOKENS = 77
T5_TOKENS = 77
MODEL_VERSION = "1"

# the benchmark's prompts (bench/diffusion.py cycles through them)
PROMPTS = [
    "a photo of a cat sitting on a red chair",
    "a watercolor painting of mountains at sunrise",
    "an astronaut riding a horse on the moon",
    "a bowl of fruit on a wooden table, studio lighting",
    "a futuristic city skyline at night with neon lights",
    "a portrait of an old man with a beard, oil painting",
    "a small boat on a calm lake surrounded by trees",
]
_CORPUS = [
    *PROMPTS,
    "low quality, blurry, deformed, ugly, jpeg artifacts",
    "the quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9",
]


def _tokenizer(style: str, vocab_size: int, max_length: int):
    """A fast tokenizer trained on a fixed corpus. style "clip": <bos> text <eos>; "t5": text </s>."""
    if style == "clip":
        return train_unigram_tokenizer(
            _CORPUS,
            vocab_size,
            bos="<|startoftext|>",
            eos="<|endoftext|>",
            pad="<|endoftext|>",
            specials=["<|endoftext|>", "<|startoftext|>", "<unk>"],
            lowercase=True,
            model_max_length=max_length,
        )
    return train_unigram_tokenizer(
        _CORPUS, vocab_size, eos="</s>", pad="<pad>", lowercase=True, model_max_length=max_length
    )


def build_bench_sd3(out_dir: Path) -> None:
    """Write the benchmark pipeline (StableDiffusion3Pipeline layout) into out_dir."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tok = _tokenizer("clip", 256, CLIP_TOKENS)
    t5_tok = _tokenizer("t5", 256, T5_TOKENS)

    def clip(seed: int):
        torch.manual_seed(seed)
        cfg = CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=64,
            intermediate_size=128,
            projection_dim=64,  # two pooled projections concatenated = pooled_projection_dim 128
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=CLIP_TOKENS,
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
        return CLIPTextModelWithProjection(cfg).eval()

    text_encoder, text_encoder_2 = clip(10), clip(11)
    torch.manual_seed(12)
    text_encoder_3 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok),
            d_model=DENOISER_CONFIG["joint_attention_dim"],
            d_kv=32,
            d_ff=256,
            num_layers=1,
            num_heads=4,
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=t5_tok.pad_token_id,
        )
    ).eval()
    torch.manual_seed(13)
    transformer = SD3Transformer2DModel(**DENOISER_CONFIG).eval()
    torch.manual_seed(14)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5305,
        sample_size=256,
    ).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tok,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tok,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)


def bench_model_dir() -> Path:
    """The benchmark checkpoint directory, built once (process-safe) in the omnistage cache."""
    from omnistage.models.recipes import _RECIPES, build_recipe, register_recipe

    name = "bench-sd3"
    if name not in _RECIPES:
        register_recipe(name, version=MODEL_VERSION)(build_bench_sd3)
    return build_recipe(name)


def load_reference_pipeline(model_dir: Path, threads: int | None = None):
    """The stock diffusers StableDiffusion3Pipeline on the benchmark checkpoint (float32, CPU)."""
    from diffusers import StableDiffusion3Pipeline

    if threads is not None:
        torch.set_num_threads(threads)
    pipe = StableDiffusion3Pipeline.from_pretrained(model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe
