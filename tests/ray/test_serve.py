"""The tiny pipelines through Ray Serve (one local Ray for the module, see conftest.py) against
the embedded runtime as the judge: the same tokens, pixels and tensors; streaming that arrives
in chunks over HTTP; a cancel that empties the engines; a killed replica that fails only its
own request, shows on /ready, and is replaced by Serve."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

from omnistage.errors import WorkerDiedError
from omnistage.runtime.pipeline import Pipeline

PROMPTS = ["Once upon a time", "The capital of France is", "1 2 3 4", "hello"]
GREEDY = {"llm": {"temperature": 0.0, "max_tokens": 12}}
SAMPLED = {"llm": {"temperature": 1.0, "seed": 3, "max_tokens": 12}}
LONG = {"llm": {"temperature": 0.0, "max_tokens": 2000, "ignore_eos": True}}
IMAGE = ({"prompt": "a red cube"}, {"denoiser": {"num_inference_steps": 2, "seed": 7}})
X = torch.linspace(-1, 1, 11 * 8).reshape(11, 8)


@pytest.fixture(scope="module")
def embedded():
    """Each pipeline's outputs from the embedded runtime, run before Ray starts."""
    out = {}
    with Pipeline.from_yaml("tiny-llm") as p:
        out["greedy"] = [p.run({"prompt": q}, GREEDY)["tokens"] for q in PROMPTS]
        out["sampled"] = p.run({"prompt": PROMPTS[0]}, SAMPLED)["tokens"]
    with Pipeline.from_yaml("tiny-image") as p:
        out["image"] = p.run(*IMAGE)["image"]
    with Pipeline.from_yaml("tiny-diamond") as p:
        out["diamond"] = p.run({"x": X})
    return out


def test_outputs_equal_the_embedded_runtime(embedded, ray_app):
    with ray_app.pipeline("tiny-llm") as llm:
        # all at once: one replica batches them in its engine steps
        async def together():
            return await asyncio.gather(*(llm.generate({"prompt": q}, GREEDY) for q in PROMPTS))

        assert [o["tokens"] for o in asyncio.run(together())] == embedded["greedy"]
        assert llm.run({"prompt": PROMPTS[0]}, SAMPLED)["tokens"] == embedded["sampled"]
    with ray_app.pipeline("tiny-image") as image:
        assert torch.equal(image.run(*IMAGE)["image"], embedded["image"])
    with ray_app.pipeline("tiny-diamond") as diamond:  # fan-in join, a re-chunked streaming edge
        got = diamond.run({"x": X})
        for port, value in embedded["diamond"].items():
            torch.testing.assert_close(got[port], value, rtol=0, atol=1e-6, msg=port)


def test_http_routes_answer_through_the_ingress(embedded, ray_app):
    body = {"inputs": {"prompt": PROMPTS[1]}, "params": GREEDY}
    r = httpx.post(ray_app.url + "/v1/pipelines/tiny-llm/run", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"]["tokens"] == embedded["greedy"][1]
    # bad input is the same OpenAI-style 400 as embedded
    r = httpx.post(ray_app.url + "/v1/pipelines/tiny-llm/run", json={"inputs": {"promt": "x"}}, timeout=60)
    assert r.status_code == 400 and "promt" in r.json()["error"]["message"]


def test_streaming_arrives_in_chunks_while_generating(ray_app):
    body = {"model": "tiny-llm", "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "stream": True}
    arrivals = []
    start = time.monotonic()
    with httpx.stream("POST", ray_app.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    arrivals.append(time.monotonic() - start)
    assert len(arrivals) >= 8, arrivals
    # the first text leaves long before the last: chunks are relayed as they are made
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals


def _llm_idle(stats: dict) -> bool:
    return stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_cancel_frees_the_engine(ray_app):
    with ray_app.pipeline("tiny-llm") as llm:
        before = llm.stage_stats()["llm"]
        assert _llm_idle(before), before

        async def leave_after_three():
            n = 0
            async for chunk in llm.stream({"prompt": PROMPTS[2]}, LONG):
                n += chunk.port == "tokens"
                if n == 3:
                    return n

        assert asyncio.run(leave_after_three()) == 3
        end = time.monotonic() + 30
        while not _llm_idle(stats := llm.stage_stats()["llm"]):
            assert time.monotonic() < end, f"the engine still holds the cancelled request: {stats}"
            time.sleep(0.1)
        time.sleep(0.5)
        generated = llm.stage_stats()["llm"]["generated_tokens"] - before["generated_tokens"]
        assert 3 <= generated < 1000, generated  # stopped long before its 2000 tokens
        assert llm.request_counts["cancelled"] == 1


def _kill_llm_replica(llm) -> str:
    import ray

    replica = llm.replica_stats()["llm"][0]["replica_id"]
    actor = ray.get_actor(f"SERVE_REPLICA::omnistage#tiny-llm.llm#{replica}", namespace="serve")
    ray.kill(actor, no_restart=True)
    return replica


def test_a_killed_replica_fails_only_its_requests_and_is_replaced(embedded, ray_app):
    llm, diamond = ray_app.pipeline("tiny-llm"), ray_app.pipeline("tiny-diamond")
    results: dict = {}

    async def long_llm(started: threading.Event):
        try:
            async for _chunk in llm.stream({"prompt": PROMPTS[0]}, LONG):
                started.set()
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            results["llm"] = exc

    def slow_diamond():  # another deployment's request, in flight across the kill
        results["diamond"] = diamond.run({"x": X}, {"producer": {"delay": 0.5}})

    try:
        started = threading.Event()
        llm_thread = threading.Thread(target=lambda: asyncio.run(long_llm(started)))
        llm_thread.start()
        assert started.wait(60)
        diamond_thread = threading.Thread(target=slow_diamond)
        diamond_thread.start()
        killed = _kill_llm_replica(llm)
        llm_thread.join(60)
        diamond_thread.join(60)
        assert isinstance(results.get("llm"), WorkerDiedError), results.get("llm")
        for port, value in embedded["diamond"].items():
            torch.testing.assert_close(results["diamond"][port], value, rtol=0, atol=1e-6, msg=port)

        # /ready shows the stage down until Serve's replacement has built its engine
        seen_down, end = False, time.monotonic() + 180
        while True:
            r = httpx.get(ray_app.url + "/ready", timeout=10)
            if r.status_code == 503:
                seen_down = seen_down or r.json()["pipelines"]["tiny-llm"]["stages"]["llm"]["ready"] is False
            elif seen_down:
                break
            assert time.monotonic() < end, "the killed replica was not replaced"
            time.sleep(0.1)
        assert r.json()["pipelines"]["tiny-llm"]["stages"]["llm"]["ready"] is True
        assert llm.run({"prompt": PROMPTS[3]}, GREEDY)["tokens"] == embedded["greedy"][3]
        assert llm.replica_stats()["llm"][0]["replica_id"] != killed
    finally:
        llm.close(0)
        diamond.close(0)
