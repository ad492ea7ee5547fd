"""The ar_lm stage in-process (no runtime): embeddings in, hidden states out, n > 1, params."""

import torch

from omnistage.graph.spec import BatchingSpec
from omnistage.stages.base import StageContext, StageRequest
from omnistage.stages.registry import get_stage_class


def make_stage(model_dir, **params):
    ctx = StageContext(
        "llm",
        "ar_lm",
        str(model_dir),
        None,
        None,
        torch.device("cpu"),
        torch.float32,
        BatchingSpec(policy="continuous", max_num_batched_tokens=32, max_num_seqs=8),
        {"block_size": 16, "num_kv_blocks": 64, "max_model_len": 512, **params},
    )
    return get_stage_class("ar_lm")(ctx)


def drain(stage):
    emissions = {}
    while stage.has_work():
        for em in stage.step():
            emissions.setdefault(em.request_id, []).append(em)
    return emissions


def joined(ems, port):
    parts = [e.outputs[port] for e in ems if port in e.outputs]
    if parts and isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return [t for p in parts for t in p] if parts and isinstance(parts[0], list) else "".join(parts)


def test_embeddings_in_hidden_states_out_match_transformers(tiny_llm_dir, hf_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    n_layers = hf.config.num_hidden_layers
    stage = make_stage(tiny_llm_dir, hidden_state_layers=[0, n_layers])
    ids = hf_tokenizer("The quick brown fox jumps over the lazy dog. 你好")["input_ids"]
    with torch.inference_mode():
        embeds = hf.get_input_embeddings()(torch.tensor([ids]))[0]
        ref = hf.generate(
            inputs_embeds=embeds[None],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
        )[0].tolist()
        ref_states = hf(torch.tensor([ids + ref[:-1]]), output_hidden_states=True).hidden_states
    stage.add(StageRequest("e", {"embeddings": embeds.clone()}, {"max_tokens": 12, "temperature": 0.0}))
    ems = drain(stage)["e"]
    assert joined(ems, "tokens") == ref
    hidden = joined(ems, "hidden_states")  # [rows, 2 layers, hidden]: prompt rows, then fed tokens
    assert hidden.shape[1:] == (2, hf.config.hidden_size)
    rows = hidden.shape[0]
    assert rows >= len(ids)
    assert torch.allclose(hidden[:, 0], ref_states[0][0, :rows], atol=1e-4)
    assert torch.allclose(hidden[:, 1], ref_states[n_layers][0, :rows], atol=1e-4)
    assert stage.engine.num_free_blocks == stage.engine.num_total_blocks


def test_n_choices_and_logprobs(tiny_llm_dir):
    stage = make_stage(tiny_llm_dir)
    stage.add(
        StageRequest(
            "n",
            {"prompt": "Hello"},
            {"max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 7, "logprobs": 2, "ignore_eos": True},
        )
    )
    ems = drain(stage)["n"]
    info = ems[-1].outputs["info"]
    assert ems[-1].finished
    choices = info["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(len(c["tokens"]) == 6 and c["finish_reason"] == "length" for c in choices)
    assert joined(ems, "tokens") == choices[0]["tokens"]  # the stream carries sequence 0
    assert info["usage"]["completion_tokens"] == 18
    for entry in info["logprobs"]:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) >= 2
    assert stage.engine.num_free_blocks == stage.engine.num_total_blocks


def test_stage_params_are_validated():
    cls = get_stage_class("ar_lm")
    assert cls.validate_params({"block_size": 16, "kv_cache_bytes": "64MiB"}) == []
    problems = cls.validate_params({"block_sise": 16, "enable_prefix_caching": 1, "kv_cache_bytes": "lots"})
    assert len(problems) == 3 and "block_size" in problems[0]
    _, outs = cls.ports({})
    assert "hidden_states" not in outs
    _, outs = cls.ports({"hidden_state_layers": [1]})
    assert outs["hidden_states"].streaming
