"""SubmittedStream (serving/realtime/early.py) on a live tiny-llm pipeline: a request submitted
now runs in its stage before anyone reads it, reads back exactly what an undisturbed run
returns, and closing it unread aborts it in the stage (running and KV back to idle)."""

from __future__ import annotations

import asyncio

import pytest

from omnistage.runtime.pipeline import Pipeline
from omnistage.serving.realtime.early import SubmittedStream

PROMPT = {"prompt": "Once upon a time", "messages": None, "tokens": None}
LONG = {"llm": {"temperature": 0.0, "max_tokens": 1500, "ignore_eos": True}}
SHORT = {"llm": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}}


@pytest.fixture(scope="module")
def llm():
    with Pipeline.from_yaml("tiny-llm") as p:
        yield p


def _engine(p: Pipeline) -> dict:
    return p.replica_stats()["llm"][0]["engine"]


async def _until(p: Pipeline, check, what: str, timeout: float = 60.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not check(await asyncio.to_thread(_engine, p)):
        assert asyncio.get_running_loop().time() < end, f"{what}: {_engine(p)}"
        await asyncio.sleep(0.02)


def test_a_submitted_request_runs_unread_and_reads_back_whole(llm):
    want = llm.run(PROMPT, SHORT, timeout=120)["tokens"]

    async def scenario():
        generated = _engine(llm)["generated_tokens"]
        stream = SubmittedStream(llm.stream(PROMPT, SHORT))
        await _until(llm, lambda e: e["generated_tokens"] >= generated + len(want), "runs before any read")
        chunks = [c async for c in stream]
        await stream.aclose()
        return [t for c in chunks if c.port == "tokens" and c.data for t in c.data]

    assert asyncio.run(scenario()) == want


def test_closing_an_unread_request_aborts_it_in_the_stage(llm):
    async def scenario():
        cancelled = llm.request_counts.get("cancelled", 0)
        stream = SubmittedStream(llm.stream(PROMPT, LONG))
        await _until(llm, lambda e: e["running"] == 1, "running")
        await stream.aclose()
        await _until(llm, lambda e: e["running"] == 0 and e["kv_blocks_free"] == e["kv_blocks_total"], "idle")
        return llm.request_counts.get("cancelled", 0) - cancelled, llm.num_requests()

    aborted, left = asyncio.run(scenario())
    assert aborted == 1 and left == 0


def test_closing_at_once_leaves_nothing_behind(llm):
    async def scenario():
        stream = SubmittedStream(llm.stream(PROMPT, LONG))
        await asyncio.sleep(0)  # the submitting task may or may not have reached the stage
        await stream.aclose()
        await _until(llm, lambda e: e["running"] == 0 and e["kv_blocks_free"] == e["kv_blocks_total"], "idle")
        return llm.num_requests()

    assert asyncio.run(scenario()) == 0
