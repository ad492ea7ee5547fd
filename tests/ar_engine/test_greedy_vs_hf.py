"""Greedy tokens and logprobs equal transformers generate(), under chunked prefill, continuous
batching and prefix-cache hits."""

from __future__ import annotations

import random

import pytest
import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import VOCAB, assert_pool_full, hf_greedy, run_to_completion, torch_threads

LENGTHS = [1, 2, 7, 16, 17, 31, 64, 100, 150, 200, 256, 333, 400, 512, 600, 700]
NEW_TOKENS = 8


def make_prompts(seed: int) -> list[list[int]]:
    """16 prompts of lengths 1..700; the long ones share prefixes so the prefix cache gets hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(700)]
    prompts = []
    for i, n in enumerate(LENGTHS):
        if n >= 100 and i % 2 == 0:
            keep = n * 3 // 4  # share the first three quarters with the common stem
            prompts.append(shared[:keep] + [rng.randrange(VOCAB) for _ in range(n - keep)])
        else:
            prompts.append([rng.randrange(VOCAB) for _ in range(n)])
    # Longest first: its prefix is computed (and cached) before the others sharing it are admitted.
    return sorted(prompts, key=len, reverse=True)


# decode_buffer_bytes: default (persistent decode buffer), 0 (gather from the paged cache every
# step), and a cap small enough that the engine switches between the two paths mid-run.
# threads=2: the CPU matmuls split their weights' columns across the threads (cpu_matmul).
# fused: norms, RoPE and SiLU through kernels.cpu_fused (the default on CPU), or the eager ops.
@pytest.mark.parametrize(
    "ckpt,decode_buffer_bytes,threads,fused",
    [
        ("qwen2_gqa_tied", 1 << 30, 1, True),
        ("qwen2_untied", 0, 1, True),
        ("qwen3_qknorm", 600_000, 1, True),
        ("qwen2_gqa_tied", 1 << 30, 2, True),
        ("qwen2_untied", 1 << 30, 1, False),
    ],
)
def test_greedy_matches_transformers(ckpt, decode_buffer_bytes, threads, fused, request, monkeypatch):
    from omnistage.kernels import cpu_fused

    if not fused:
        monkeypatch.setenv("OMNISTAGE_CPU_FUSED", "0")
    cpu_fused._reset_for_tests()
    try:
        with torch_threads(threads):
            _check_greedy(ckpt, decode_buffer_bytes, request, fused)
    finally:
        monkeypatch.undo()
        cpu_fused._reset_for_tests()


def _check_greedy(ckpt, decode_buffer_bytes, request, fused):
    path, hf_model = request.getfixturevalue(ckpt)
    prompts = make_prompts(seed=len(ckpt))
    refs = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    ref_tokens = [t for t, _ in refs]
    # Random weights must not collapse into a few repeated tokens (that would hide KV/RoPE bugs).
    distinct = {t for toks in ref_tokens for t in toks}
    assert len(distinct) >= 0.5 * sum(len(t) for t in ref_tokens), f"reference output not diverse: {ref_tokens}"
    assert all(len(set(t)) >= 4 for t in ref_tokens)

    engine = LLMEngine(
        EngineConfig(
            model_path=path,
            max_num_batched_tokens=96,
            max_num_seqs=16,
            block_size=16,
            decode_buffer_bytes=decode_buffer_bytes,
        )
    )
    assert (engine.model.norm.fused is not None) == fused  # the kernels are built on this machine
    # Under a roomy cap the decode buffer is allocated once, at start, for max_num_seqs x max_model_len.
    reserved = engine.decode_buffer.buffers[0] if decode_buffer_bytes == 1 << 30 else None
    for i, p in enumerate(prompts):
        engine.add_request(
            f"r{i}", p, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
        )
    results = run_to_completion(engine)
    if reserved is not None:
        assert reserved.shape[2] == 16 and reserved.shape[3] >= engine.max_model_len
        assert engine.decode_buffer.buffers[0] is reserved  # never regrown
    for i, (tokens, lps) in enumerate(refs):
        got = results[(f"r{i}", 0)]
        assert got["tokens"] == tokens, f"prompt {i} (len {len(prompts[i])})"
        assert got["finish_reason"] == "length"
        for step, (tok, ref_lp) in enumerate(zip(tokens, lps)):
            entry = got["logprobs"][step]
            assert len(entry) >= 3 and tok in entry
            assert abs(entry[tok] - ref_lp) < 1e-4
            assert entry[tok] == pytest.approx(max(entry.values()))  # greedy picked the top-1
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["prefix_cache_query_tokens"] == sum(len(p) for p in prompts)
    # Chunked prefill really happened: the longest prompt needs several steps at 96 tokens each.
    assert stats["steps"] >= sum(len(p) for p in prompts) // 96
    if decode_buffer_bytes:
        assert engine.decode_buffer.num_rebuilds > 0
    assert_pool_full(engine)


def test_prefix_cache_hits_across_requests_and_salt(qwen2_gqa_tied):
    path, hf_model = qwen2_gqa_tied
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(100)]
    ref, _ = hf_greedy(hf_model, prompt, 5)
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=64))
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", prompt, sp)
    first = run_to_completion(engine)
    engine.add_request("b", prompt, sp)
    second = run_to_completion(engine)
    engine.add_request("c", prompt, sp, cache_salt="tenant-2")
    third = run_to_completion(engine)
    assert first[("a", 0)]["tokens"] == second[("b", 0)]["tokens"] == third[("c", 0)]["tokens"] == ref
    assert first[("a", 0)]["outputs"][-1].num_cached_tokens == 0
    assert second[("b", 0)]["outputs"][-1].num_cached_tokens == 96  # 6 full blocks of 16
    assert third[("c", 0)]["outputs"][-1].num_cached_tokens == 0  # another tenant's salt
    assert_pool_full(engine)


def test_intermediate_hidden_states_match_transformers(qwen2_untied):
    """Layers other than the final one (the last layer then skips rows it does not need)."""
    path, hf_model = qwen2_untied
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 40, 75)]
    engine = LLMEngine(EngineConfig(model_path=path, max_num_batched_tokens=32, hidden_state_layers=(0, 2)))
    for i, p in enumerate(prompts):
        engine.add_request(f"h{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    results = run_to_completion(engine)
    for i, p in enumerate(prompts):
        got = results[(f"h{i}", 0)]
        seq = p + got["tokens"][:-1]  # every position that was fed through the model
        with torch.no_grad():
            ref = hf_model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        for layer in (0, 2):
            ours = torch.cat([o.hidden_states[layer] for o in got["outputs"] if o.hidden_states], dim=0)
            torch.testing.assert_close(ours, ref[layer][0], atol=1e-4, rtol=1e-4)
        assert got["tokens"] == hf_greedy(hf_model, p, 6)[0]
    assert_pool_full(engine)
