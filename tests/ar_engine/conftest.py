"""Tiny random checkpoints (built with transformers `save_pretrained`) and reference helpers."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file

VOCAB = 1000
MAX_POS = 1024


@contextmanager
def torch_threads(n: int):
    """Run the block with `n` torch threads (the CPU matmuls split by columns across them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _save(model, path: str) -> str:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen2_gqa_tied(tmp_path_factory):
    """Qwen2, 4 query heads over 2 KV heads, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=MAX_POS,
        initializer_range=0.25,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    return _save(model, str(tmp_path_factory.mktemp("qwen2_gqa_tied"))), model


@pytest.fixture(scope="session")
def qwen2_untied(tmp_path_factory):
    """Qwen2, untied LM head, 4 KV heads (no grouping), 3 layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=MAX_POS,
        initializer_range=0.25,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    return _save(model, str(tmp_path_factory.mktemp("qwen2_untied"))), model


@pytest.fixture(scope="session")
def qwen3_qknorm(tmp_path_factory):
    """Qwen3: q/k RMSNorm, head_dim != hidden / heads, 8 heads over 2 KV heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=MAX_POS,
        initializer_range=0.25,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    return _save(model, str(tmp_path_factory.mktemp("qwen3_qknorm"))), model


OMNI_TOKENS = dict(
    audio_token_index=990,
    image_token_index=991,
    video_token_index=992,
    vision_start_token_id=993,
    vision_end_token_id=994,
    audio_start_token_id=995,
    audio_end_token_id=996,
    position_id_per_seconds=25,
)


@pytest.fixture(scope="session")
def omni_thinker(tmp_path_factory):
    """A tiny Qwen2.5-Omni thinker (M-RoPE text model + small audio/vision towers), re-saved in the
    full Omni checkpoint layout: weights under "thinker.", config under "thinker_config"."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    torch.manual_seed(3)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        initializer_range=0.25,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    cfg = Qwen2_5OmniThinkerConfig(
        text_config=text,
        audio_config=dict(
            d_model=32,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            output_dim=64,
            num_mel_bins=16,
            max_source_positions=100,
            n_window=10,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=[0],
            patch_size=2,
            temporal_patch_size=1,
            spatial_merge_size=2,
        ),
        **OMNI_TOKENS,
    )
    model = Qwen2_5OmniThinkerForConditionalGeneration(cfg).eval()
    thinker_dir = str(tmp_path_factory.mktemp("omni_thinker_hf"))
    model.save_pretrained(thinker_dir)
    omni_dir = str(tmp_path_factory.mktemp("omni_full_layout"))
    tensors = load_file(os.path.join(thinker_dir, "model.safetensors"))
    # Split over two shards with an index, as large checkpoints are.
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({"thinker." + k: tensors[k].contiguous() for k in keys}, os.path.join(omni_dir, shard))
        weight_map.update({"thinker." + k: shard for k in keys})
    with open(os.path.join(omni_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(thinker_dir, "config.json")) as f:
        thinker_cfg = json.load(f)
    with open(os.path.join(omni_dir, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2_5_omni", "thinker_config": thinker_cfg}, f)
    return omni_dir, model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers greedy generate() for one prompt: (tokens, logprob of each token)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, lps


def run_to_completion(engine, max_steps: int = 100000):
    """Step until idle: {(request_id, index): {"tokens", "logprobs", "finish_reason", "outputs"}}."""
    results: dict = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            r = results.setdefault(
                (o.request_id, o.index), {"tokens": [], "logprobs": [], "finish_reason": None, "outputs": []}
            )
            r["tokens"].extend(o.new_token_ids)
            if o.new_logprobs:
                r["logprobs"].extend(o.new_logprobs)
            r["outputs"].append(o)
            if o.finished:
                r["finish_reason"] = o.finish_reason
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return results


def assert_pool_full(engine):
    assert engine.num_free_blocks == engine.num_total_blocks
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="session")
def omni_talker(tmp_path_factory):
    """A tiny Qwen2.5-Omni talker (codec LM: thinker-space embeddings, thinker_to_talker_proj,
    codec_head, M-RoPE), re-saved in the full Omni layout (weights under "talker.")."""
    from transformers import Qwen2_5OmniTalkerConfig, Qwen2_5OmniTalkerForConditionalGeneration

    torch.manual_seed(4)
    cfg = Qwen2_5OmniTalkerConfig(
        vocab_size=300,
        embedding_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=MAX_POS,
        initializer_range=0.3,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
        tts_codec_start_token_id=290,
        tts_codec_end_token_id=291,
        tts_codec_pad_token_id=292,
        tts_codec_mask_token_id=293,
        tts_text_start_token_id=294,
        tts_text_end_token_id=295,
        tts_text_pad_token_id=296,
        **{k: v for k, v in OMNI_TOKENS.items() if k != "position_id_per_seconds"},
    )
    model = Qwen2_5OmniTalkerForConditionalGeneration(cfg).eval()
    talker_dir = str(tmp_path_factory.mktemp("omni_talker_hf"))
    model.save_pretrained(talker_dir)
    omni_dir = str(tmp_path_factory.mktemp("omni_talker_layout"))
    tensors = load_file(os.path.join(talker_dir, "model.safetensors"))
    save_file({"talker." + k: v.contiguous() for k, v in tensors.items()}, os.path.join(omni_dir, "model.safetensors"))
    with open(os.path.join(talker_dir, "config.json")) as f:
        talker_cfg = json.load(f)
    with open(os.path.join(omni_dir, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2_5_omni", "talker_config": talker_cfg}, f)
    return omni_dir, model
