"""The pinned Qwen2.5-Omni benchmark checkpoint (`omnistage bench omni`).

A real `Qwen2_5OmniForConditionalGeneration` in the Hugging Face layout, random weights, fixed
seed, built once into the omnistage cache: the thinker is hidden 512, 12 layers, intermediate
2048, 8 query / 2 KV heads (M-RoPE section [8, 12, 12], head_dim 64); the audio tower is the
tiny recipe's (real 128 mel bins) projecting to 512; the talker is small (2 layers x 64);
token2wav keeps the real 22-layer DiT structure at width 32 and BigVGAN at 128 channels.
Tokenizer, voices and feature extractor come from the tiny recipe (models/tiny_omni.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnistage.models import tiny_omni

MODEL_VERSION = "1"
THINKER = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=2,
    mrope_section=[8, 12, 12],  # sums to head_dim / 2 = 32
)
TALKER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
# Wide enough that greedy logits are well separated (the equality check must not hinge on
# float32 rounding between batched and serial matmuls), small enough to stay finite in 12 layers.
INIT_STD = 0.1


def bench_config(tok):
    """The tiny recipe's config with the benchmark's thinker and talker sizes (rebuilt from its
    dict so derived fields such as per-layer types follow the new layer count)."""
    from transformers import Qwen2_5OmniConfig

    base = tiny_omni.omni_config(tok, tiny_omni.SHAPES["qwen2_5_omni-gqa"]).to_dict()
    thinker, talker = base["thinker_config"], base["talker_config"]
    text = thinker["text_config"]
    text.pop("layer_types", None)
    text.update({k: v for k, v in THINKER.items() if k != "mrope_section"}, initializer_range=INIT_STD)
    text["head_dim"] = THINKER["hidden_size"] // THINKER["num_attention_heads"]
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": THINKER["mrope_section"]}
    thinker["initializer_range"] = INIT_STD
    thinker["audio_config"]["output_dim"] = THINKER["hidden_size"]
    thinker["vision_config"]["out_hidden_size"] = THINKER["hidden_size"]
    talker.pop("layer_types", None)
    talker.update(TALKER, embedding_size=THINKER["hidden_size"])
    talker["rope_parameters"] = {**talker["rope_parameters"], "mrope_section": [2, 3, 3]}  # sums to 16 / 2
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=base["token2wav_config"])


def build_bench_omni(out_dir: Path) -> None:
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    tok = tiny_omni.save_tokenizer(out_dir)
    tiny_omni.save_feature_extractor(out_dir)
    config = bench_config(tok)
    torch.manual_seed(tiny_omni.SEED)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    torch.manual_seed(tiny_omni.SEED + 2)
    tiny_omni._default_init(model.token2wav)
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, endoftext], pad_token_id=endoftext, do_sample=False
    )
    model.save_pretrained(str(out_dir))
    torch.save(tiny_omni.voices(tok, config), out_dir / "spk_dict.pt")
    meta = {"recipe": "bench-omni", "thinker": THINKER, "talker": TALKER, "seed": tiny_omni.SEED}
    (out_dir / "omnistage_recipe.json").write_text(json.dumps(meta))


def bench_model_dir() -> Path:
    """The benchmark checkpoint directory, built once (process-safe) in the omnistage cache."""
    from omnistage.models.recipes import _RECIPES, build_recipe, register_recipe

    name = "bench-omni"
    if name not in _RECIPES:
        register_recipe(name, version=MODEL_VERSION)(build_bench_omni)
    return build_recipe(name)


def load_reference(model_dir: Path):
    """transformers' full model (thinker, talker, token2wav, voices from spk_dict.pt), float32."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
