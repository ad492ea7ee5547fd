"""Continuous batching with churn: sequences of different lengths finish at different steps and
new ones take their places, so the decode buffer keeps rows of finished sequences, gives them
to joining ones, and re-sorts itself when joins leave its rows out of length order. Judged by
transformers: every request's greedy tokens equal its own generate()."""

from __future__ import annotations

import random

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import VOCAB, assert_pool_full, hf_greedy


def test_churning_batch_matches_transformers(qwen2_gqa_tied):
    path, hf_model = qwen2_gqa_tied
    rng = random.Random(11)
    requests = [([rng.randrange(VOCAB) for _ in range(rng.randint(3, 90))], rng.randint(2, 24)) for _ in range(40)]
    engine = LLMEngine(EngineConfig(model_path=path, max_num_seqs=8, max_num_batched_tokens=256, block_size=16))
    waiting = list(enumerate(requests))
    tokens: dict[str, list[int]] = {}
    live = 0
    while waiting or engine.has_unfinished_requests():
        # at most 10 in the engine: 8 decode, the rest wait, and each finished one is replaced
        while waiting and live < 10:
            i, (prompt, n) = waiting.pop(0)
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            live += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            live -= out.finished
    buffer = engine.decode_buffer
    assert buffer.num_joins > 0  # sequences took the rows of finished ones
    assert buffer.num_rebuilds > 1  # and the rows were sorted again on the way
    for i, (prompt, n) in enumerate(requests):
        assert tokens[f"r{i}"] == hf_greedy(hf_model, prompt, n)[0], f"request {i}"
    assert_pool_full(engine)
