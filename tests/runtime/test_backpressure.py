"""A fast producer streaming big chunks into a slow streaming consumer: what the producer's
shared memory holds while the consumer lags.

The producer copies each chunk into a segment of its pool and reuses a segment only once its
reader released it, so the number of segment files its pool created is the largest number of
chunks it ever had in flight at once (files are unlinked only at close). Memory is judged in
units of one chunk's segment: flat means bounded by a few chunks, whatever the stream's length.
"""

from __future__ import annotations

import asyncio
import glob
import os

import pytest
import torch

from omnistage.graph.loader import load_pipeline_text
from omnistage.runtime.pipeline import Pipeline
from omnistage.runtime.replicas import STREAM_CREDIT_ENV

ROWS = 256  # one chunk: 256 x 1024 float32 = 1 MiB (a 2 MiB size class with its header)
CHUNKS = 60

# the producer: x = [n_chunks, rows, delay] -> n_chunks chunks of rows x 1024 float32
FAST_STAGE = """
  fast:
    kind: torch_module
    params:
      factory: "omnistage.tests.runtime.flow_modules:ManyChunks"
      inputs: {x: tensor}
      outputs: {h: tensor}
      streaming_outputs: [h]
    batching: %(batching)s
"""

FLOW_YAML = (
    """
name: flow
inputs: {x: tensor}
outputs: {y: tensor}
stages:"""
    + FAST_STAGE
    + """
  slow:
    kind: torch_module
    params:
      factory: "omnistage.tests.runtime.flow_modules:SlowReader"
      kwargs: {delay: %(consumer_delay)s}
      inputs: {x: tensor}
      outputs: {y: tensor}
      streaming_inputs: [x]
      streaming_outputs: [y]
      per_chunk: true
edges:
  - {from: inputs.x, to: fast.x}
  - {from: fast.h, to: slow.x, stream: {chunk: %(rows)d}}
  - {from: slow.y, to: outputs.y, stream: true}
"""
)


@pytest.fixture(scope="module", autouse=True)
def stream_credit_on():
    """Credit is on by default; set here so that a run with OMNISTAGE_STREAM_CREDIT=0 in its
    environment still tests it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STREAM_CREDIT_ENV, "1")
        yield


def _producer_segments(p: Pipeline) -> list[str]:
    """The segment files the producer stage's pool created."""
    return glob.glob(f"/dev/shm/{p.shm_prefix}-fast0g*")


def _stream(consumer_delay: float, producer_delay: float) -> tuple[list[str], int]:
    yaml = FLOW_YAML % {"consumer_delay": consumer_delay, "rows": ROWS, "batching": "{policy: none}"}
    spec = load_pipeline_text(yaml, "flow.yaml")
    with Pipeline.from_spec(spec) as p:
        out = p.run({"x": torch.tensor([float(CHUNKS), float(ROWS), producer_delay])}, timeout=120)["y"]
        segments = _producer_segments(p)
        largest = max(os.path.getsize(s) for s in segments)
    # the consumer saw every chunk, whole and in order
    assert out.tolist() == [[float(i), float(ROWS)] for i in range(CHUNKS)]
    assert largest == 2 * 2**20  # every chunk went through shared memory, in one size class
    return segments, largest


def test_a_consumer_that_keeps_up_needs_few_segments():
    """The baseline that shows the count measures chunks in flight: a producer slower than its
    consumer reuses the same few segments for the whole stream (one or two when the machine
    is idle; a consumer held up ~100 ms on a loaded machine has had four)."""
    segments, _ = _stream(consumer_delay=0.0, producer_delay=0.03)
    assert 1 <= len(segments) <= 6, f"{len(segments)} segments for {CHUNKS} chunks"


def test_a_slow_streaming_consumer_holds_the_producer_to_a_few_chunks():
    segments, chunk_bytes = _stream(consumer_delay=0.03, producer_delay=0.0)
    held = len(segments) * chunk_bytes
    # flat: a few chunks, not a share of the stream's CHUNKS chunks
    assert held <= 8 * chunk_bytes, f"{len(segments)} segments of {chunk_bytes} bytes for {CHUNKS} chunks"


# -- the caller as the slow consumer: one held request, the rest of the batch goes on ----------

OUT_YAML = (
    """
name: flow-out
inputs: {x: tensor}
outputs: {h: tensor}
stages:"""
    + FAST_STAGE % {"batching": "{policy: dynamic, max_batch_size: 4, max_wait_ms: 50}"}
    + """
edges:
  - {from: inputs.x, to: fast.x}
  - {from: fast.h, to: outputs.h, stream: true}
"""
)

TOKENS = {"prompt": "Once upon a time", "messages": None, "tokens": None}
FAST = {"llm": {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}}
SLOW = {"llm": {"temperature": 0.0, "max_tokens": 240, "ignore_eos": True}}


def _replica(p: Pipeline, stage: str) -> dict:
    return p.replica_stats()[stage][0]


async def _until(p: Pipeline, stage: str, check, what: str, timeout: float = 60.0) -> dict:
    """Poll the stage's replica figures until check(stats) holds."""
    end = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await asyncio.to_thread(_replica, p, stage)
        if check(stats):
            return stats
        assert asyncio.get_running_loop().time() < end, f"{what}: {stats}"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def llm():
    with Pipeline.from_yaml("tiny-llm") as p:
        yield p


@pytest.fixture(scope="module")
def flow_out():
    with Pipeline.from_spec(load_pipeline_text(OUT_YAML, "flow-out.yaml")) as p:
        yield p


def test_a_slow_reader_pauses_only_its_own_request(llm):
    """Two greedy requests in one continuous batch; the slow client takes one chunk and stops
    reading. Its sequence is held at the edge's credit (64 chunks) while the fast one runs on
    to its 200th token; once read again the slow one finishes with exactly the tokens of an
    undisturbed run. (Holding the whole batch would stall the fast one at about 64 tokens.)"""
    window = llm.spec.edges[-2].stream.credit
    whole = llm.run(TOKENS, SLOW, timeout=120)["tokens"]
    assert len(whole) == 240 and 200 > 2 * window

    async def scenario():
        slow = llm.stream(TOKENS, SLOW)
        fast = llm.stream(TOKENS, FAST)
        first = await anext(slow)  # then not a read more until the fast one has ended
        tokens = [t for c in [c async for c in fast] if c.port == "tokens" and c.data for t in c.data]
        held = await _until(llm, "llm", lambda s: s["paused"] == 1, "the slow request is held")
        rest = [c async for c in slow]
        after = await _until(llm, "llm", lambda s: s["paused"] == 0 and s["credit_outstanding"] == 0, "released")
        slow_tokens = [t for c in [first, *rest] if c.port == "tokens" and c.data for t in c.data]
        return tokens, held, slow_tokens, after

    fast_tokens, held, slow_tokens, after = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert fast_tokens == list(whole[:200])  # the fast one ran to its end beside a held one
    # held at the window: text and tokens edges each hold at most `window` unread chunks
    assert window <= held["credit_outstanding"] <= 2 * window, held
    assert slow_tokens == list(whole)
    assert after["engine"]["kv_blocks_free"] == after["engine"]["kv_blocks_total"]


def test_a_reader_that_leaves_frees_its_credit_and_its_producers_kv(llm):
    async def scenario():
        slow = llm.stream(TOKENS, SLOW)
        await anext(slow)
        await _until(llm, "llm", lambda s: s["paused"] == 1, "the slow request is held")
        await slow.aclose()  # the client went away
        return await _until(
            llm,
            "llm",
            lambda s: s["paused"] == 0 and s["credit_outstanding"] == 0 and s["inflight"] == 0,
            "credit returned after the disconnect",
        )

    stats = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert stats["engine"]["kv_blocks_free"] == stats["engine"]["kv_blocks_total"]
    assert llm.num_requests() == 0


def test_readers_that_leave_give_back_their_segments(flow_out):
    """A caller reading 1 MiB chunks takes one and stops: the producer holds the request at its
    byte credit (4 chunks of 4 MiB) while a batch mate streams all of its chunks. Leaving then
    frees that credit and the segments: round after round the pool reuses the same few
    segments instead of growing by a window each."""
    window = flow_out.spec.edges[-1].stream.credit_bytes // (ROWS * 1024 * 4)

    async def read_all(n: int) -> list[float]:
        x = torch.tensor([float(n), float(ROWS), 0.0])
        return [c.data[0, 0].item() async for c in flow_out.stream({"x": x}) if c.data is not None]

    async def leave_once():
        stream = flow_out.stream({"x": torch.tensor([float(CHUNKS), float(ROWS), 0.0])})
        chunk = await anext(stream)
        assert chunk.data.shape == (ROWS, 1024)
        await _until(flow_out, "fast", lambda s: s["paused"] == 1, "held at its byte credit")
        assert await read_all(12) == [float(i) for i in range(12)]  # not held up by the held one
        # ... which stayed where it was: its window out, the one chunk taken not given back
        await _until(flow_out, "fast", lambda s: s["credit_outstanding"] == window, "held still")
        del chunk
        await stream.aclose()
        await _until(flow_out, "fast", lambda s: s["credit_outstanding"] == 0 and s["paused"] == 0, "credit freed")

    for _ in range(3):
        asyncio.run(asyncio.wait_for(leave_once(), 120))
    # two requests' windows (the held one's and its batch mate's), not one more per round
    assert 1 <= len(_producer_segments(flow_out)) <= 2 * window + 2, _producer_segments(flow_out)
    # the segments went back for good: a reader that keeps up streams a whole request in them
    assert asyncio.run(asyncio.wait_for(read_all(CHUNKS), 60)) == [float(i) for i in range(CHUNKS)]
    assert len(_producer_segments(flow_out)) <= 2 * window + 2, _producer_segments(flow_out)
