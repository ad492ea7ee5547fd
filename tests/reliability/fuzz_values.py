"""What the fuzz tests send and how the HTTP ones judge the answer (shared by
tests/reliability/test_fuzz_api.py, tests/api/test_speech_fuzz.py and
tests/reliability/test_fuzz_realtime.py)."""

from __future__ import annotations

import json
import re

import httpx
from hypothesis import strategies as st

# any JSON value a client could put in a field
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),  # JSON has neither
    st.text(max_size=12),
    st.lists(st.text(max_size=5), max_size=6),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)

# pydantic's location of a union member ("voice.str"), which is not a field a client sent
UNION_MEMBER = re.compile(r"\.(str|int|float|bool|list|dict)(\.|\[|$)|literal\[")

# A valid but large value is not abuse, only slow: capped at these.
CAPS = {
    "max_tokens": 64,
    "max_completion_tokens": 64,
    "n": 4,
    "best_of": 4,
    "num_inference_steps": 4,
    "partial_images": 2,
    "max_new_tokens": 64,
    "max_output_tokens": 16,  # realtime: a spoken answer costs more per token
    "max_response_output_tokens": 16,
}


def capped(values: dict) -> dict:
    """`values` with each capped field at most its cap: integers, and digit strings (a form
    field, or a JSON string pydantic reads as a number)."""
    out = dict(values)
    for key, value in values.items():
        if key not in CAPS:
            continue
        if type(value) is int:
            out[key] = min(value, CAPS[key])
        # isdecimal, not isdigit: "²" is a digit that int() refuses
        elif isinstance(value, str) and value.lstrip("-").isdecimal() and int(value) > CAPS[key]:
            out[key] = str(CAPS[key])
    return out


def asks_to_stream(value) -> bool:
    """Whether the routes' `stream: bool` field reads `value` as true: pydantic's lax booleans
    take 1, "true", "yes", "on", ... as well as True."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(value) is True
    except ValidationError:
        return False


def assert_served_or_named_400(
    r: httpx.Response, sent, *, streamed: bool, result_key: str | None, final_event: str | None = None
) -> None:
    """A 400 invalid_request_error naming a field (not pydantic's union member), or a 200
    holding the result: a stream whose last event is `final_event` ("[DONE]", or the `type` of
    the last JSON event) with no error event; else the JSON's `result_key`, or a non-empty
    body when that is None."""
    assert r.status_code in (200, 400), (sent, r.status_code, r.text[:500])
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"] and error["param"], (sent, error)
        assert not UNION_MEMBER.search(error["param"]), error  # a field, not pydantic's union member
    elif streamed:
        assert r.headers["content-type"].startswith("text/event-stream"), (sent, r.text[:300])
        last = r.text.rstrip().rsplit("\n\n", 1)[-1]
        data = next(line[len("data: ") :] for line in last.splitlines() if line.startswith("data: "))
        assert data == final_event if final_event == "[DONE]" else json.loads(data)["type"] == final_event, (
            sent,
            last[:300],
        )
        assert '"error"' not in r.text, (sent, r.text[-500:])
    elif result_key is None:
        assert r.content, (sent, r.headers)
    else:
        assert r.json()[result_key], (sent, r.text[:300])
