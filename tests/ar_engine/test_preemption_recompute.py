"""What a preempted sequence does when it comes back, against transformers.

A preempted sequence loses its blocks (the full ones stay in the prefix cache) and waits with
its tokens. Readmitted, it must start from its own cached blocks (not recompute what the cache
still holds), and whatever it recomputes must not be reported twice: each hidden-state row of
the prompt/decoded stream arrives exactly once.
"""

from __future__ import annotations

import random

import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import VOCAB, assert_pool_full, hf_greedy

NEW = 40


def _prompts() -> list[list[int]]:
    rng = random.Random(12)  # distinct random prompts: no prefix is shared between requests
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(55, 62))] for _ in range(6)]


def _run_small_pool(path: str, prompts, prefix_caching: bool, layers=()) -> tuple[LLMEngine, dict, dict]:
    # 20 blocks of 8 slots: two ~60-token prompts fit, their growth to ~100 tokens does not
    engine = LLMEngine(
        EngineConfig(
            model_path=path,
            num_kv_blocks=20,
            block_size=8,
            max_num_batched_tokens=128,
            enable_prefix_caching=prefix_caching,
            hidden_state_layers=layers,
        )
    )
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    tokens: dict[str, list[int]] = {}
    rows: dict[str, list[torch.Tensor]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.hidden_states:
                rows.setdefault(o.request_id, []).append(o.hidden_states[layers[0]])
    assert_pool_full(engine)
    return engine, tokens, {rid: torch.cat(r) for rid, r in rows.items()}


def test_a_preempted_sequence_restarts_from_its_cached_blocks(qwen2_untied):
    path, hf_model = qwen2_untied
    prompts = _prompts()
    once = sum(len(p) + NEW - 1 for p in prompts)  # tokens fed through the model without preemption
    computed = {}
    for prefix_caching in (False, True):
        engine, tokens, _ = _run_small_pool(path, prompts, prefix_caching)
        stats = engine.stats()
        assert stats["preemptions"] > 0
        for i, p in enumerate(prompts):
            assert tokens[f"r{i}"] == hf_greedy(hf_model, p, NEW)[0], (prefix_caching, i)
        computed[prefix_caching] = stats["computed_tokens"]
    # without the cache every preemption recomputes the sequence from its first token
    assert computed[False] > once
    # with it, a readmitted sequence starts after its full blocks that are still cached: most
    # of the recompute is saved (a sequence that came back from token 0 would save nothing)
    assert computed[True] - once < (computed[False] - once) / 2, (computed, once)


def test_hidden_rows_arrive_once_across_preemptions(qwen2_untied):
    path, hf_model = qwen2_untied
    prompts = _prompts()
    layer = hf_model.config.num_hidden_layers
    for prefix_caching in (False, True):
        engine, tokens, rows = _run_small_pool(path, prompts, prefix_caching, layers=(layer,))
        assert engine.stats()["preemptions"] > 0
        for i, p in enumerate(prompts):
            ref = hf_greedy(hf_model, p, NEW)[0]
            assert tokens[f"r{i}"] == ref
            with torch.inference_mode():
                states = hf_model(torch.tensor([p + ref[:-1]]), output_hidden_states=True).hidden_states
            # prompt + generated - 1 rows (the last token is never fed), in order, none twice
            assert rows[f"r{i}"].shape[0] == len(p) + NEW - 1, (prefix_caching, i)
            torch.testing.assert_close(rows[f"r{i}"], states[layer][0], atol=1e-4, rtol=0)
