"""The `tiny-llm` pipeline (one ar_lm stage in a worker process) against transformers."""

import asyncio
import threading
import time

import pytest
import torch

from omnistage.errors import InvalidRequestError

PROMPTS = [
    "Once upon a time",
    "你好，世界！今天",
    "def add(a, b):",
    "Emoji: 😀 🎉 and more",
    "The pipeline streams text, audio and images; every stage batches requests on its own device.",
]
GREEDY = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def pipeline():
    from omnistage import Pipeline

    p = Pipeline.from_yaml("tiny-llm")
    yield p
    p.close()


@pytest.fixture(scope="module")
def hf_model(tiny_llm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()


def ask(prompt=None, messages=None, tokens=None):
    """Pipeline inputs: the runtime wants every pipeline input present; unused ones are None."""
    return {"prompt": prompt, "messages": messages, "tokens": tokens}


def hf_greedy(model, ids, max_new_tokens):
    """transformers generate() (stops at the checkpoint's EOS ids, like the stage)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def run_concurrently(pipeline, requests):
    """p.run for each (inputs, params) from its own thread; returns results or exceptions."""
    results = [None] * len(requests)

    def work(i, inputs, params):
        try:
            results[i] = pipeline.run(inputs, params, timeout=120)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i, *r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def tokens_of(out):
    tokens = out["tokens"]
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


def test_greedy_prompts_match_transformers(pipeline, hf_model, hf_tokenizer):
    results = run_concurrently(pipeline, [(ask(s), {"llm": GREEDY}) for s in PROMPTS])
    all_tokens = set()
    for prompt, out in zip(PROMPTS, results):
        assert not isinstance(out, Exception), out
        ref = hf_greedy(hf_model, hf_tokenizer(prompt)["input_ids"], GREEDY["max_tokens"])
        assert tokens_of(out) == ref
        assert out["text"] == hf_tokenizer.decode(ref, skip_special_tokens=True)
        all_tokens.update(ref)
    assert len(all_tokens) > 30  # the random model's greedy output is diverse


def test_chat_messages_match_transformers(pipeline, hf_model, hf_tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello in Chinese: 你好"},
    ]
    out = pipeline.run(ask(messages=messages), {"llm": GREEDY}, timeout=120)
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    ref = hf_greedy(hf_model, list(ids), GREEDY["max_tokens"])
    assert tokens_of(out) == ref
    assert out["text"] == hf_tokenizer.decode(ref, skip_special_tokens=True)
    assert out["info"]["usage"]["prompt_tokens"] == len(ids)


def test_streaming_yields_text_chunks_before_the_end(pipeline):
    async def collect():
        chunks = []
        async for chunk in pipeline.stream(ask(PROMPTS[0]), {"llm": {**GREEDY, "max_tokens": 32}}):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(collect())
    text_chunks = [c for c in chunks if c.port == "text"]
    assert sum(1 for c in text_chunks if c.data and not c.final) >= 3
    assert text_chunks[-1].final and all(not c.final for c in text_chunks[:-1])
    whole = pipeline.run(ask(PROMPTS[0]), {"llm": {**GREEDY, "max_tokens": 32}}, timeout=120)
    assert "".join(c.data for c in text_chunks) == whole["text"]


def test_usage_and_prefix_cache(pipeline, hf_tokenizer):
    prompt = PROMPTS[-1] * 2
    n_prompt = len(hf_tokenizer(prompt)["input_ids"])
    assert n_prompt > 40
    first = pipeline.run(ask(prompt), {"llm": {"max_tokens": 5, "ignore_eos": True}}, timeout=120)
    second = pipeline.run(ask(prompt), {"llm": {"max_tokens": 7, "ignore_eos": True}}, timeout=120)
    for out, n in ((first, 5), (second, 7)):
        usage = out["info"]["usage"]
        assert usage["prompt_tokens"] == n_prompt
        assert usage["completion_tokens"] == n == len(tokens_of(out))
        assert out["info"]["finish_reason"] == "length"
    cached = second["info"]["usage"]["cached_tokens"]
    assert 16 <= cached < n_prompt and cached % 16 == 0  # whole blocks of the shared prompt
    salted = pipeline.run(ask(prompt), {"llm": {"max_tokens": 2, "cache_salt": "tenant-b"}}, timeout=120)
    assert salted["info"]["usage"]["cached_tokens"] == 0


def test_stop_string_cut_from_output(pipeline, hf_tokenizer):
    full = pipeline.run(ask(PROMPTS[2]), {"llm": GREEDY}, timeout=120)
    tokens = tokens_of(full)
    # a stop string made of the tail of token 6's text and the head of token 7's text
    left = hf_tokenizer.decode(tokens[:7], skip_special_tokens=True)
    stop = left[-2:] + hf_tokenizer.decode(tokens[:9], skip_special_tokens=True)[len(left) :][:2]
    assert len(stop) >= 3 and stop in full["text"]
    cut = pipeline.run(ask(PROMPTS[2]), {"llm": {**GREEDY, "stop": [stop]}}, timeout=120)
    assert cut["text"] == full["text"][: full["text"].find(stop)]
    assert cut["info"]["finish_reason"] == "stop"
    assert len(tokens_of(cut)) < len(tokens)


def test_bad_request_fails_alone(pipeline, hf_model, hf_tokenizer):
    results = run_concurrently(
        pipeline,
        [
            (ask(PROMPTS[0]), {"llm": {"max_tokens": 4, "temprature": 0.5}}),
            (ask(PROMPTS[1]), {"llm": GREEDY}),
            (ask(PROMPTS[0]), {"llm": {"max_tokens": 0}}),
            (ask(tokens=[5] * 2100), {"llm": {"max_tokens": 4}}),
        ],
    )
    for bad in (results[0], results[2], results[3]):
        assert isinstance(bad, InvalidRequestError), bad
    assert "temprature" in str(results[0])
    assert "max_tokens" in str(results[2])
    assert "2100" in str(results[3])
    ref = hf_greedy(hf_model, hf_tokenizer(PROMPTS[1])["input_ids"], GREEDY["max_tokens"])
    assert tokens_of(results[1]) == ref


def test_abort_mid_stream_frees_kv_blocks(pipeline):
    async def start_and_leave():
        n = 0
        async for chunk in pipeline.stream(ask(PROMPTS[3]), {"llm": {"max_tokens": 2000, "ignore_eos": True}}):
            if chunk.port == "tokens":
                n += 1
                if n == 3:
                    break
        return n

    before = pipeline.stage_stats()["llm"]["generated_tokens"]
    assert asyncio.run(start_and_leave()) == 3
    deadline = time.time() + 30
    while time.time() < deadline:
        stats = pipeline.stage_stats()["llm"]
        if stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats.get("requests_live", 0) == 0:
            break
        time.sleep(0.1)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["kv_blocks_total"] == 1024
    time.sleep(0.5)
    generated = pipeline.stage_stats()["llm"]["generated_tokens"] - before
    assert 3 <= generated < 1000  # the abort stopped it long before its 2000 tokens


def test_pool_memory_sizes_the_kv_pool(tmp_path):
    """`pool.memory` reaches the stage (StageContext.memory_bytes) and sizes its KV pool when no
    num_kv_blocks / kv_cache_bytes is set; before, it was read from fields the context never had."""
    from omnistage import Pipeline
    from omnistage.graph.loader import resolve_pipeline_path
    from omnistage.models.recipes import build_recipe
    from omnistage.stages.ar.config import load_model_config
    from omnistage.stages.ar.kv_cache import KVCache

    text = resolve_pipeline_path("tiny-llm").read_text()
    assert "num_kv_blocks:" in text
    path = tmp_path / "llm.yaml"
    path.write_text("\n".join(line for line in text.splitlines() if "num_kv_blocks:" not in line))
    p = Pipeline.from_yaml(str(path), ["stages.llm.pool.memory=4MiB"], ready_timeout=120)
    try:
        total = p.stage_stats()["llm"]["kv_blocks_total"]
    finally:
        p.close()
    mc = load_model_config(str(build_recipe("tiny-llm")))
    per_block = KVCache.bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    assert total == (4 << 20) // per_block
