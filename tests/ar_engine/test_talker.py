"""Qwen2.5-Omni talker shape: thinker-space prompt embeddings through thinker_to_talker_proj,
per-step thinker_reply_part rows added to each fed-back codec token, codec_head, M-RoPE —
against the transformers talker's own forward."""

from __future__ import annotations

import pytest
import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import assert_pool_full, run_to_completion

NEW = 8


def _reference(talker, prompt, pos, reply):
    """Greedy loop over the transformers talker forward (its cache, its reply-part bookkeeping)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=talker.config)
    T = prompt.shape[0]
    delta = int(pos.max()) + 1 - T
    tokens, lps = [], []
    with torch.no_grad():
        out = talker(
            inputs_embeds=prompt[None].clone(),
            position_ids=pos[:, None],
            thinker_reply_part=reply[None],
            cache=cache,
            use_cache=True,
        )
        for step in range(NEW):
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tok = int(logp.argmax())
            tokens.append(tok)
            lps.append(float(logp[tok]))
            if step == NEW - 1:
                break
            p = torch.full((3, 1, 1), T + step + delta)
            out = talker(
                input_ids=torch.tensor([[tok]]),
                position_ids=p,
                thinker_reply_part=out.thinker_reply_part,
                cache=out.cache,
                use_cache=True,
            )
    return tokens, lps


@pytest.mark.parametrize("small_pool", [False, True])
def test_talker_matches_transformers(omni_talker, small_pool):
    path, talker = omni_talker
    g = torch.Generator().manual_seed(0)
    cases = []
    for T, K in [(12, 3), (30, 20), (7, 1)]:
        prompt = torch.randn(T, 48, generator=g)
        pos = torch.arange(T).unsqueeze(0).repeat(3, 1)
        pos[1, 2:6] += torch.tensor([0, 1, 0, 1])  # a small 2x2 "grid": genuinely 3-D positions
        pos[2, 2:6] += torch.tensor([0, 0, 1, 1])
        pos[:, 6:] -= 2
        reply = torch.randn(K, 48, generator=g)
        cases.append((prompt, pos, reply, *_reference(talker, prompt, pos, reply)))
    assert len({t for c in cases for t in c[3]}) >= 8  # diverse reference

    # small_pool: 6 blocks of 8 cannot hold all three (3 + 5 + 2 blocks): preempted sequences are
    # recomputed, generated tokens included, and must get their decode_embeds rows again.
    pool = dict(num_kv_blocks=6, block_size=8) if small_pool else {}
    engine = LLMEngine(EngineConfig(model_path=path, weight_prefix="talker.", max_num_batched_tokens=16, **pool))
    assert engine.model_config.input_projection == "thinker_to_talker_proj"
    for i, (prompt, pos, reply, _, _) in enumerate(cases):
        sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
        if i == 1:  # rows may also arrive while the request runs
            engine.add_request(f"t{i}", None, sp, inputs_embeds=prompt, position_ids=pos, decode_embeds=reply[:2])
            engine.extend_decode_embeds(f"t{i}", reply[2:])
        else:
            engine.add_request(f"t{i}", None, sp, inputs_embeds=prompt, position_ids=pos, decode_embeds=reply)
    res = run_to_completion(engine)
    for i, (_, _, _, tokens, lps) in enumerate(cases):
        got = res[(f"t{i}", 0)]
        assert got["tokens"] == tokens
        assert all(abs(lp[t] - r) < 1e-4 for lp, t, r in zip(got["logprobs"], tokens, lps))
    assert (engine.stats()["preemptions"] > 0) == small_pool
    assert_pool_full(engine)
