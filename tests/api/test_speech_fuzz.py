"""POST /v1/audio/speech on tiny-omni with arbitrary values for its fields (hypothesis, the
shared server): each is answered with audio (or an SSE stream that ends with
`speech.audio.done` and carries no error) or a 400 invalid_request_error naming the field;
never a 5xx."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnistage.tests.reliability.fuzz_values import anything, assert_served_or_named_400

FIELDS = ["voice", "response_format", "speed", "stream_format", "instructions", "seed", "input", "unknown_field"]
value = st.one_of(
    anything,
    st.sampled_from(["Chelsie", "Ethan", "chelsie", "wav", "pcm", "mp3", "sse", "audio", 0.25, 4.0, 4.01, ""]),
)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.dictionaries(st.sampled_from(FIELDS), value, min_size=1, max_size=3))
@example({"stream_format": "sse", "response_format": "pcm"})
@example({"voice": "Nobody"})
@example({"voice": 5.5})  # pydantic locates it at ("voice", "str")
def test_speech_fields_are_served_or_refused_with_a_named_parameter(omni_server, fields):
    body = {"model": "tiny-omni", "input": "Hi.", "voice": "Chelsie", "response_format": "wav", "seed": 1, **fields}
    if isinstance(body.get("input"), str) and len(body["input"]) > 12:
        body["input"] = body["input"][:12]  # a valid long text is not abuse, only slow
    r = httpx.post(f"{omni_server.url}/v1/audio/speech", json=body, timeout=300)
    streamed = body.get("stream_format") == "sse"
    assert_served_or_named_400(r, fields, streamed=streamed, final_event="speech.audio.done", result_key=None)
    if r.status_code == 200 and not streamed:
        assert r.headers["content-type"].startswith("audio/"), (fields, r.headers)
