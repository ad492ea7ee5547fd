"""The demo's "Talk" tab in headless Chromium against a live `omnistage serve tiny-omni`: a
fake microphone plays a spoken sentence once (tests/fixtures/speech-browser.wav, espeak-ng),
the page streams it over WS /v1/realtime, the server's VAD (silero) finds the turn, and the
answer's audio and transcript come back and are scheduled for playback.

Judges: silero in the server hears speech in what the page sent; the AudioContext clock
times the page's 24 kHz output; the server's *.done events state the whole transcript."""

from __future__ import annotations

import pytest

from omnistage.tests.browser.conftest import SPEECH, open_demo, page_state, save_screenshot, wait_for

pytestmark = pytest.mark.timeout(600)

RATE = 24000
FRAME_BYTES = 480 * 2  # 20 ms of pcm16 at 24 kHz


def test_spoken_turn_is_answered_with_audio_and_transcript(omni_server, open_browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = open_browser(fake_audio=SPEECH)
    open_demo(driver, omni_server, "talk")
    Select(driver.find_element(By.ID, "talk-model")).select_by_value("tiny-omni")
    driver.find_element(By.ID, "talk-start").click()
    wait_for(driver, "window.demo.talk.responsesDone >= 1", 300, "a spoken answer")
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

    # The live transcript is the server's whole transcript, and the page shows it.
    assert state["transcript"] and state["transcript"] == "".join(state["transcriptsDone"])
    shown = page_state(driver, "[...document.querySelectorAll('#transcript li.assistant')].map(li => li.textContent)")
    assert "".join(shown) == state["transcript"]
