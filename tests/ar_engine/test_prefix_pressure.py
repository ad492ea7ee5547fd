"""The prefix cache and the scheduler under memory pressure, against transformers.

A tiny KV pool makes every mechanism act at once: shared-prefix hits while other prefixes are
evicted and running sequences are preempted (recompute), chunked prefill, n > 1 siblings, and
aborts that land while a request waits, after it was preempted, or between prefill chunks.
Every surviving sequence must still produce transformers' greedy tokens (and logprobs within
1e-4), and every block must return to the pool.
"""

from __future__ import annotations

import random

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import VOCAB, assert_pool_full, hf_greedy, run_to_completion


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _assert_equals_hf(res, rid, prompt, hf_model, n_tokens, index=0):
    ref, ref_lps = hf_greedy(hf_model, prompt, n_tokens)
    got = res[(rid, index)]
    assert got["tokens"] == ref, rid
    if got["logprobs"]:
        assert all(abs(lp[t] - r) < 1e-4 for lp, t, r in zip(got["logprobs"], ref, ref_lps)), rid


def test_shared_prefix_hits_while_evicting_and_preempting(qwen2_untied):
    path, hf_model = qwen2_untied
    rng = random.Random(21)
    shared = _tokens(40, rng)  # 5 blocks of 8
    prompts = {f"s{i}": shared + _tokens(rng.randint(4, 12), rng) for i in range(6)}
    prompts |= {f"o{i}": _tokens(rng.randint(40, 50), rng) for i in range(3)}  # other prefixes: evictions
    # 24 blocks of 8 slots: a few sequences fit, their growth to ~80 tokens does not
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=24, block_size=8, max_num_batched_tokens=64))
    sp = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, logprobs=0)
    for rid, p in prompts.items():
        engine.add_request(rid, p, sp)
    res = run_to_completion(engine)
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] >= 40  # at least one sibling prompt reused the shared blocks
    hits = {rid: max(o.num_cached_tokens or 0 for o in res[(rid, 0)]["outputs"]) for rid in prompts}
    assert any(hits[f"s{i}"] >= 40 for i in range(6)), hits
    for rid, p in prompts.items():
        _assert_equals_hf(res, rid, p, hf_model, 28)
        assert res[(rid, 0)]["finish_reason"] == "length"
    assert_pool_full(engine)


def test_eviction_takes_a_cached_prefix_tail_first(qwen2_gqa_tied):
    """A 64-token prompt leaves 4 cached blocks; a request needing all but two of the pool's
    other blocks evicts two of them: the tail two, so the prompt's first 32 tokens stay hits."""
    path, hf_model = qwen2_gqa_tied
    rng = random.Random(22)
    a, b = _tokens(64, rng), _tokens(144, rng)
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=12, block_size=16))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(rid, prompt):
        engine.add_request(rid, prompt, sp)
        res = run_to_completion(engine)
        _assert_equals_hf(res, rid, prompt, hf_model, 4)
        return res[(rid, 0)]["outputs"][-1].num_cached_tokens

    assert run("a", a) == 0  # 68 tokens: 5 blocks, the 4 full prompt blocks cached
    assert run("b", b) == 0  # 148 tokens: 10 blocks = the 7 never-cached + a's uncached + 2 cached
    assert run("a-again", a) == 32
    assert_pool_full(engine)


def test_n_siblings_under_preemption(qwen2_untied):
    path, hf_model = qwen2_untied
    rng = random.Random(23)
    greedy_prompt, sampled_prompt = _tokens(30, rng), _tokens(26, rng)
    others = [_tokens(36, rng) for _ in range(2)]

    def run(num_kv_blocks):
        engine = LLMEngine(
            EngineConfig(model_path=path, num_kv_blocks=num_kv_blocks, block_size=8, max_num_batched_tokens=64)
        )
        engine.add_request("g", greedy_prompt, SamplingParams(temperature=0, n=3, max_tokens=30, ignore_eos=True))
        engine.add_request(
            "s", sampled_prompt, SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=30, ignore_eos=True)
        )
        for i, p in enumerate(others):
            engine.add_request(f"o{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        res = run_to_completion(engine)
        assert_pool_full(engine)
        return engine.stats()["preemptions"], res

    pre_small, small = run(20)
    pre_big, big = run(256)
    assert pre_small > 0 and pre_big == 0
    for i in range(3):
        _assert_equals_hf(small, "g", greedy_prompt, hf_model, 30, index=i)
        assert small[("s", i)]["tokens"] == big[("s", i)]["tokens"]  # seeded siblings survive recompute
    assert len({tuple(small[("s", i)]["tokens"]) for i in range(3)}) == 3
    for i, p in enumerate(others):
        _assert_equals_hf(small, f"o{i}", p, hf_model, 30)


def _find(engine, rid):
    (seq,) = engine.requests[rid]
    return seq


def test_abort_while_waiting_preempted_and_mid_chunked_prefill(qwen2_untied):
    path, hf_model = qwen2_untied
    rng = random.Random(24)
    prompts = {"long": _tokens(150, rng)}  # first in line, prefilled in 32-token chunks
    prompts |= {f"r{i}": _tokens(rng.randint(50, 60), rng) for i in range(5)}
    engine = LLMEngine(
        EngineConfig(model_path=path, num_kv_blocks=40, block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    )
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, sp)
    aborted: dict[str, str] = {}
    results: dict = {}

    def step():
        for o in engine.step():
            if o.request_id in aborted:
                results.setdefault(o.request_id, []).append(o)
            else:
                results.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)

    def used():
        return engine.num_total_blocks - engine.num_free_blocks

    # 1) the long prompt between two prefill chunks
    step()
    seq = _find(engine, "long")
    assert seq in engine.scheduler.running and 0 < seq.num_computed_tokens < 150
    held = len(_find(engine, "long").block_table)
    before = used()
    engine.abort_request("long")
    aborted["long"] = "mid-prefill"
    assert held > 0 and used() <= before - held  # its blocks return at once
    # 2) a request that never ran: still waiting behind max_num_seqs
    step()
    waiting = next(rid for rid in engine.requests if _find(engine, rid) in engine.scheduler.waiting)
    assert _find(engine, waiting).num_computed_tokens == 0
    before = used()
    engine.abort_request(waiting)
    aborted[waiting] = "waiting"
    assert used() == before  # it held no blocks
    # 3) a request that was preempted and waits to be recomputed
    victim = None
    for _ in range(2000):
        step()
        for rid in list(engine.requests):
            seq = _find(engine, rid)
            if rid not in aborted and seq.num_preemptions > 0 and seq in engine.scheduler.waiting:
                victim = rid
                break
        if victim:
            break
    assert victim is not None, ("the pool never forced a preemption", engine.stats(), aborted)
    engine.abort_request(victim)
    aborted[victim] = "preempted"
    while engine.has_unfinished_requests():
        step()
    for rid in aborted:
        assert [o.finish_reason for o in results[rid] if o.finished] == ["abort"], rid
    for rid, p in prompts.items():
        if rid in aborted:
            continue
        assert results[(rid, 0)] == hf_greedy(hf_model, p, 64)[0], rid
    assert_pool_full(engine)
