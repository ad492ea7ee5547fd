"""Sampling: processing equals transformers' logits processors; seeded sampling is independent
of the batch; n > 1 shares the prompt's blocks."""

from __future__ import annotations

import random

import pytest
import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams
from omnistage.stages.ar.sampler import Sampler
from omnistage.stages.ar.sequence import Sequence

from .conftest import VOCAB, assert_pool_full, hf_greedy, run_to_completion


def _seq(tokens, n_prompt, **sp):
    s = Sequence("r", 0, list(tokens[:n_prompt]), n_prompt, SamplingParams(**sp), arrival=0)
    for t in tokens[n_prompt:]:
        s.append_token(t)
    return s


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.9, min_p=0.1),
        dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        dict(temperature=1.0, repetition_penalty=0.7),
    ],
)
def test_processing_matches_transformers_processors(params):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    V = 300
    logits = torch.randn(4, V, generator=g) * 3
    seqs = [_seq(torch.randint(0, V, (20 + i,), generator=g).tolist(), 10, **params) for i in range(4)]
    procs = LogitsProcessorList()
    if params.get("repetition_penalty", 1.0) != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params["repetition_penalty"]))
    procs.append(TemperatureLogitsWarper(params["temperature"]))
    if params.get("top_k"):
        procs.append(TopKLogitsWarper(params["top_k"]))
    if params.get("top_p", 1.0) < 1.0:
        procs.append(TopPLogitsWarper(params["top_p"]))
    if params.get("min_p"):
        procs.append(MinPLogitsWarper(params["min_p"]))
    ours = Sampler(eos_token_ids=()).sampling_probs(logits, seqs)
    for r, s in enumerate(seqs):
        ref = procs(torch.tensor([s.token_ids]), logits[r : r + 1].clone()).softmax(-1)[0]
        assert torch.equal(ours[r] > 0, ref > 0), f"row {r}: kept sets differ"
        torch.testing.assert_close(ours[r], ref, atol=1e-6, rtol=1e-5)


def test_presence_frequency_penalties_and_min_tokens():
    V = 50
    logits = torch.zeros(1, V)
    s = _seq(
        [1, 2, 3, 7, 7, 7, 9],
        3,
        temperature=1.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        min_tokens=10,
        stop_token_ids=[11],
    )
    out = Sampler(eos_token_ids=(12,)).penalized(logits, [s])[0]
    assert out[7].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert out[9].item() == pytest.approx(-(0.5 + 0.25))
    assert out[1].item() == 0.0  # prompt tokens are not output tokens
    assert out[11] == float("-inf") and out[12] == float("-inf")  # stops suppressed before min_tokens


def _sampled_run(path, requests, **engine_kw):
    engine = LLMEngine(EngineConfig(model_path=path, **engine_kw))
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    res = run_to_completion(engine)
    assert_pool_full(engine)
    return res


def test_seeded_sampling_same_alone_and_in_batch_of_32(qwen2_gqa_tied):
    path, _ = qwen2_gqa_tied
    rng = random.Random(7)
    reqs = []
    for i in range(32):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 120))]
        sp = SamplingParams(
            temperature=rng.choice([0.6, 1.0, 1.5]),
            top_k=rng.choice([0, 20]),
            top_p=rng.choice([1.0, 0.9]),
            seed=1000 + i,
            max_tokens=rng.randint(4, 16),
            ignore_eos=True,
        )
        reqs.append((f"s{i}", prompt, sp))
    batch = _sampled_run(path, reqs, max_num_batched_tokens=128)
    outputs = [batch[(rid, 0)]["tokens"] for rid, _, _ in reqs]
    assert len({tuple(o) for o in outputs}) == 32
    assert len({t for o in outputs for t in o}) > 100  # real sampling, not a collapsed distribution
    for k in (0, 13, 31):
        alone = _sampled_run(path, [reqs[k]], max_num_batched_tokens=2048)
        assert alone[(reqs[k][0], 0)]["tokens"] == outputs[k]
    # A different seed gives a different stream.
    rid, prompt, sp = reqs[0]
    other = SamplingParams(**{**sp.to_dict(), "seed": 5})
    assert _sampled_run(path, [(rid, prompt, other)])[(rid, 0)]["tokens"] != outputs[0]


def test_n_greater_than_one_shares_prompt_blocks(qwen2_gqa_tied):
    path, hf_model = qwen2_gqa_tied
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(100)]  # 6 full blocks + 1 partial
    ref, _ = hf_greedy(hf_model, prompt, 6)
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=64, block_size=16))
    engine.add_request("greedy", prompt, SamplingParams(temperature=0, n=3, max_tokens=6, ignore_eos=True))
    engine.add_request(
        "sampled", prompt[:50], SamplingParams(temperature=1.0, n=4, seed=1, max_tokens=8, ignore_eos=True)
    )
    seen_used = []
    results: dict = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            results.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        seen_used.append(engine.num_total_blocks - engine.num_free_blocks)
    for i in range(3):
        assert results[("greedy", i)] == ref
    sampled = [tuple(results[("sampled", i)]) for i in range(4)]
    assert len(set(sampled)) == 4 and all(len(s) == 8 for s in sampled)
    # Without sharing: 3 * 7 + 4 * 4 = 37 blocks; shared: 6 + 3 + 3 + 4 = 16 (+1 for a partial block filling up).
    assert max(seen_used) <= 18
    assert_pool_full(engine)


def test_n_siblings_respect_max_num_seqs(qwen2_gqa_tied):
    path, hf_model = qwen2_gqa_tied
    prompt = list(range(40, 90))
    ref, _ = hf_greedy(hf_model, prompt, 5)
    engine = LLMEngine(EngineConfig(model_path=path, num_kv_blocks=64, max_num_seqs=2))
    engine.add_request("g", prompt, SamplingParams(temperature=0, n=4, max_tokens=5, ignore_eos=True))
    results: dict = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            results.setdefault(o.index, []).extend(o.new_token_ids)
        assert engine.stats()["running"] <= 2
    assert [results[i] for i in range(4)] == [ref] * 4
    assert_pool_full(engine)


@pytest.mark.parametrize(
    "params,plain",
    [
        (dict(temperature=0), True),
        (dict(temperature=0, logprobs=0), False),  # logprobs are computed on the host
        (dict(temperature=0, min_tokens=5), False),  # stop ids suppressed until 5 tokens
        (dict(temperature=0, repetition_penalty=1.2), False),
        (dict(temperature=0, presence_penalty=0.5), False),
        (dict(temperature=0.7), False),
    ],
)
def test_plain_greedy_rows_are_the_argmax_of_the_raw_logits(params, plain):
    """The runner's shortcut (argmax where the logits are; on a GPU only the ids cross to the
    host) is taken exactly when the sampler would return that argmax."""
    sampler = Sampler(eos_token_ids=(2,))
    seq = _seq([5, 6, 7, 2], 3, **params)
    assert sampler.plain_greedy([seq]) is plain
    if plain:
        logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
        assert sampler(logits, [seq]).token_ids == logits.max(dim=-1).indices.tolist()
    suppressed = _seq([5, 6, 7], 3, temperature=0)
    suppressed.suppress_token_ids = (4,)
    assert not sampler.plain_greedy([_seq([5, 6, 7], 3, temperature=0), suppressed])
