"""Recipes "tiny-sd3" and "tiny-flux": tiny random SD3 / FLUX.1 checkpoints in diffusers layout.

Real architectures (SD3Transformer2DModel / FluxTransformer2DModel, CLIP + T5 text encoders,
AutoencoderKL, FlowMatchEulerDiscreteScheduler) with tiny widths, written with the diffusers
pipeline's save_pretrained so `DiffusionPipeline.from_pretrained(dir)` loads them. Tokenizers
are trained here on a fixed corpus with the `tokenizers` library (a byte-level BPE wrapped as
CLIPTokenizer, a Unigram wrapped as T5 tokenizer): nothing is downloaded.

VAE scale factor 2 (two VAE blocks) and patch size 2, so sizes must be multiples of 4; a
32x32 image is 16x16 latents, 64 transformer tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnistage.models.recipes import register_recipe

_CORPUS = [
    "a photo of a cat sitting on a red chair",
    "an astronaut riding a horse on the moon",
    "a watercolor painting of a lighthouse at dawn",
    "a bowl of fruit on a wooden table, studio lighting",
    "a city street at night in the rain with neon signs",
    "a small house in a snowy forest under the stars",
    "portrait of an old man with a beard, oil painting",
    "blurry, low quality, distorted, ugly, jpeg artifacts",
    "the quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9",
]


def build_clip_tokenizer(vocab_size: int = 400, model_max_length: int = 77):
    """CLIPTokenizer (byte-level BPE with </w> word ends, lower-cased) trained on _CORPUS."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    backend = CLIPTokenizer().backend_tokenizer  # CLIP's normalizer and pre-tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return CLIPTokenizer(vocab=model["vocab"], merges=merges, model_max_length=model_max_length)


def build_t5_tokenizer(vocab_size: int = 200, model_max_length: int = 512):
    """T5 tokenizer (Unigram, metaspace, </s> appended, <pad>=0) trained on _CORPUS."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    uni = Tokenizer(models.Unigram())
    uni.normalizer = normalizers.NFKC()
    uni.pre_tokenizer = pre_tokenizers.Metaspace()
    uni.train_from_iterator(
        _CORPUS,
        trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "</s>", "<unk>"],
            unk_token="<unk>",
            initial_alphabet=list("abcdefghijklmnopqrstuvwxyz0123456789,.!?'-"),
            show_progress=False,
        ),
    )
    vocab = [tuple(v) for v in json.loads(uni.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def _clip_config(tokenizer, hidden: int = 32, projection: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=37,
        projection_dim=projection,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )


def _t5(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=d_model,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    ).eval()


def _vae(shift_factor: float, scaling_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


@register_recipe("tiny-sd3", version="1")
def build_sd3(out_dir: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tokenizer = build_clip_tokenizer()
    tokenizer_3 = build_t5_tokenizer()
    torch.manual_seed(0)
    text_encoder = CLIPTextModelWithProjection(_clip_config(tokenizer)).eval()
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer)).eval()
    torch.manual_seed(2)
    text_encoder_3 = _t5(tokenizer_3, d_model=64)
    torch.manual_seed(3)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,  # T5 width; CLIP (32 + 32) is zero-padded to it
        caption_projection_dim=32,
        pooled_projection_dim=64,  # two CLIP projections of 32
        pos_embed_max_size=64,
    ).eval()
    torch.manual_seed(4)
    vae = _vae(shift_factor=0.0609, scaling_factor=1.5035)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=build_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)


@register_recipe("tiny-flux", version="1")
def build_flux(out_dir: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(_clip_config(tokenizer)).eval()
    torch.manual_seed(1)
    text_encoder_2 = _t5(tokenizer_2, d_model=32)
    torch.manual_seed(2)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels packed 2x2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    ).eval()
    torch.manual_seed(3)
    vae = _vae(shift_factor=0.1159, scaling_factor=0.3611)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
