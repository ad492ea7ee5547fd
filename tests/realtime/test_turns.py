"""Turns over /v1/realtime on tiny-omni: text in through the official `openai` realtime
client, audio committed by hand and audio cut by server VAD through plain `websockets`.
The judge of each answer is the same conversation sent to /v1/chat/completions (itself
checked against the Python API in tests/api): equal transcript, equal audio length."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
import soundfile

from omnistage.tests.realtime.conftest import (
    KEY,
    RATE,
    connect,
    packets,
    pcm16_b64,
    send,
    silence,
    speech,
    until,
)

TOKENS = 6
VOICE = {"output": {"voice": "Ethan"}}
# seed: omnistage's extension that makes a session's answers reproducible (so the chat route can judge them)
MANUAL = {
    "type": "realtime",
    "max_output_tokens": TOKENS,
    "seed": 0,
    "audio": {"input": {"turn_detection": None}, **VOICE},
}


def chat_judge(server, content: list[dict]) -> tuple[str, int, dict]:
    """(transcript, samples, usage) of the same turn as a spoken chat completion."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    reply = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": content}],
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"},
        max_tokens=TOKENS,
        seed=0,
    )
    audio = reply.choices[0].message.audio
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio.data)), dtype="float32")
    assert rate == RATE
    return audio.transcript, len(samples), reply.usage.model_dump()


async def collect_response(events) -> dict:
    """Reads one response's events: transcript deltas, audio bytes, and the response.done."""
    out = {"transcript": [], "audio": bytearray(), "types": []}
    async for event in events:
        out["types"].append(event["type"])
        if event["type"] == "response.output_audio_transcript.delta":
            out["transcript"].append(event["delta"])
        elif event["type"] == "response.output_audio.delta":
            out["audio"] += base64.b64decode(event["delta"])
        elif event["type"] == "response.output_audio_transcript.done":
            out["transcript_done"] = event["transcript"]
        elif event["type"] == "response.done":
            out["done"] = event["response"]
            return out
        elif event["type"] == "error":
            raise AssertionError(event)
    raise AssertionError("the connection ended before response.done")


async def _ws_events(ws):
    import json

    while True:
        yield json.loads(await asyncio.wait_for(ws.recv(), 180))


def test_text_turn_with_the_openai_client(rt_server):
    async def talk():
        client = openai.AsyncOpenAI(base_url=rt_server.url + "/v1", api_key=KEY, max_retries=0)
        async with client.realtime.connect(model="tiny-omni") as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.model == "tiny-omni"
            await conn.session.update(session=MANUAL)
            updated = await conn.recv()
            assert updated.type == "session.updated"
            assert updated.session.audio.input.turn_detection is None
            text = [{"type": "input_text", "text": "Hello, who are you?"}]
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": text})
            await conn.response.create()

            async def events():
                async for event in conn:
                    yield event.model_dump(exclude_none=False)

            return await collect_response(events())

    got = asyncio.run(talk())
    transcript, samples, _ = chat_judge(rt_server, [{"type": "text", "text": "Hello, who are you?"}])
    assert "".join(got["transcript"]) == got["transcript_done"] == transcript
    assert len(got["audio"]) == 2 * samples > 0
    done = got["done"]
    assert done["status"] in ("completed", "incomplete") and done["output"][0]["role"] == "assistant"
    assert done["output"][0]["content"][0]["transcript"] == transcript
    usage = done["usage"]
    out = usage["output_token_details"]
    assert out["text_tokens"] == TOKENS or done["status"] == "completed"
    assert out["audio_tokens"] > 0 and usage["output_tokens"] == out["text_tokens"] + out["audio_tokens"]
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    order = [t for t in got["types"] if not t.endswith(".delta")]
    assert order.index("response.created") < order.index("response.content_part.added")
    assert order.index("response.output_audio.done") < order.index("response.output_item.done")


def test_manual_commit_turn_with_websockets(rt_server):
    clip = speech()

    async def talk():
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            await send(ws, "session.update", session=MANUAL)
            await until(ws, "session.updated")
            for packet in packets(clip):
                await send(ws, "input_audio_buffer.append", audio=packet)
            await send(ws, "input_audio_buffer.commit")
            committed = await until(ws, "input_audio_buffer.committed")
            added = await until(ws, "conversation.item.added")
            assert added["item"]["id"] == committed["item_id"] and added["item"]["role"] == "user"
            assert added["item"]["content"][0]["type"] == "input_audio"
            await send(ws, "conversation.item.retrieve", item_id=committed["item_id"])
            retrieved = await until(ws, "conversation.item.retrieved")
            await send(ws, "response.create")
            return retrieved, await collect_response(_ws_events(ws))

    retrieved, got = asyncio.run(talk())
    heard = np.frombuffer(base64.b64decode(retrieved["item"]["content"][0]["audio"]), dtype="<i2")
    np.testing.assert_array_equal(heard, clip)  # the committed item holds exactly what was appended
    wav = io.BytesIO()
    soundfile.write(wav, clip, RATE, format="WAV", subtype="PCM_16")
    audio_part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"},
    }
    transcript, samples, usage = chat_judge(rt_server, [audio_part])
    assert "".join(got["transcript"]) == transcript
    assert len(got["audio"]) == 2 * samples > 0
    ours = got["done"]["usage"]
    assert ours["input_tokens"] == usage["prompt_tokens"]
    assert ours["input_token_details"]["audio_tokens"] == usage["prompt_tokens_details"]["audio_tokens"] > 0
    assert ours["output_token_details"]["audio_tokens"] == usage["completion_tokens_details"]["audio_tokens"] > 0


def _onset_and_end_ms(clip: np.ndarray) -> tuple[int, int]:
    loud = np.nonzero(np.abs(clip) > 0.05 * np.abs(clip).max())[0]
    return int(loud[0] * 1000 / RATE), int(loud[-1] * 1000 / RATE)


@pytest.mark.parametrize("lead_s", [0.6])
def test_server_vad_cuts_the_turn_and_answers(rt_server, lead_s):
    clip = speech()
    onset, end = _onset_and_end_ms(clip)
    audio = np.concatenate([silence(lead_s), clip, silence(1.2)])
    # server_vad is the default; seeded: unseeded, the random tiny talker ends about one answer
    # in a hundred at its first step, without audio
    session = {"type": "realtime", "max_output_tokens": TOKENS, "seed": 0}

    async def talk():
        async with connect(rt_server) as ws:
            created = await until(ws, "session.created")
            vad = created["session"]["audio"]["input"]["turn_detection"]
            assert vad["type"] == "server_vad" and vad["create_response"] is True
            await send(ws, "session.update", session=session)
            await until(ws, "session.updated")
            for packet in packets(audio):
                await send(ws, "input_audio_buffer.append", audio=packet)
            seen: list = []
            started = await until(ws, "input_audio_buffer.speech_started", seen)
            stopped = await until(ws, "input_audio_buffer.speech_stopped", seen)
            committed = await until(ws, "input_audio_buffer.committed", seen)
            got = await collect_response(_ws_events(ws))
            return vad, started, stopped, committed, got

    vad, started, stopped, committed, got = asyncio.run(talk())
    lead_ms = int(lead_s * 1000)
    padding = vad["prefix_padding_ms"]
    # speech starts within a few 32 ms frames of the clip's onset; the start reported includes the padding
    assert abs(started["audio_start_ms"] - (lead_ms + onset - padding)) <= 200, started
    assert lead_ms + end - 100 <= stopped["audio_end_ms"] <= lead_ms + end + 300, stopped
    assert started["item_id"] == stopped["item_id"] == committed["item_id"]
    assert got["done"]["status"] in ("completed", "incomplete") and len(got["audio"]) > 0
    assert "".join(got["transcript"]) == got["transcript_done"]


@pytest.mark.filterwarnings("ignore:'audioop' is deprecated:DeprecationWarning")  # the G.711 judge
def test_beta_names_and_g711_formats(rt_server):
    """A beta client (OpenAI-Beta: realtime=v1, flat session fields) with mu-law in and A-law
    out: the VAD still finds the speech, and the answer is A-law at 8 kHz."""
    import audioop

    clip = np.concatenate([silence(0.5), speech(), silence(1.2)])
    clip8k = soundfile.read(io.BytesIO(_wav(clip)), dtype="int16")[0]
    from omnistage.serving.realtime.audio import resample

    pcm8k = (np.clip(resample(clip8k.astype(np.float32) / 32768, RATE, 8000), -1, 1) * 32767).astype("<i2")
    ulaw = audioop.lin2ulaw(pcm8k.tobytes(), 2)
    headers = {"Authorization": f"Bearer {KEY}", "OpenAI-Beta": "realtime=v1"}
    session = {
        "modalities": ["text", "audio"],
        "input_audio_format": "g711_ulaw",
        "output_audio_format": "g711_alaw",
        "max_response_output_tokens": TOKENS,
    }

    async def talk():
        async with connect(rt_server, headers=headers) as ws:
            await until(ws, "session.created")
            await send(ws, "session.update", session=session)
            updated = await until(ws, "session.updated")
            step = 160  # 20 ms at 8 kHz
            for i in range(0, len(ulaw), step):
                await send(ws, "input_audio_buffer.append", audio=base64.b64encode(ulaw[i : i + step]).decode())
            seen: list = []
            await until(ws, "response.done", seen)
            part = {"type": "input_audio", "audio": base64.b64encode(ulaw[:8000]).decode()}  # the first second
            await send(ws, "conversation.item.create", item={"type": "message", "role": "user", "content": [part]})
            item = (await until(ws, "conversation.item.created"))["item"]
            await send(ws, "conversation.item.retrieve", item_id=item["id"])
            retrieved = await until(ws, "conversation.item.retrieved")
            return updated, seen, retrieved

    updated, seen, retrieved = asyncio.run(talk())
    # the item holds the mu-law audio decoded (and re-encoded for retrieve) as audioop decodes it
    back = np.frombuffer(audioop.ulaw2lin(base64.b64decode(retrieved["item"]["content"][0]["audio"]), 2), "<i2")
    want = np.frombuffer(audioop.ulaw2lin(ulaw[:8000], 2), "<i2")
    assert abs(len(back) - len(want)) <= 1
    n = min(len(back), len(want))
    err = (back[:n].astype(float) - want[:n])[50:-50]
    assert np.sqrt(np.mean(err**2)) < 0.05 * np.sqrt(np.mean(want.astype(float) ** 2))
    assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    types = [e["type"] for e in seen]
    assert "input_audio_buffer.speech_started" in types and "conversation.item.created" in types
    assert "response.audio.delta" in types and "response.output_audio.delta" not in types
    alaw = b"".join(base64.b64decode(e["delta"]) for e in seen if e["type"] == "response.audio.delta")
    pcm = np.frombuffer(audioop.alaw2lin(alaw, 2), dtype="<i2")
    assert len(pcm) > 0 and np.abs(pcm).max() > 0
    transcript = "".join(e["delta"] for e in seen if e["type"] == "response.audio_transcript.delta")
    assert transcript == next(e["transcript"] for e in seen if e["type"] == "response.audio_transcript.done")


def _wav(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_pcm16_at_another_rate_is_resampled(rt_server):
    """audio/pcm at 16 kHz: the committed item is the clip resampled to 24 kHz (judged by torchaudio)."""
    import torch
    import torchaudio.functional as AF

    clip = speech()[: RATE // 2]
    pcm16k = (AF.resample(torch.from_numpy(clip.astype(np.float32) / 32768), RATE, 16000) * 32767).round()
    pcm16k = pcm16k.clamp(-32768, 32767).numpy().astype(np.int16)
    session = {**MANUAL, "audio": {"input": {"turn_detection": None, "format": {"type": "audio/pcm", "rate": 16000}}}}

    async def talk():
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            await send(ws, "session.update", session=session)
            await until(ws, "session.updated")
            await send(ws, "input_audio_buffer.append", audio=pcm16_b64(pcm16k))
            await send(ws, "input_audio_buffer.commit")
            committed = await until(ws, "input_audio_buffer.committed")
            await send(ws, "conversation.item.retrieve", item_id=committed["item_id"])
            return await until(ws, "conversation.item.retrieved")

    item = asyncio.run(talk())["item"]
    # retrieve answers in the input format (16 kHz): the round trip 16k -> 24k -> 16k keeps the audio
    back = np.frombuffer(base64.b64decode(item["content"][0]["audio"]), dtype="<i2").astype(np.float32)
    assert abs(len(back) - len(pcm16k)) <= 1
    n = min(len(back), len(pcm16k))
    err = np.abs(back[:n] - pcm16k[:n].astype(np.float32))[200:-200]
    assert err.max() < 0.05 * np.abs(pcm16k).max()
