"""POST /v1/completions through the official `openai` client, judged by the Python API."""

from __future__ import annotations

import openai
import pytest

PROMPT = "Once upon a time"


def test_greedy_completion_equals_the_python_api(client, llm_pipeline, tiny_llm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llm_dir)
    reply = client.completions.create(model="tiny-llm", prompt=PROMPT, temperature=0, max_tokens=12, logprobs=2)
    ours = llm_pipeline.run({"prompt": PROMPT}, {"llm": {"temperature": 0.0, "max_tokens": 12}}, timeout=120)
    choice = reply.choices[0]
    assert reply.object == "text_completion"
    assert choice.text == ours["text"]
    assert choice.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in ours["tokens"]]
    assert len(choice.logprobs.tokens) == len(ours["tokens"]) == reply.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)

    chunks = list(
        client.completions.create(
            model="tiny-llm",
            prompt=PROMPT,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ours["text"]
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_echo_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-llm", prompt=PROMPT, echo=True)
    assert info.value.body["param"] == "echo"


def test_a_pipeline_that_does_not_serve_completions_is_named(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-image", prompt=PROMPT)
    assert info.value.body["code"] == "model_not_supported" and info.value.body["param"] == "model"
