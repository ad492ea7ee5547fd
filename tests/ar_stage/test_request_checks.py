"""Bad input to the ar_lm stage fails that request alone, as an invalid request naming the input,
and an absurdly long prompt is refused before it is tokenized."""

import time

import pytest
import torch

from omnistage.stages.base import StageRequest

from .test_stage_engine import drain, joined, make_stage

GOOD = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stage(tiny_llm_dir):
    return make_stage(tiny_llm_dir)


def _only(emissions):
    assert len(emissions) == 1
    return emissions[0]


BAD_INPUTS = [
    ({"tokens": [1.7, 2.2]}, "tokens", "list of ints"),
    ({"tokens": torch.tensor([1.7, 2.2])}, "tokens", "integer"),
    ({"tokens": [3, True]}, "tokens", "list of ints"),
    ({"tokens": torch.tensor([True, False])}, "tokens", "integer"),
    ({"prompt": "a\ud800b"}, "prompt", "lone surrogate"),
    ({"messages": [{"role": "user", "content": "hi \udfff"}]}, "messages", "lone surrogate"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role must be one of"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "", "content": "x"}]}, "messages", "role"),
]


@pytest.mark.parametrize("inputs,param,words", BAD_INPUTS, ids=[str(b[0])[:40] for b in BAD_INPUTS])
def test_bad_input_is_an_invalid_request_naming_it(stage, hf_tokenizer, inputs, param, words):
    ids = hf_tokenizer("Hello there")["input_ids"]
    stage.add(StageRequest("alone", {"tokens": ids}, dict(GOOD)))
    alone = joined(drain(stage)["alone"], "tokens")
    stage.add(StageRequest("good", {"tokens": ids}, dict(GOOD)))
    stage.add(StageRequest("bad", inputs, dict(GOOD)))  # must not raise: the request fails alone
    ems = drain(stage)
    err = _only(ems["bad"])
    assert err.finished and err.error_kind == "invalid_request"
    assert err.param == param and words in err.error
    assert joined(ems["good"], "tokens") == alone  # its batch mate is untouched


def test_known_roles_render_as_transformers_does(stage, hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again"},
    ]
    ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    stage.add(StageRequest("toks", {"tokens": list(ref)}, dict(GOOD)))
    stage.add(StageRequest("chat2", {"messages": messages}, dict(GOOD)))
    ems = drain(stage)
    assert joined(ems["chat2"], "tokens") == joined(ems["toks"], "tokens")
    assert ems["chat2"][-1].outputs["info"]["usage"]["prompt_tokens"] == len(ref)


def test_huge_prompt_is_refused_before_tokenizing_and_stalls_no_one(stage, hf_tokenizer):
    ids = hf_tokenizer("Hello there")["input_ids"]
    stage.add(StageRequest("running", {"tokens": ids}, {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}))
    stage.step()
    huge = "hello world " * (10 * 1024 * 1024 // 12)  # ~10 MB
    t0 = time.perf_counter()
    stage.add(StageRequest("huge", {"prompt": huge}, dict(GOOD)))
    stage.add(StageRequest("huge_chat", {"messages": [{"role": "user", "content": huge}]}, dict(GOOD)))
    elapsed = time.perf_counter() - t0
    ems = drain(stage)
    assert elapsed < 0.5, f"refusing two 10 MB prompts took {elapsed:.2f} s"
    for rid, param in (("huge", "prompt"), ("huge_chat", "messages")):
        err = _only(ems[rid])
        assert err.error_kind == "invalid_request" and err.param == param
        assert "characters" in err.error and "context of 512 tokens" in err.error
    assert len(joined(ems["running"], "tokens")) == 3  # 1 from the first step, 3 after


def test_prompt_under_the_character_bound_but_over_the_context_is_refused_by_its_token_count(stage):
    limit = stage.tokenizer.max_chars(stage.engine.max_model_len)
    text = "hello world " * 600  # ~1200 tokens: over the 512-token context, far under the bound
    assert len(text) < limit
    stage.add(StageRequest("long", {"prompt": text}, dict(GOOD)))
    err = _only(drain(stage)["long"])
    assert (
        err.error_kind == "invalid_request:context_length_exceeded" and err.param == "prompt" and "tokens" in err.error
    )


def test_character_bound_is_sound_for_this_tokenizer(stage, hf_tokenizer):
    """No text longer than max_chars(n) encodes to n tokens or fewer: the longest token's
    characters times n, checked against transformers' tokenizer on the worst text we can
    build (the longest vocabulary entry repeated)."""
    vocab = hf_tokenizer.get_vocab()
    longest = max(vocab, key=len)
    text = hf_tokenizer.convert_tokens_to_string([longest] * 64)
    n = len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(text) <= stage.tokenizer.max_chars(n)
    assert stage.tokenizer.max_token_chars >= len(longest)


@pytest.mark.parametrize(
    "params,param",
    [
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"stop": 3}, "stop"),
        ({"priority": True}, "priority"),
        ({"temprature": 0.5}, "temprature"),
    ],
)
def test_bad_request_params_name_the_parameter(stage, params, param):
    stage.add(StageRequest("p", {"tokens": [5, 6, 7]}, params))
    err = _only(drain(stage)["p"])
    assert err.error_kind == "invalid_request" and err.param == param and param in err.error


def test_http_run_route_refuses_fractional_token_ids_instead_of_truncating():
    """The generic run route builds the `tokens` input from JSON: [1.7, 2.2] once became [1, 2]."""
    from omnistage.errors import InvalidRequestError
    from omnistage.graph.loader import load_pipeline, resolve_pipeline_path
    from omnistage.serving.routes.pipelines import _to_inputs

    spec = load_pipeline(resolve_pipeline_path("tiny-llm"))
    assert _to_inputs(spec, {"tokens": [5, 6, 7]})["tokens"].tolist() == [5, 6, 7]
    for bad in ([1.7, 2.2], [1, 2.5], [True, False]):
        with pytest.raises(InvalidRequestError) as err:
            _to_inputs(spec, {"tokens": bad})
        assert err.value.param == "inputs.tokens"
