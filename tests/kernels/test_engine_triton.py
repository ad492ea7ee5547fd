"""The AR engine with the Triton kernels forced on (OMNISTAGE_TRITON=1, run on CPU tensors by
the interpreter) generates what transformers generates, through chunked prefill, a cached
prefix, mixed decode/prefill steps and the last-layer output-rows path."""

from __future__ import annotations

import random

import pytest
import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from ..ar_engine.conftest import hf_greedy

VOCAB = 256


def _checkpoint(tmp_path_factory, kind: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.25,
    )
    if kind == "qwen2":  # 8 query heads over 2 KV heads
        model = Qwen2ForCausalLM(Qwen2Config(num_attention_heads=8, num_key_value_heads=2, **common))
    else:  # Qwen3: per-head q/k norms inside the fused qkv output
        model = Qwen3ForCausalLM(Qwen3Config(num_attention_heads=4, num_key_value_heads=4, head_dim=16, **common))
    path = str(tmp_path_factory.mktemp(kind))
    model.eval().save_pretrained(path)
    return path, model


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_engine_with_triton_kernels_matches_transformers(kind, tmp_path_factory, monkeypatch):
    from omnistage.kernels.triton import engine_ops

    monkeypatch.setenv("OMNISTAGE_TRITON", "1")
    path, hf = _checkpoint(tmp_path_factory, kind)
    rng = random.Random(7)
    stem = [rng.randrange(VOCAB) for _ in range(40)]
    # lengths at / across the 16-token block boundary; two prompts share a 40-token stem
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 16, 17)]
    prompts += [stem + [rng.randrange(VOCAB) for _ in range(n)] for n in (9, 23)]
    refs = [hf_greedy(hf, p, 5) for p in prompts]
    engine = LLMEngine(EngineConfig(model_path=path, max_num_batched_tokens=24, max_num_seqs=8, block_size=16))
    assert engine.uses_triton and engine.decode_buffer is None
    assert engine.model.layers[0].self_attn.paged_attention is engine_ops.paged_attention
    assert engine.model.norm.fused is engine_ops.OPS
    engine.add_request("first", prompts[3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1))
    results: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:  # the stem is cached by now: the last prompt hits the prefix cache
            for i in (0, 1, 2, 4):
                sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
                engine.add_request(f"r{i}", prompts[i], sp)
        for o in engine.step():
            results.setdefault(o.request_id, []).append(o)
        steps += 1
    for i, (tokens, lps) in enumerate(refs):
        outs = results["first" if i == 3 else f"r{i}"]
        got = [t for o in outs for t in o.new_token_ids]
        assert got == tokens, f"prompt {i} (len {len(prompts[i])})"
        got_lps = [lp[t] for o in outs for lp, t in zip(o.new_logprobs, o.new_token_ids)]
        assert got_lps == pytest.approx(lps, abs=1e-4)
    assert engine.stats()["prefix_cache_hit_tokens"] >= 32


def test_selection_switch_and_the_cpu_default(tmp_path_factory, monkeypatch):
    """CUDA picks the kernels unless OMNISTAGE_TRITON=0; a CPU engine keeps the torch path
    (and its decode buffer) unless forced with OMNISTAGE_TRITON=1."""
    from omnistage.kernels import triton as triton_kernels
    from omnistage.stages.ar import attention

    monkeypatch.delenv("OMNISTAGE_TRITON", raising=False)
    assert triton_kernels.selected("cuda:0") and not triton_kernels.selected("cpu")
    monkeypatch.setenv("OMNISTAGE_TRITON", "0")
    assert not triton_kernels.selected("cuda:0")
    monkeypatch.setenv("OMNISTAGE_TRITON", "1")
    assert triton_kernels.selected("cpu")
    monkeypatch.setenv("OMNISTAGE_TRITON", "auto")
    path, _ = _checkpoint(tmp_path_factory, "qwen2")
    engine = LLMEngine(EngineConfig(model_path=path, max_num_seqs=2))
    assert not engine.uses_triton and engine.decode_buffer is not None
    assert engine.model.layers[0].self_attn.paged_attention is attention.paged_attention
