"""Scheduling under pressure: abort, preemption with a small pool, priorities, bad requests."""

from __future__ import annotations

import random

import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import VOCAB, assert_pool_full, hf_greedy, run_to_completion


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_abort_mid_generation(qwen2_gqa_tied):
    path, hf_model = qwen2_gqa_tied
    prompts = _prompts(4, 20, 60, seed=11)
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=64))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    got: dict = {}
    aborted_outputs = []
    for _ in range(4):
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert 0 < len(got["r1"]) < 12
    used_before = engine.num_total_blocks - engine.num_free_blocks
    engine.abort_request("r1")
    assert engine.num_total_blocks - engine.num_free_blocks < used_before  # blocks released at once
    engine.abort_request("r1")  # twice, or an unknown id: no-op
    engine.abort_request("nope")
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == "r1":
                aborted_outputs.append(o)
            else:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(aborted_outputs) == 1
    assert aborted_outputs[0].finished and aborted_outputs[0].finish_reason == "abort"
    assert aborted_outputs[0].new_token_ids == []
    for i in (0, 2, 3):
        assert got[f"r{i}"] == hf_greedy(hf_model, prompts[i], 12)[0]
    assert_pool_full(engine)


def test_preemption_with_small_pool_keeps_outputs_exact(qwen2_untied):
    path, hf_model = qwen2_untied
    prompts = _prompts(6, 55, 62, seed=12)
    # 20 blocks of 8 slots: two prompts are admitted (8 blocks each), then their growth to
    # ~100 tokens (13 blocks each) cannot fit and the newer one must be preempted.
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=20, block_size=8, max_num_batched_tokens=128))
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    res = run_to_completion(engine)
    assert engine.stats()["preemptions"] > 0
    for i, p in enumerate(prompts):
        ref_tokens, ref_lps = hf_greedy(hf_model, p, 40)
        assert res[(f"r{i}", 0)]["tokens"] == ref_tokens
        assert all(abs(lp[t] - r) < 1e-4 for lp, t, r in zip(res[(f"r{i}", 0)]["logprobs"], ref_tokens, ref_lps))
        assert res[(f"r{i}", 0)]["finish_reason"] == "length"
    assert_pool_full(engine)


def test_sampled_request_survives_preemption_unchanged(qwen2_gqa_tied):
    path, _ = qwen2_gqa_tied
    prompts = _prompts(5, 55, 62, seed=13)
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(5)]

    def run(**kw):
        engine = LLMEngine(EngineConfig(model_path=path, **kw))
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            engine.add_request(f"r{i}", p, sp)
        res = run_to_completion(engine)
        assert_pool_full(engine)
        return engine.stats()["preemptions"], [res[(f"r{i}", 0)]["tokens"] for i in range(5)]

    pre_small, small = run(num_kv_blocks=20, block_size=8, max_num_batched_tokens=128)
    pre_big, big = run(num_kv_blocks=256)
    assert pre_small > 0 and pre_big == 0
    assert small == big


def test_priority_and_fcfs_order(qwen2_gqa_tied):
    path, _ = qwen2_gqa_tied
    engine = LLMEngine(EngineConfig(model_path=path, max_num_seqs=1, num_kv_blocks=64))
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("low", [1, 2, 3], sp, priority=5)
    engine.add_request("first", [4, 5, 6], sp)
    engine.add_request("second", [7, 8, 9], sp)
    engine.add_request("urgent", [1, 5, 9], sp, priority=-1)
    order = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["urgent", "first", "second", "low"]
    assert_pool_full(engine)


def test_bad_requests_fail_alone(qwen2_gqa_tied):
    path, hf_model = qwen2_gqa_tied
    engine = LLMEngine(EngineConfig(model_path=path, max_model_len=256, num_kv_blocks=64))
    good = [5, 6, 7, 8]
    engine.add_request("good", good, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    first = [t for o in engine.step() for t in o.new_token_ids]
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request("long", list(range(300)), SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="max_tokens") as e:
        engine.add_request("zero", [1, 2], {"max_tokens": 0})
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter") as e:
        engine.add_request("typo", [1, 2], {"temprature": 0.5})
    assert e.value.param == "temprature"
    for bad in (
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"n": 0},
        {"top_k": -2},
        {"logprobs": 100},
        {"stop_token_ids": ["x"]},
        {"max_tokens": 2.5},
        {"min_tokens": 10, "max_tokens": 5},
    ):
        with pytest.raises(InvalidRequestError):
            SamplingParams.from_dict(bad)
    with pytest.raises(InvalidRequestError):
        engine.add_request("oov", [VOCAB + 5], SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("good", good, SamplingParams())
    # A prompt that just fits leaves room for one token and finishes by length.
    engine.add_request("edge", list(range(255)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    res = run_to_completion(engine)
    assert first + res[("good", 0)]["tokens"] == hf_greedy(hf_model, good, 6)[0]
    assert len(res[("edge", 0)]["tokens"]) == 1 and res[("edge", 0)]["finish_reason"] == "length"
    assert set(k[0] for k in res) == {"good", "edge"}
    assert_pool_full(engine)


def test_stop_tokens_and_eos(qwen2_gqa_tied):
    path, hf_model = qwen2_gqa_tied
    prompt = _prompts(1, 30, 30, seed=14)[0]
    ref, _ = hf_greedy(hf_model, prompt, 10)
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=64, eos_token_ids=(ref[4],)))
    engine.add_request("stop", prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[2]]))
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=10))
    engine.add_request("ignore", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.add_request(
        "min", prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=8, stop_token_ids=[ref[2]])
    )
    res = run_to_completion(engine)
    first_stop = min(i for i, t in enumerate(ref) if t == ref[2])
    assert res[("stop", 0)]["tokens"] == ref[: first_stop + 1] and res[("stop", 0)]["finish_reason"] == "stop"
    first_eos = min(i for i, t in enumerate(ref) if t == ref[4])
    assert res[("eos", 0)]["tokens"] == ref[: first_eos + 1] and res[("eos", 0)]["finish_reason"] == "stop"
    assert res[("ignore", 0)]["tokens"] == ref and res[("ignore", 0)]["finish_reason"] == "length"
    assert len(res[("min", 0)]["tokens"]) >= 8
    assert ref[2] not in res[("min", 0)]["tokens"][:8] and ref[4] not in res[("min", 0)]["tokens"][:8]
    assert_pool_full(engine)


def test_prefix_cache_lru_eviction(qwen2_gqa_tied):
    path, hf_model = qwen2_gqa_tied
    prompts = _prompts(6, 64, 64, seed=15)  # 4 full blocks each
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=12, block_size=16))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(rid, prompt):
        engine.add_request(rid, prompt, sp)
        res = run_to_completion(engine)[(rid, 0)]
        assert res["tokens"] == hf_greedy(hf_model, prompt, 4)[0]
        return res["outputs"][-1].num_cached_tokens

    assert run("a", prompts[0]) == 0
    assert run("a2", prompts[0]) == 48  # 3 of its 4 blocks (the last prompt token is always computed)
    for i in range(1, 4):  # fill the 12-block pool with other prefixes: "a" is least recently used
        assert run(f"p{i}", prompts[i]) == 0
    assert run("p3again", prompts[3]) == 48  # recently used: still cached
    assert run("a3", prompts[0]) == 0  # evicted
    assert engine.stats()["kv_blocks_cached"] <= engine.num_total_blocks
    assert_pool_full(engine)


def test_pool_sizing_and_context_cap(qwen2_gqa_tied):
    path, _ = qwen2_gqa_tied
    from omnistage.stages.ar.kv_cache import KVCache

    per_block = KVCache.bytes_per_block(2, 16, 2, 16, torch.float32)  # layers, block, kv heads, head_dim
    engine = LLMEngine(EngineConfig(model_path=path, kv_cache_bytes=per_block * 10 + 5))
    assert engine.num_total_blocks == 10
    assert engine.max_model_len == 160  # never more than the pool holds: a lone sequence always fits
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", list(range(160)), SamplingParams())
    engine.add_request("y", list(range(150)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    res = run_to_completion(engine)
    assert len(res[("y", 0)]["tokens"]) == 10 and res[("y", 0)]["finish_reason"] == "length"
    assert_pool_full(engine)
