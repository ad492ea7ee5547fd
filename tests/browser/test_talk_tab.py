"""The demo's "Talk" tab in headless Chromium against a live server on tiny-omni (with an API
key, which the page sends as the `openai-insecure-api-key.KEY` subprotocol).

A spoken turn: Chromium's fake microphone plays tests/fixtures/speech-browser.wav once
(espeak-ng); the page streams it over WS /v1/realtime, the server's VAD (silero) finds the
turn, and the answer's audio and transcript come back and are scheduled for playback.
Judges: silero in the server hears speech in what the page sent; the AudioContext clock times
the page's 24 kHz output; the server's *.done events state the whole transcript.

Barge-in: a microphone the test controls (the same sentence, played into a MediaStream the
page gets from getUserMedia) speaks again as soon as the answer starts playing; the server
must confirm the page's truncation and end the answer `cancelled`.
"""

from __future__ import annotations

import base64

import pytest

from omnistage.tests.browser.conftest import SPEECH, open_demo, page_state, save_screenshot, wait_for

pytestmark = pytest.mark.timeout(600)

RATE = 24000
FRAME_BYTES = 480 * 2  # 20 ms of pcm16 at 24 kHz
# the page reports an error or a closed socket: no point waiting for an answer
GAVE_UP = "window.demo.talk.errors.length || window.demo.talk.status.startsWith('closed')"
LEADING_SILENCE_S = 0.3  # of speech-browser.wav; the controlled microphone skips it
LONG_ANSWER_TOKENS = 160
HEARD_MS = 100  # of the answer, before the test speaks over it


def start_talking(driver, max_tokens: int | None = None) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "talk-model")).select_by_value("tiny-omni")
    if max_tokens is not None:
        driver.find_element(By.ID, "talk-max-tokens").send_keys(str(max_tokens))
    driver.find_element(By.ID, "talk-start").click()


def test_spoken_turn_is_answered_with_audio_and_transcript(demo_server, open_browser):
    driver = open_browser(fake_audio=SPEECH)
    open_demo(driver, demo_server, "talk")
    start_talking(driver)
    # an answer that ran its course (were the sentence heard as two turns, the first answer
    # would be cancelled by the second)
    answered = "window.demo.talk.responseStatuses.some((s) => s !== 'cancelled')"
    wait_for(driver, f"{answered} || {GAVE_UP}", 300, "an answer")
    state = page_state(driver, "window.demo.talk")
    save_screenshot(driver, "demo-talk.png")
    events = state["events"]
    assert state["errors"] == [], state

    # The page sent 24 kHz pcm16: as many seconds of samples as the audio clock ran while it
    # captured (a 48 kHz or unresampled stream would be off by far more than the margin).
    assert state["bytesSent"] == state["framesSent"] * FRAME_BYTES > 0
    sent_s = state["bytesSent"] / 2 / RATE
    clock_s = state["capturedUntil"] - state["captureStartedAt"] + 0.02
    assert sent_s == pytest.approx(clock_s, rel=0.03, abs=0.15), (sent_s, clock_s)
    # ... and it was speech: the server's VAD heard the turn start and end
    assert state["speechStarted"] >= 1 and events.get("input_audio_buffer.speech_stopped", 0) >= 1
    assert events.get("response.created", 0) >= 1

    # Every audio delta arrived and was scheduled for playback, sample for sample.
    assert state["audioDeltas"] == events["response.output_audio.delta"] >= 1
    assert state["buffersScheduled"] == state["audioDeltas"]
    assert state["secondsScheduled"] == pytest.approx(state["audioBytesReceived"] / 2 / RATE, abs=1e-6)
    assert state["audioBytesReceived"] > 0 and state["truncatesSent"] == 0
    # ... and rendered: the answer's samples reached the context's output (an analyser on the
    # node every chunk plays through), never louder than what arrived
    assert state["receivedPeak"] > 0
    assert 0 < state["outputPeak"] <= state["receivedPeak"] * 1.1, (state["outputPeak"], state["receivedPeak"])
    # ... back to back on the audio clock: a chunk starts where the one before it ends, except
    # after an underrun (the next chunk came late), when it starts later, never earlier
    chunks = [(start, duration) for _, start, duration in state["schedule"]]
    assert len(chunks) == state["buffersScheduled"]
    steps = [
        start - (prev_start + prev_duration) for (prev_start, prev_duration), (start, _) in zip(chunks, chunks[1:])
    ]
    assert all(step >= -1e-9 for step in steps), steps
    assert sum(1 for step in steps if step > 1e-6) == state["underruns"], (steps, state["underruns"])

    # The live transcript is the server's whole transcript, and the page shows it.
    assert state["transcript"] and state["transcript"] == "".join(state["transcriptsDone"])
    shown = page_state(driver, "[...document.querySelectorAll('#transcript li.assistant')].map(li => li.textContent)")
    assert "".join(shown) == state["transcript"]


# A microphone the test controls: getUserMedia gives the page a MediaStream that carries the
# speech clip each time testMic.speak() plays it, and silence in between. It speaks again
# by itself once the first audio of an answer has played for HEARD_S.
CONTROLLED_MICROPHONE = """
const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
const skip = arguments[1];
const HEARD_S = arguments[2];
const context = new AudioContext();
const out = context.createMediaStreamDestination();
const mic = (window.testMic = { clip: null, spoken: 0 });
context.decodeAudioData(bytes.buffer).then((clip) => (mic.clip = clip));
mic.speak = () => {
  const source = context.createBufferSource();
  source.buffer = mic.clip;
  source.connect(out);
  source.start(0, skip);
  mic.spoken++;
};
navigator.mediaDevices.getUserMedia = async () => out.stream;
const watch = setInterval(() => {
  const talk = window.demo.talk; // capturedUntil: the page's audio clock, every 20 ms
  if (mic.spoken === 1 && talk.schedule.length && talk.capturedUntil >= talk.schedule[0][1] + HEARD_S) {
    mic.speak();
    clearInterval(watch);
  }
}, 5);
"""


def test_speaking_over_the_answer_interrupts_it(demo_server, open_browser):
    driver = open_browser()
    open_demo(driver, demo_server, "talk")
    clip = base64.b64encode(SPEECH.read_bytes()).decode()
    driver.execute_script(CONTROLLED_MICROPHONE, clip, LEADING_SILENCE_S, HEARD_MS / 1000)
    wait_for(driver, "window.testMic.clip", 10, "the clip decoded")
    # a long answer: the server's talker says at least 4 s of it (conftest's demo_server), so
    # the second sentence lands while it is still being generated, however slow the machine
    start_talking(driver, max_tokens=LONG_ANSWER_TOKENS)
    wait_for(driver, "window.demo.talk.events['session.updated']", 60, "the session configured")
    assert page_state(driver, "window.demo.talk.session.max_output_tokens") == LONG_ANSWER_TOKENS
    driver.execute_script("window.testMic.speak();")
    wait_for(
        driver,
        "(window.demo.talk.truncated.length >= 1 && window.demo.talk.responseStatuses.includes('cancelled'))"
        f" || {GAVE_UP}",
        300,
        "the answer interrupted",
    )
    state = page_state(driver, "window.demo.talk")
    assert state["errors"] == [], state
    assert page_state(driver, "window.testMic.spoken") == 2

    # The server confirms the truncation the page sent: the item and the milliseconds heard.
    (sent,) = state["truncations"]
    (confirmed,) = state["truncated"]
    assert confirmed["item_id"] == sent["item_id"]
    assert confirmed["audio_end_ms"] == sent["audio_end_ms"]
    # what was heard is a part of what had been scheduled when the user spoke...
    assert HEARD_MS <= sent["audio_end_ms"] <= sent["scheduled_ms"]
    # ... and nothing more of that answer was scheduled after it
    assert state["secondsScheduledByItem"][sent["item_id"]] * 1000 == pytest.approx(sent["scheduled_ms"])
    assert state["responseStatuses"][0] == "cancelled"
    interrupted = page_state(driver, "[...document.querySelectorAll('#transcript li.interrupted')].length")
    assert interrupted == 1


# The page's own Player (talk.js) on the page's AudioContext, fed 100 ms chunks of pcm16 at a
# chosen pace: faster than real time they must play back to back, slower each late chunk is
# an underrun and starts later. Returns [start, duration] per chunk and the underruns counted.
PLAYER_AT_PACE = """
const [paceMs, count, done] = arguments;
(async () => {
  const { Player, talkState } = await import("/static/talk.js");
  const context = new AudioContext();
  const player = new Player(context);
  const item = `pace-${paceMs}`;
  const before = talkState.underruns;
  const chunk = new Uint8Array(2400 * 2); // 100 ms at 24 kHz
  const pushedAt = [];
  for (let i = 0; i < count; i++) {
    pushedAt.push(context.currentTime);
    player.push(item, chunk);
    await new Promise((r) => setTimeout(r, paceMs));
  }
  player.finish();
  const chunks = talkState.schedule.filter(([id]) => id === item).map(([, start, d]) => [start, d]);
  done({ chunks, pushedAt, underruns: talkState.underruns - before, state: context.state });
  context.close();
})().catch((e) => done({ error: String(e) }));
"""


@pytest.mark.parametrize("pace_ms, late", [(40, False), (250, True)])
def test_player_schedules_chunks_back_to_back(demo_server, open_browser, pace_ms, late):
    driver = open_browser()
    open_demo(driver, demo_server, "talk")
    driver.set_script_timeout(60)
    result = driver.execute_async_script(PLAYER_AT_PACE, pace_ms, 10)
    assert "error" not in result, result
    chunks = result["chunks"]
    assert len(chunks) == 10 and all(d == pytest.approx(0.1) for _, d in chunks)
    steps = [start - (prev + d) for (prev, d), (start, _) in zip(chunks, chunks[1:])]
    assert all(step >= -1e-9 for step in steps), steps  # never overlapping
    gaps = sum(1 for step in steps if step > 1e-6)
    assert gaps == result["underruns"], (steps, result["underruns"])
    # a chunk that came while the one before it was still to play starts exactly at its end
    # (timers run late on a busy machine: what counts is when each chunk really came)
    early = [i for i in range(1, 10) if result["pushedAt"][i] < chunks[i - 1][0] + chunks[i - 1][1] - 0.01]
    assert all(steps[i - 1] == 0 for i in early), (early, steps)
    if late:  # each came after the one before had played out: rebuffer 120 ms (2 chunks), play
        assert result["underruns"] >= 3, result
    else:  # most while the one before still played: one seamless stream
        assert len(early) >= 5, result
