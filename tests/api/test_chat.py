"""POST /v1/chat/completions through the official `openai` client against a live server of
tiny-llm, judged by the same request through the Python API and by transformers."""

from __future__ import annotations

import pytest
import torch

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello in Chinese: 你好"},
]


def python_api(pipeline, params, messages=MESSAGES):
    return pipeline.run({"messages": messages}, {"llm": params}, timeout=120)


def test_greedy_chat_equals_python_api_and_transformers(client, llm_pipeline, tiny_llm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reply = client.chat.completions.create(
        model="tiny-llm", messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2
    )
    choice = reply.choices[0]
    ours = python_api(llm_pipeline, {"temperature": 0.0, "max_tokens": 12})
    assert choice.message.content == ours["text"]
    assert reply.object == "chat.completion" and reply.model == "tiny-llm" and choice.message.role == "assistant"

    tok = AutoTokenizer.from_pretrained(tiny_llm_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    ref = out[0, len(ids) :].tolist()
    ref = ref[: next((i + 1 for i, t in enumerate(ref) if t in (hf.generation_config.eos_token_id or [])), len(ref))]
    assert [t.token for t in choice.logprobs.content] == [tok.decode([t], skip_special_tokens=False) for t in ref]
    assert choice.message.content == tok.decode(ref, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(ref)
    assert reply.usage.total_tokens == len(ids) + len(ref)
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)


def test_stream_with_usage_equals_the_whole_reply(client):
    # a reply long enough that the stream's writer cannot gather it into one event: 16 tokens
    # were sometimes all ready before the first write on a quiet machine
    args = dict(model="tiny-llm", messages=MESSAGES, temperature=0, max_tokens=160, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2  # deltas, not one blob
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n2_sampled_choices_equal_the_python_api(client, llm_pipeline):
    reply = client.chat.completions.create(
        model="tiny-llm", messages=MESSAGES, n=2, temperature=1.0, seed=11, max_tokens=10
    )
    ours = python_api(llm_pipeline, {"temperature": 1.0, "seed": 11, "max_tokens": 10, "n": 2})
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.message.content for c in reply.choices] == [c["text"] for c in ours["info"]["choices"]]
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert reply.usage.completion_tokens == ours["info"]["usage"]["completion_tokens"]

    streamed = list(
        client.chat.completions.create(
            model="tiny-llm", messages=MESSAGES, n=2, temperature=1.0, seed=11, max_tokens=10, stream=True
        )
    )
    texts = ["", ""]
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]


def test_a_reply_goes_back_as_the_client_returned_it(client, llm_pipeline):
    """The usual multi-turn loop, `messages.append(reply.choices[0].message)`: the `openai`
    client sends the message object back with its `refusal: null`."""
    first = client.chat.completions.create(model="tiny-llm", messages=MESSAGES, temperature=0, max_tokens=6)
    turn = [*MESSAGES, first.choices[0].message, {"role": "user", "content": "Again?"}]
    second = client.chat.completions.create(model="tiny-llm", messages=turn, temperature=0, max_tokens=6)
    judge = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content}, turn[-1]]
    ours = python_api(llm_pipeline, {"temperature": 0.0, "max_tokens": 6}, judge)
    assert second.choices[0].message.content == ours["text"]
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_stop_string_cuts_the_reply(client):
    args = dict(model="tiny-llm", messages=MESSAGES, temperature=0, max_tokens=24)
    full = client.chat.completions.create(**args).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    cut = client.chat.completions.create(**args, stop=[stop]).choices[0]
    assert cut.message.content == full[: full.index(stop)]
    assert cut.finish_reason == "stop"


def test_seed_reproduces_a_sampled_reply(client):
    def ask(seed):
        args = dict(model="tiny-llm", messages=MESSAGES, temperature=1.0, top_p=0.95, max_tokens=16, seed=seed)
        return (
            client.chat.completions.create(**args, extra_body={"top_k": 50, "min_p": 0.01}).choices[0].message.content
        )

    first = ask(7)
    assert ask(7) == first
    assert ask(8) != first


def test_tools_are_refused_with_the_field_named(client):
    import openai

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-llm", messages=MESSAGES, tools=[tool])
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-llm",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}],
        )
    assert info.value.body["param"] == "messages[0].content[0].image_url"
