"""Recipes `qwen2_5_omni` and `qwen2_5_omni-gqa`: tiny random Qwen2.5-Omni checkpoints, built locally.

A real `Qwen2_5OmniForConditionalGeneration` (thinker with audio and vision towers, talker,
token2wav DiT + BigVGAN) at toy widths, saved with save_pretrained in the Hugging Face layout,
plus what the real checkpoint ships beside the weights: `spk_dict.pt` (voices), a tokenizer
with the Omni special tokens and chat template, and the Whisper feature extractor's config.

What a tiny checkpoint needs to run `generate(return_audio=True)` (../shared/NOTES.md): rope
settings as `rope_parameters` with `mrope_section`, every special id inside the tiny vocabularies
(thinker text ids, talker codec ids, the DiT's code embedding), a speaker entry, BigVGAN's
`upsample_initial_channel` large enough for six halvings. The token2wav weights are re-drawn with
torch's default init: with the small default std the random DiT barely moves its noise and the
waveform stays near 1e-7, which would hide bugs. Thinker and talker use a wide init so greedy
output is diverse.

The `-gqa` variant differs where correctness tests need it to: grouped KV heads (8 query / 2
KV heads) and another `mrope_section`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.models.recipes import register_recipe

SEED = 2024

# Text special tokens of the Omni tokenizer (names as the real tokenizer spells them), and the
# speaker-prompt tokens the voices in spk_dict.pt point at.
CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MEDIA_TOKENS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}
TTS_TOKENS = ["<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>"]
VOICES = {"Chelsie": "<|voice_chelsie|>", "Ethan": "<|voice_ethan|>"}
SPECIAL_TOKENS = CHAT_TOKENS + list(MEDIA_TOKENS.values()) + TTS_TOKENS + list(VOICES.values())

CODEC_VOCAB = 160  # talker vocabulary; its last entries are the codec control tokens
CODEC_SPECIAL = {"pad": CODEC_VOCAB - 8, "start": CODEC_VOCAB - 7, "end": CODEC_VOCAB - 6, "mask": CODEC_VOCAB - 4}


@dataclass(frozen=True)
class OmniShape:
    """The sizes a variant changes (everything else is shared)."""

    thinker_heads: int = 4
    thinker_kv_heads: int = 4
    thinker_mrope_section: tuple[int, int, int] = (2, 3, 3)  # sums to head_dim / 2 = 8
    talker_mrope_section: tuple[int, int, int] = (1, 1, 2)


SHAPES = {
    "qwen2_5_omni": OmniShape(),
    "qwen2_5_omni-gqa": OmniShape(thinker_heads=8, thinker_kv_heads=2, thinker_mrope_section=(2, 1, 1)),
}


def _chat_template() -> str:
    """Qwen2.5-Omni's conversation format: string or typed-part content; each media part
    becomes its begin token, one placeholder and its end token (the processor expands the
    placeholder to the encoder's length). A default system line when none is given."""
    parts = (
        "{%- if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
        "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
        "{%- elif content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
        "{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
        "{%- elif content['type'] == 'video' or 'video' in content %}"
        "{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
        "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}"
    )
    return (
        "{%- for message in messages %}"
        "{%- if loop.first and message['role'] != 'system' %}"
        "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for content in message['content'] %}" + parts + "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def save_tokenizer(out_dir: Path):
    """Byte-level BPE trained on tiny-llm's corpus, with the Omni special tokens; saved with
    transformers' save_pretrained (media tokens as named attributes, as the real one has)."""
    from transformers import PreTrainedTokenizerFast

    from omnistage.models.tiny_llm import train_tokenizer

    base = train_tokenizer(512)
    base.add_special_tokens([t for t in SPECIAL_TOKENS if base.token_to_id(t) is None])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=base,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        extra_special_tokens=dict(MEDIA_TOKENS),
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tok.chat_template = _chat_template()
    tok.save_pretrained(str(out_dir))
    return tok


def save_feature_extractor(out_dir: Path) -> None:
    """The real checkpoint's Whisper log-mel settings (128 bins, 16 kHz, 30 s window)."""
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400
    ).save_pretrained(str(out_dir))


def _thinker_config(vocab: int, shape: OmniShape, ids: dict[str, int], media: dict[str, int]) -> dict:
    """The thinker: text model at toy width, audio tower with the real 128 mel bins, vision tower."""
    return dict(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=shape.thinker_heads,
            num_key_value_heads=shape.thinker_kv_heads,
            max_position_embeddings=4096,
            initializer_range=0.25,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": list(shape.thinker_mrope_section),
                "rope_theta": 10000.0,
            },
        ),
        audio_config=dict(
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            output_dim=64,
            num_mel_bins=128,
            max_source_positions=1500,
            n_window=100,
            initializer_range=0.25,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=56,
            initializer_range=0.25,
        ),
        initializer_range=0.25,
        **media,
        vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"],
    )


def omni_config(tok, shape: OmniShape):
    """A tiny `Qwen2_5OmniConfig` whose special ids all live in the tiny vocabularies."""
    from transformers import Qwen2_5OmniConfig

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in MEDIA_TOKENS.items()}
    vocab = len(tok)
    media = dict(
        audio_token_index=ids["audio_token"],
        image_token_index=ids["image_token"],
        video_token_index=ids["video_token"],
        audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"],
    )
    tts = dict(
        zip(
            ["tts_text_pad_token_id", "tts_text_start_token_id", "tts_text_end_token_id"],
            tok.convert_tokens_to_ids(TTS_TOKENS),
        )
    )
    thinker = _thinker_config(vocab, shape, ids, media)
    talker = dict(
        vocab_size=CODEC_VOCAB, embedding_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, initializer_range=0.3,
        rope_parameters={"rope_type": "default", "mrope_section": list(shape.talker_mrope_section), "rope_theta": 10000.0},
        tts_codec_start_token_id=CODEC_SPECIAL["start"], tts_codec_end_token_id=CODEC_SPECIAL["end"],
        tts_codec_pad_token_id=CODEC_SPECIAL["pad"], tts_codec_mask_token_id=CODEC_SPECIAL["mask"],
        vision_start_token_id=ids["vision_bos_token"], vision_end_token_id=ids["vision_eos_token"],
        **media, **tts,
    )  # fmt: skip
    token2wav = dict(
        dit_config=dict(
            hidden_size=32, num_hidden_layers=22, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
            num_embeds=CODEC_VOCAB, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48],
            enc_attention_channels=8, enc_se_channels=8, dropout=0.0,
        ),
        bigvgan_config=dict(upsample_initial_channel=128),
    )  # fmt: skip
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav)


def _default_init(module: torch.nn.Module) -> None:
    """Re-draw every parameter with torch's own layer init (see the module docstring)."""
    for sub in module.modules():
        if sub is not module and hasattr(sub, "reset_parameters"):
            sub.reset_parameters()


def voices(tok, config) -> dict[str, dict[str, torch.Tensor]]:
    """spk_dict.pt entries: the talker's text-side bos token, the DiT's speaker conditioning and
    a reference mel (the real file's layout)."""
    g = torch.Generator().manual_seed(SEED + 1)
    dit = config.token2wav_config.dit_config
    out = {}
    for name, token in VOICES.items():
        out[name] = {
            "bos_token": tok.convert_tokens_to_ids(token),
            "cond": torch.randn(1, dit.enc_emb_dim, generator=g),
            "ref_mel": torch.randn(1, 60, dit.mel_dim, generator=g),
        }
    return out


def build_omni_checkpoint(out_dir: Path, shape: OmniShape) -> None:
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    tok = save_tokenizer(out_dir)
    save_feature_extractor(out_dir)
    config = omni_config(tok, shape)
    torch.manual_seed(SEED)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    torch.manual_seed(SEED + 2)
    _default_init(model.token2wav)
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, endoftext], pad_token_id=endoftext, do_sample=False
    )
    model.save_pretrained(str(out_dir))
    torch.save(voices(tok, config), out_dir / "spk_dict.pt")
    meta = {"recipe": "qwen2_5_omni", "shape": shape.__dict__, "seed": SEED}
    (out_dir / "omnistage_recipe.json").write_text(json.dumps(meta, default=list))


@register_recipe("qwen2_5_omni", version="1")
def build(out_dir: Path) -> None:
    build_omni_checkpoint(out_dir, SHAPES["qwen2_5_omni"])


@register_recipe("qwen2_5_omni-gqa", version="1")
def build_gqa(out_dir: Path) -> None:
    build_omni_checkpoint(out_dir, SHAPES["qwen2_5_omni-gqa"])
