"""Barge-in over /v1/realtime: speech during a spoken answer cancels it in every stage (the
engines' figures from /metrics drop to idle), no audio delta follows, and truncating the
answer at what was played shortens its audio and transcript."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np

from omnistage.tests.realtime.conftest import (
    RATE,
    connect,
    engine_figures,
    idle,
    packets,
    send,
    silence,
    speech,
    until,
)

LONG = 64  # tokens: the answer outlasts the second utterance's onset


def _busy(url: str) -> bool:
    return any(f.get("inflight", 0) > 0 or f.get("running", 0) > 0 for f in engine_figures(url).values())


def test_speech_during_an_answer_cancels_it_everywhere(rt_server):
    clip = speech()
    first = np.concatenate([silence(0.5), clip, silence(1.0)])
    session = {"type": "realtime", "max_output_tokens": LONG, "seed": 0}

    async def talk():
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            await send(ws, "session.update", session=session)
            await until(ws, "session.updated")
            for p in packets(first):
                await send(ws, "input_audio_buffer.append", audio=p)
            early: list = []
            created = await until(ws, "response.created", early)
            rid = created["response"]["id"]
            delta = await until(ws, "response.output_audio.delta", early)
            heard = bytearray(base64.b64decode(delta["delta"]))
            assert await asyncio.to_thread(_busy, rt_server.url), "the stages should hold the answer now"
            for p in packets(np.concatenate([clip, silence(0.3)])):  # the user talks over the answer
                await send(ws, "input_audio_buffer.append", audio=p)
            after_start: list = []
            events: list = []
            while True:
                event = await until(ws, "response.done", events)
                if event["response"]["id"] == rid:
                    break
            started = next(i for i, e in enumerate(events) if e["type"] == "input_audio_buffer.speech_started")
            for e in events[:started]:
                if e["type"] == "response.output_audio.delta":
                    heard += base64.b64decode(e["delta"])
            after_start = [e for e in events[started:] if e.get("response_id") == rid]
            transcript = "".join(
                e["delta"]
                for e in early + events
                if e["type"] == "response.output_audio_transcript.delta" and e["response_id"] == rid
            )
            t0 = time.monotonic()
            while not idle(await asyncio.to_thread(engine_figures, rt_server.url)):
                assert time.monotonic() - t0 < 30, engine_figures(rt_server.url)
                await asyncio.sleep(0.2)
            item_id = event["response"]["output"][0]["id"]
            played_ms = len(heard) // 2 * 1000 // RATE // 2  # the user heard half of what arrived
            await send(ws, "conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=played_ms)
            truncated = await until(ws, "conversation.item.truncated")
            await send(ws, "conversation.item.retrieve", item_id=item_id)
            item = (await until(ws, "conversation.item.retrieved"))["item"]
            await send(ws, "response.cancel")  # whatever the second utterance started
            return event, after_start, transcript, played_ms, truncated, item

    done, after_start, transcript, played_ms, truncated, item = asyncio.run(talk())
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    # deltas stop at once: at most what was already on its way when the speech was detected
    assert sum(e["type"] == "response.output_audio.delta" for e in after_start) <= 1
    assert truncated["audio_end_ms"] == played_ms
    part = item["content"][0]
    samples = len(base64.b64decode(part["audio"])) // 2
    assert abs(samples - played_ms * RATE // 1000) <= 1
    full = done["response"]["output"][0]["content"][0]["transcript"]
    assert full == transcript
    assert part["transcript"] == full[: len(part["transcript"])]
    if len(full.split()) > 1:
        assert len(part["transcript"]) < len(full)
