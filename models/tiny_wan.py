"""Recipe "tiny-wan": a tiny random Wan 2.1 text-to-video checkpoint in diffusers layout.

WanTransformer3DModel + UMT5EncoderModel + AutoencoderKLWan + FlowMatchEulerDiscreteScheduler,
written with WanPipeline.save_pretrained so `WanPipeline.from_pretrained(dir)` loads it. The
tokenizer is a T5-style Unigram (sentencepiece-like, `</s>` appended, pad id 0) trained here
on a fixed corpus: nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.models.recipes import register_recipe
from omnistage.models.unigram_tokenizer import train_unigram_tokenizer

TEXT_DIM = 32
MAX_SEQUENCE_LENGTH = 64  # what configs pass; the pipeline default (226) also works

_CORPUS = [
    "a cat walks on the grass in the sun",
    "a dog runs along the beach at sunset",
    "a red car drives through a city street at night",
    "waves crash against the rocks under a cloudy sky",
    "a bird flies over the mountains and the river",
    "a person rides a bicycle through the park",
    "snow falls slowly on a quiet forest",
    "fireworks light up the dark sky over the lake",
    "blurry, low quality, worst quality, static, jpeg artifacts",
    "the quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9",
]


def build_t5_style_tokenizer(vocab_size: int = 256):
    """A transformers fast tokenizer with T5's conventions, trained on a fixed corpus."""
    return train_unigram_tokenizer(
        _CORPUS, vocab_size, eos="</s>", pad="<pad>", collapse_double_spaces=True, pair_template=True
    )


@register_recipe("tiny-wan", version="1")
def build(out_dir: Path) -> None:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_t5_style_tokenizer()
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=TEXT_DIM,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    torch.manual_seed(1)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
