"""Exact expectations where the ar_lm stage knows the number: hidden-state rows, n > 1 choices
and their logprobs, each against transformers."""

import torch

from omnistage.stages.base import StageRequest

from .test_stage_engine import drain, joined, make_stage

ATOL = 1e-4


def test_hidden_state_rows_are_prompt_plus_generated_minus_one(tiny_llm_dir, hf_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    layers = hf.config.num_hidden_layers
    stage = make_stage(tiny_llm_dir, hidden_state_layers=[0, layers])
    ids = hf_tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    new = 10
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, min_new_tokens=new)[0]
        ref = ref[len(ids) :].tolist()
        ref_states = hf(torch.tensor([ids + ref[:-1]]), output_hidden_states=True).hidden_states
    stage.add(StageRequest("h", {"tokens": ids}, {"max_tokens": new, "temperature": 0.0, "ignore_eos": True}))
    ems = drain(stage)["h"]
    assert joined(ems, "tokens") == ref
    hidden = joined(ems, "hidden_states")
    # every prompt position, then one row per fed-back generated token (the last is never fed)
    assert hidden.shape == (len(ids) + new - 1, 2, hf.config.hidden_size)
    torch.testing.assert_close(hidden[:, 0], ref_states[0][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(hidden[:, 1], ref_states[layers][0], atol=ATOL, rtol=0)


def test_n_choices_logprobs_equal_transformers(tiny_llm_dir, hf_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    prompt_ids = hf_tokenizer("Hello there")["input_ids"]
    n, new, k = 3, 6, 2
    stage = make_stage(tiny_llm_dir)
    params = {"max_tokens": new, "n": n, "temperature": 1.0, "seed": 7, "logprobs": k, "ignore_eos": True}
    stage.add(StageRequest("n", {"tokens": prompt_ids}, params))
    info = drain(stage)["n"][-1].outputs["info"]
    choices = info["choices"]
    assert info["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": n * new, "cached_tokens": 0}
    assert len({tuple(c["tokens"]) for c in choices}) == n  # seeded siblings draw differently
    sampled_outside_top = 0
    for c in choices:
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt_ids + c["tokens"]])).logits[0, len(prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert len(c["logprobs"]) == new
        for pos, (tok, entry) in enumerate(zip(c["tokens"], c["logprobs"])):
            assert entry["token"] == tok
            assert abs(entry["logprob"] - ref[pos, tok].item()) <= ATOL
            top_vals, top_ids = ref[pos].topk(k)
            # OpenAI's top_logprobs: exactly the k most likely, most likely first; the sampled
            # token's own logprob is in "logprob" even when it is not among them
            assert [e["token"] for e in entry["top_logprobs"]] == top_ids.tolist()
            for e, v in zip(entry["top_logprobs"], top_vals.tolist()):
                assert abs(e["logprob"] - v) <= ATOL
            sampled_outside_top += tok not in top_ids.tolist()
    assert sampled_outside_top > 0  # the case that once listed k + 1 entries was exercised
