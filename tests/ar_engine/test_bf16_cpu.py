"""bfloat16 on CPU: greedy tokens and logprobs against transformers running the same
checkpoint in bfloat16.

bf16 keeps 8 bits of mantissa, and the engine and transformers sum in different orders
(fused kernels, split GEMMs, paged attention), so two logits closer than bf16's rounding may
swap. The tolerance bf16 supports: the tokens are equal at every position until the first one
where transformers' own top-2 logprob margin is below MARGIN (a near-tie); after such a swap
the sequences legitimately diverge and the rest is not compared. Logprobs agree within LP_TOL
where the tokens agree. Most positions must be compared, or the test would prove nothing.
"""

from __future__ import annotations

import copy
import random

import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import VOCAB, assert_pool_full, run_to_completion

MARGIN = 0.1  # nats: a top-2 gap below this may swap under bf16 rounding
LP_TOL = 0.2  # measured max 0.10 over 60 positions (logits of magnitude ~10, 8-bit mantissa)
NEW = 12


def hf_bf16_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    lps = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
    return tokens, lps


def test_bf16_greedy_equals_transformers_bf16(qwen2_gqa_tied):
    path, hf_fp32 = qwen2_gqa_tied
    hf = copy.deepcopy(hf_fp32).to(torch.bfloat16)  # the session fixture stays float32
    rng = random.Random(31)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 40, 90, 130)]
    engine = LLMEngine(EngineConfig(model_path=path, dtype=torch.bfloat16, num_kv_blocks=64))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0))
    res = run_to_completion(engine)
    assert_pool_full(engine)
    compared = 0
    for i, p in enumerate(prompts):
        ref, ref_lps = hf_bf16_greedy(hf, p)
        got = res[(f"r{i}", 0)]
        for pos, (a, b) in enumerate(zip(got["tokens"], ref)):
            top2 = ref_lps[pos].topk(2).values
            if a != b:
                margin = (top2[0] - top2[1]).item()
                assert margin < MARGIN, f"r{i} pos {pos}: {a} != {b} with a clear margin {margin:.3f}"
                break
            assert abs(got["logprobs"][pos][a] - ref_lps[pos][a].item()) < LP_TOL, (i, pos)
            compared += 1
    assert compared >= 0.75 * NEW * len(prompts), compared
