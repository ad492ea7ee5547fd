"""Preemptive responses (serving/realtime/early.py): with server VAD, a turn's response starts
in the stages at a pause in the user's speech and reaches the client only if the turn ends at
that pause. Judges: the same committed audio answered after a manual commit in another session
(equal transcript and audio), the clock (the first audio delta follows the VAD's stop at once,
where a manual commit waits for the stages), and the pipeline's own request counters and
engine figures (an early request the user talked over is aborted and frees everything)."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from omnistage.serving.realtime.vad import TurnDetector, VadSettings
from omnistage.tests.realtime.conftest import (
    connect,
    engine_figures,
    idle,
    packets,
    preemptive_outcomes,
    request_outcomes,
    send,
    silence,
    speech,
    until,
)

TOKENS = 6
SETTINGS = {"type": "realtime", "max_output_tokens": TOKENS, "seed": 0, "audio": {"output": {"voice": "Ethan"}}}


def _vad(silence_ms: int) -> dict:
    return {
        **SETTINGS,
        "audio": {**SETTINGS["audio"], "input": {"turn_detection": {"silence_duration_ms": silence_ms}}},
    }


def test_pauses_are_reported_where_their_silence_began():
    settings = VadSettings(threshold=0.5, prefix_padding_ms=0, silence_duration_ms=200)
    probs = np.array([0.0, 0.9, 0.9, 0.2, 0.9, 0.2, 0.2, 0.9, 0.9] + [0.1] * 7, dtype=np.float32)
    events = [(e.kind, e.ms) for e in TurnDetector(settings, pause_ms=64).feed(probs)]
    # frame k starts at 32k ms; one silent frame (96 ms) is no pause, two (160, 192) are
    assert events == [("started", 32), ("paused", 160), ("resumed", 224), ("paused", 288), ("stopped", 288)]
    plain = [(e.kind, e.ms) for e in TurnDetector(settings).feed(probs)]
    assert plain == [("started", 32), ("stopped", 288)]


async def _paced(ws, samples: np.ndarray) -> None:
    """Appends in 20 ms packets at the speed of speech."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i, p in enumerate(packets(samples)):
        await send(ws, "input_audio_buffer.append", audio=p)
        await asyncio.sleep(max(0.0, start + (i + 1) * 0.02 - loop.time()))


async def _first_audio_after(ws, mark: str, seen: list) -> tuple[float, dict]:
    """Seconds from the event `mark` to the first audio delta, and the response.done."""
    await until(ws, mark, seen)
    t0 = time.monotonic()
    await until(ws, "response.output_audio.delta", seen)
    gap = time.monotonic() - t0
    return gap, await until(ws, "response.done", seen)


async def _say_phrase(ws, silence_ms: int) -> None:
    """A new session with server VAD (`silence_ms`) hears speech-phrase.wav, sent at once, after
    0.5 s of silence; the silence after it is the caller's."""
    await until(ws, "session.created")
    await send(ws, "session.update", session=_vad(silence_ms))
    await until(ws, "session.updated")
    for p in packets(np.concatenate([silence(0.5), speech("speech-phrase.wav")])):
        await send(ws, "input_audio_buffer.append", audio=p)


def _wait_idle(url: str, deadline: float) -> None:
    """Until the stages hold nothing (or the deadline); then asserts it."""
    while not idle(engine_figures(url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert idle(engine_figures(url)), engine_figures(url)


def _answer(seen: list) -> tuple[str, int]:
    text = "".join(e["delta"] for e in seen if e["type"] == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e["delta"]) for e in seen if e["type"] == "response.output_audio.delta")
    return text, len(audio)


def test_a_turn_starts_early_and_answers_what_it_committed(rt_server):
    # speech-phrase.wav has no pause inside: the only pause is the turn's end
    before = preemptive_outcomes(rt_server.url)

    async def talk():
        async with connect(rt_server) as ws:
            await _say_phrase(ws, 1500)
            seen: list = []
            pacing = asyncio.ensure_future(_paced(ws, silence(2.0)))  # the 1.5 s the VAD waits, in real time
            early_gap, done = await _first_audio_after(ws, "input_audio_buffer.speech_stopped", seen)
            await pacing
            item_id = next(e for e in seen if e["type"] == "input_audio_buffer.committed")["item_id"]
            await send(ws, "conversation.item.retrieve", item_id=item_id)
            committed = (await until(ws, "conversation.item.retrieved"))["item"]["content"][0]["audio"]
            before_stop = [e["type"] for e in seen[: [e["type"] for e in seen].index("input_audio_buffer.committed")]]
            return early_gap, done, _answer(seen), committed, before_stop

    early_gap, done, answer, committed, before_stop = asyncio.run(talk())
    assert not [t for t in before_stop if t.startswith("response.")], before_stop
    assert done["response"]["status"] in ("completed", "incomplete") and answer[1] > 0
    after = preemptive_outcomes(rt_server.url)
    assert after["used"] == before["used"] + 1 and after["discarded"] == before["discarded"]

    async def judge():  # the committed audio again, by hand, in a session of its own
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            manual = {**SETTINGS, "audio": {**SETTINGS["audio"], "input": {"turn_detection": None}}}
            await send(ws, "session.update", session=manual)
            await until(ws, "session.updated")
            await send(ws, "input_audio_buffer.append", audio=committed)
            await send(ws, "input_audio_buffer.commit")
            await until(ws, "input_audio_buffer.committed")
            seen: list = []
            await send(ws, "response.create")
            gap, _ = await _first_audio_after(ws, "response.created", seen)
            return gap, _answer(seen)

    manual_gap, manual_answer = asyncio.run(judge())
    assert answer == manual_answer
    # the early answer waited in the stream for the stop; the manual one had to be computed
    assert early_gap < 0.5 * manual_gap, (early_gap, manual_gap)


def test_speech_after_a_pause_aborts_the_early_response(rt_server):
    clip = speech()  # a 0.4 s pause after its first second: a pause, then speech again
    before, requests_before = preemptive_outcomes(rt_server.url), request_outcomes(rt_server.url)

    async def talk():
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            await send(ws, "session.update", session=_vad(700))
            await until(ws, "session.updated")
            seen: list = []
            await _paced(ws, np.concatenate([silence(0.3), clip, silence(1.0)]))
            await until(ws, "response.done", seen)
            return seen

    seen = asyncio.run(talk())
    types = [e["type"] for e in seen]
    assert types.count("input_audio_buffer.speech_started") == 1 and types.count("response.created") == 1
    after = preemptive_outcomes(rt_server.url)
    assert after["used"] == before["used"] + 1
    assert after["discarded"] >= before["discarded"] + 1
    deadline = time.monotonic() + 30
    _wait_idle(rt_server.url, deadline)
    # the answer and at least one early request the user talked over (aborted, or done unread
    # if the random model ended it within the pause) went through the pipeline
    requests = request_outcomes(rt_server.url)
    ran = sum(requests.get(k, 0) - requests_before.get(k, 0) for k in ("ok", "cancelled"))
    assert ran >= 2 and requests.get("error", 0) == requests_before.get("error", 0)


def test_a_client_event_during_the_pause_discards_the_early_response(rt_server):
    before = preemptive_outcomes(rt_server.url)

    async def talk():
        async with connect(rt_server) as ws:
            await _say_phrase(ws, 1500)
            await _paced(ws, silence(0.5))  # the pause has begun; the turn has not ended
            seen: list = []
            await send(ws, "conversation.item.retrieve", item_id="item_none")  # changes no answer
            await until(ws, "error", seen)
            kept = preemptive_outcomes(rt_server.url)
            await send(ws, "session.update", session={"type": "realtime", "instructions": "Be brief."})
            await until(ws, "session.updated", seen)
            middle = preemptive_outcomes(rt_server.url)
            await _paced(ws, silence(1.5))
            await until(ws, "response.done", seen)
            return kept, middle, seen

    kept, middle, seen = asyncio.run(talk())
    assert kept == before
    assert middle["discarded"] == before["discarded"] + 1 and middle["used"] == before["used"]
    after = preemptive_outcomes(rt_server.url)
    assert after["used"] == before["used"]  # the turn's response started at the stop, with the new instructions
    assert [e["type"] for e in seen].count("response.created") == 1


def test_a_client_gone_during_the_pause_leaves_nothing_running(rt_server):
    before = preemptive_outcomes(rt_server.url)

    async def talk():
        async with connect(rt_server) as ws:
            await _say_phrase(ws, 1500)
            await _paced(ws, silence(0.3))  # the pause has begun: the early answer runs
            # (the socket closes here, before the turn could end)

    asyncio.run(talk())
    deadline = time.monotonic() + 30
    while preemptive_outcomes(rt_server.url)["discarded"] == before["discarded"] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = preemptive_outcomes(rt_server.url)
    assert after["discarded"] == before["discarded"] + 1 and after["used"] == before["used"]
    _wait_idle(rt_server.url, deadline)


def test_a_bad_preemptive_setting_stops_the_server_at_start():
    omnistage = Path(sys.executable).parent / "omnistage"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMNISTAGE_REALTIME_PREEMPTIVE_MS": "soon"}
    proc = subprocess.run(
        [str(omnistage), "serve", "tiny-llm", "--port", "1"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        "omnistage serve: OMNISTAGE_REALTIME_PREEMPTIVE_MS must be milliseconds of silence (e.g. 64) or off, not 'soon'"
    )


def test_an_early_answer_whose_turn_never_ends_is_let_go(rt_server):
    """A client that stops sending audio mid-pause: no stop, no resume. The early answer is
    dropped after silence_duration_ms + 2 s; the turn still ends (and is answered) once the
    audio comes back."""
    before = preemptive_outcomes(rt_server.url)

    async def talk():
        async with connect(rt_server) as ws:
            await _say_phrase(ws, 500)
            await _paced(ws, silence(0.2))  # the pause has begun; then the microphone goes quiet
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while (await asyncio.to_thread(preemptive_outcomes, rt_server.url))["discarded"] == before["discarded"]:
                assert loop.time() < deadline, "the early answer was never let go"
                await asyncio.sleep(0.2)
            seen: list = []
            await _paced(ws, silence(0.6))
            await until(ws, "response.done", seen)
            return seen

    seen = asyncio.run(talk())
    after = preemptive_outcomes(rt_server.url)
    assert after["discarded"] == before["discarded"] + 1 and after["used"] == before["used"]
    types = [e["type"] for e in seen]
    assert types.count("input_audio_buffer.speech_stopped") == 1 and types.count("response.created") == 1
