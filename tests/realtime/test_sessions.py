"""Sessions over /v1/realtime: turns that reuse the prefix cache under the session's salt,
bad events answered with `error` while the session goes on, API keys the way browsers send
them, the per-key session limit, and a client that vanishes mid-answer."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import websockets

from omnistage.tests.realtime.conftest import (
    KEY,
    SESSIONS_PER_KEY,
    connect,
    engine_figures,
    idle,
    packets,
    request_outcomes,
    send,
    speech,
    until,
    ws_url,
)

INSTRUCTIONS = "You are a helpful assistant. Answer briefly, in one short sentence, and stay polite."
TEXT = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4, "seed": 0}


async def _text_turn(ws, text: str) -> dict:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await send(ws, "conversation.item.create", item=item)
    await send(ws, "response.create")
    seen: list = []
    done = await until(ws, "response.done", seen)
    part = done["response"]["output"][0]["content"][0]
    deltas = ("response.output_text.delta", "response.output_audio_transcript.delta")
    assert "".join(e["delta"] for e in seen if e["type"] in deltas) == part.get("text", part.get("transcript"))
    return done["response"]["usage"]


@pytest.mark.parametrize("modality", ["text", "audio"])
def test_later_turns_reuse_the_sessions_cached_prefix(rt_server, modality):
    config = {**TEXT, "instructions": INSTRUCTIONS, "output_modalities": [modality]}

    async def session(turns: list[str]) -> list[dict]:
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            await send(ws, "session.update", session=config)
            await until(ws, "session.updated")
            return [await _text_turn(ws, t) for t in turns]

    a = asyncio.run(session(["Hello there!", "What is the capital of France?", "Thank you, goodbye."]))
    b = asyncio.run(session(["Hello there!"]))
    cached = [u["input_token_details"]["cached_tokens"] for u in a]
    inputs = [u["input_tokens"] for u in a]
    assert cached[0] == 0
    assert 16 <= cached[1] <= inputs[1] and cached[2] > cached[1]  # whole 16-token blocks of earlier turns
    assert inputs[0] < inputs[1] < inputs[2]
    # another session never sees this one's blocks: its salt differs
    assert b[0]["input_token_details"]["cached_tokens"] == 0 and b[0]["input_tokens"] == inputs[0]


BAD = [
    ("not json", "invalid_json", None),
    (json.dumps([1, 2]), "invalid_event", None),
    (json.dumps({"event_id": "e1"}), "invalid_event", "type"),
    (json.dumps({"type": "session.dance", "event_id": "e2"}), "invalid_event_type", "type"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}), "invalid_audio", "audio"),
    (
        json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}),
        "invalid_audio",
        "audio",
    ),  # 3 bytes: half a sample
    (json.dumps({"type": "input_audio_buffer.append"}), "invalid_value", "audio"),
    (json.dumps({"type": "session.update", "session": {"voicee": "x"}}), "invalid_value", "session.voicee"),
    # a voice the talker lacks: refused now, not when the next response fails
    (json.dumps({"type": "session.update", "session": {"voice": "alloy"}}), "invalid_value", "session.voice"),
    (
        json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}}}),
        "invalid_value",
        "session.audio.output.voice",
    ),
    (
        json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"threshold": 2}}}}}),
        "invalid_value",
        "session.audio.input.turn_detection.threshold",
    ),
    (
        json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/mp3"}}}}}),
        "invalid_value",
        "session.audio.input.format",
    ),
    (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty", None),
    (json.dumps({"type": "response.cancel"}), "response_cancel_not_active", None),
    (
        json.dumps({"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 5}),
        "item_not_found",
        "item_id",
    ),
    (json.dumps({"type": "conversation.item.create", "item": {"role": "robot", "content": []}}), None, "item.role"),
    (json.dumps({"type": "response.create", "response": {"max_output_tokens": 0}}), None, "response.max_output_tokens"),
]


def test_bad_events_get_error_events_and_the_session_goes_on(rt_server):
    async def talk():
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            errors = []
            for raw, _, _ in BAD:
                await ws.send(raw)
                errors.append(await until(ws, "error", timeout=30))
            # a text session may carry a voice it never uses (a client's default); turning
            # speech on with it is what gets refused
            await send(ws, "session.update", session={**TEXT, "voice": "alloy"})
            await until(ws, "session.updated")
            await send(ws, "session.update", session={"output_modalities": ["audio"]})
            errors.append(await until(ws, "error", timeout=30))
            await send(ws, "session.update", session=TEXT)
            await until(ws, "session.updated")
            usage = await _text_turn(ws, "Still there?")
            return errors, usage

    errors, usage = asyncio.run(talk())
    speech_on = errors.pop()
    assert speech_on["error"]["param"] == "session.voice" and "alloy" in speech_on["error"]["message"]
    for (raw, code, param), event in zip(BAD, errors, strict=True):
        err = event["error"]
        assert err["type"] == "invalid_request_error" and err["message"], (raw, err)
        if code is not None:
            assert err["code"] == code, (raw, err)
        assert err["param"] == param, (raw, err)
        if "alloy" in raw:
            assert "Chelsie" in err["message"] and "Ethan" in err["message"], err
    assert errors[2]["error"]["event_id"] == "e1" and errors[3]["error"]["event_id"] == "e2"
    assert usage["output_tokens"] > 0


def test_keys_by_header_query_or_subprotocol_and_the_session_limit(rt_server):
    async def opened(ws) -> str:
        return (await until(ws, "session.created", timeout=30))["type"]

    async def talk():
        async with websockets.connect(ws_url(rt_server, api_key=KEY)) as ws:
            assert await opened(ws) == "session.created"
        protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
        async with websockets.connect(ws_url(rt_server), subprotocols=protocols) as ws:
            assert ws.subprotocol == "realtime" and await opened(ws) == "session.created"
        for bad in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(websockets.InvalidStatus) as info:
                async with connect(rt_server, headers=bad):
                    pass
            assert info.value.response.status_code == 403
        held = [await connect(rt_server).__aenter__() for _ in range(SESSIONS_PER_KEY)]
        try:
            for ws in held:
                await opened(ws)
            async with connect(rt_server) as extra:
                error = await until(extra, "error", timeout=30)
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await extra.recv()
            assert closed.value.rcvd.code == 1008
        finally:
            for ws in held:
                await ws.close()
        await asyncio.sleep(0.5)
        async with connect(rt_server) as ws:  # closing sessions gave their slots back
            assert await opened(ws) == "session.created"
        return error

    error = asyncio.run(talk())
    assert error["error"]["code"] == "session_limit_exceeded"


def test_a_vanished_client_frees_everything(rt_server):
    # 2000 tokens: the thinker is still writing when the client goes, right after its first words
    session = {"type": "realtime", "max_output_tokens": 2000, "seed": 0, "audio": {"input": {"turn_detection": None}}}

    async def talk():
        ws = await connect(rt_server).__aenter__()
        await until(ws, "session.created")
        await send(ws, "session.update", session=session)
        await until(ws, "session.updated")
        for p in packets(speech()):
            await send(ws, "input_audio_buffer.append", audio=p)
        await send(ws, "input_audio_buffer.commit")
        before = await asyncio.to_thread(request_outcomes, rt_server.url)
        await send(ws, "response.create")
        await until(ws, "response.output_audio_transcript.delta")
        ws.transport.abort()  # no close frame: the client is simply gone
        t0 = time.monotonic()
        while not idle(await asyncio.to_thread(engine_figures, rt_server.url)):
            assert time.monotonic() - t0 < 30, engine_figures(rt_server.url)
            await asyncio.sleep(0.2)
        after = await asyncio.to_thread(request_outcomes, rt_server.url)
        # the request was aborted (cancelled), not run to its end
        assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1, (before, after)
        assert after.get("ok", 0) == before.get("ok", 0), (before, after)
        # and its session slot: the key can open its whole allowance again
        held = [await connect(rt_server).__aenter__() for _ in range(SESSIONS_PER_KEY)]
        try:
            for ws in held:
                await until(ws, "session.created", timeout=30)
        finally:
            for ws in held:
                await ws.close()

    asyncio.run(talk())
