"""The OpenAI Realtime websocket (/v1/realtime on tiny-omni, the shared server) fuzzed with
hypothesis, one session per example:

- `session.update` with up to 4 session fields (GA and beta names, the nested audio and
  turn_detection fields, unknown ones) set to arbitrary or near-valid values;
- `response.create` with arbitrary per-response overrides;
- `conversation.item.create` with arbitrary items and content parts.

Each event is answered within 10 s by what it asked for (`session.updated` showing the
accepted values, the item added, a response that ends) or by an `error` event of type
invalid_request_error whose `param` names a field that was sent (not pydantic's union
member); the socket never closes, the server logs no traceback, and a session that accepted
an update still answers a turn (a user text, a short answer in the session's modalities);
one that refused an event still answers the next."""

from __future__ import annotations

import asyncio
import copy
import json
import re

import pytest
import websockets
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from omnistage.serving.realtime.session import RealtimeSession
from omnistage.tests.realtime.conftest import connect, recv, send, until
from omnistage.tests.reliability.fuzz_values import UNION_MEMBER, anything, capped

WAIT_S = 10  # for the answer to one event
TURN_S = 60  # for a short answer on a slow machine
TEXT_TURN = {"max_output_tokens": 4, "output_modalities": ["text"]}  # the quickest answer
FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)

near_valid = st.sampled_from(
    ["text", ["text"], ["audio"], [], "inf", "nan", "", "pcm16", {"type": "audio/pcm"}, "server_vad", "Chelsie",
     "auto", 0, 1, -1, 0.5, 2.01, True, None, 2**63, [{"type": "function", "name": "f"}], {"model": "whisper-1"}]
)  # fmt: skip
value = st.one_of(anything, near_valid)


def one_of(*values) -> st.SearchStrategy:
    return st.sampled_from(values)


def mostly(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """3 draws in 4 from `plausible` (valid or just not), else an arbitrary or near-valid
    value: most updates of several fields then pass, so accepted ones are fuzzed too."""
    return st.integers(0, 3).flatmap(lambda i: plausible if i else value)


def some_fields(names: list[str], plausible: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """Up to 4 of `names`, each set to a value plausible for it or an arbitrary one."""
    keys = st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: mostly(plausible.get(k, value)) for k in ks}))


MODALITIES = one_of(["text"], ["audio"], ["text", "audio"], [], ["video"], ["text", "text"], "text")
VOICES = one_of("Chelsie", "Ethan", "alloy", "", "chelsie")
TOKENS = st.one_of(st.integers(-1, 5000), one_of("inf", "4", "infinite", 2**64))
FORMATS = one_of(
    "pcm16", "g711_ulaw", "g711_alaw", "pcm24", "audio/pcm",
    {"type": "audio/pcm", "rate": 16000}, {"type": "audio/pcm", "rate": 0}, {"type": "audio/pcm", "rate": 7999},
    {"type": "audio/pcm", "rate": 48000.0}, {"type": "audio/pcmu"}, {"type": "audio/pcma", "rate": 5},
    {"type": "audio/opus"}, {"rate": 24000}, {"type": "audio/pcm", "extra": 1},
)  # fmt: skip
TURN_DETECTION = one_of(
    None, {}, {"type": "server_vad"}, {"type": "semantic_vad", "eagerness": "low"},
    {"type": "server_vad", "threshold": 0.9, "silence_duration_ms": 200, "idle_timeout_ms": 5000},
    {"create_response": False, "interrupt_response": False}, {"threshold": "0.5"}, {"prefix_padding_ms": -1},
)  # fmt: skip
VAD = {
    "type": one_of("server_vad", "semantic_vad", "none"),
    "threshold": st.floats(-0.5, 1.5),
    "prefix_padding_ms": st.integers(-1, 6000),
    "silence_duration_ms": st.integers(0, 11_000),
    "idle_timeout_ms": st.one_of(st.none(), st.integers(0, 700_000)),
    "create_response": st.booleans(),
    "interrupt_response": st.booleans(),
    "eagerness": one_of("low", "medium", "high", "auto"),
}


# -- sending and judging ---------------------------------------------------------------------
def nested(paths: dict[str, object]) -> dict:
    """{"audio.output.voice": v} -> {"audio": {"output": {"voice": v}}}; a path under a
    parent that was given a non-object value is left out (the parent's value is the fuzz)."""
    out: dict = {}
    for path in sorted(paths, key=lambda p: p.count(".")):
        *parents, leaf = path.split(".")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                break
        else:
            node[leaf] = copy.deepcopy(paths[path])  # hypothesis's own values stay as drawn
    return out


async def answer(ws, sent: dict) -> dict:
    """The next event: the socket must stay open and answer in time."""
    try:
        return await recv(ws, WAIT_S)
    except TimeoutError:
        pytest.fail(f"no answer within {WAIT_S} s to {sent!r}")
    except websockets.ConnectionClosed as exc:
        pytest.fail(f"the socket closed ({exc}) after {sent!r}")


def names_sent(param: str, sent: dict) -> bool:
    """`param` ("session.audio.input.format", "response.input[0].role") is a path into `sent`,
    or names a field missing from an object that was sent (a required field left out)."""
    node: object = sent
    steps = re.findall(r"([^.\[\]]+)|\[(\d+)\]", param)
    for i, (name, index) in enumerate(steps):
        if index:
            if not isinstance(node, list) or int(index) >= len(node):
                return False
            node = node[int(index)]
        elif isinstance(node, dict) and name in node:
            node = node[name]
        else:
            return isinstance(node, dict) and i == len(steps) - 1
    return True


def assert_named_error(reply: dict, sent: dict) -> None:
    """An OpenAI Realtime `error`: invalid_request_error, a code and message, the client's
    event_id, and a param that is a field of the event sent."""
    assert reply["type"] == "error", (sent, reply)
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["code"] and error["message"], (sent, error)
    assert error["event_id"] == sent["event_id"], (sent, error)
    param = error["param"]
    assert param and not UNION_MEMBER.search(param) and names_sent(param, sent), (sent, error)


async def turn(ws, response: dict | None = None) -> dict:
    """A user text and a short response; its `response.done` (awaited, bounded)."""
    message = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    await send(ws, "conversation.item.create", item=message)
    await send(ws, "response.create", response=response or {"max_output_tokens": 4})
    seen: list = []
    try:
        done = await until(ws, "response.done", seen, timeout=TURN_S)
    except TimeoutError:
        pytest.fail(f"no response.done within {TURN_S} s: {seen[-3:]}")
    errors = [e for e in seen if e["type"] == "error"]
    assert not errors, errors
    assert_ended_well(done["response"])
    return done["response"]


async def after_a_user_text(ws, sent: dict) -> dict:
    """Add a user text to the conversation (so it is never empty), then send `sent`: its answer."""
    await send(ws, "conversation.item.create", item=HI)
    await until(ws, "conversation.item.done", timeout=WAIT_S)
    await ws.send(json.dumps(sent))
    reply = await answer(ws, sent)
    count(reply)
    return reply


async def still_answers(ws) -> None:
    """The session goes on after a refused event: a cheap event gets its answer."""
    await send(ws, "input_audio_buffer.clear")
    await until(ws, "input_audio_buffer.cleared", timeout=WAIT_S)


def assert_ended_well(response: dict) -> None:
    """Completed, or cut at the token limit; a failure only for the client's fault (such as a
    voice the model lacks), said so."""
    status, details = response["status"], response["status_details"]
    if status == "incomplete":
        assert details["reason"] == "max_output_tokens", response
    elif status == "failed":
        assert details["error"]["type"] == "invalid_request_error", response
    else:
        assert status == "completed", response


def run(server, scenario) -> None:
    """`scenario(ws)` in a new session; the server logs no traceback meanwhile."""
    start = server.log_path.stat().st_size

    async def main():
        async with connect(server, headers={}) as ws:
            assert (await recv(ws, WAIT_S))["type"] == "session.created"
            await scenario(ws)

    asyncio.run(main())
    with open(server.log_path, "rb") as log:
        log.seek(start)
        added = log.read().decode(errors="replace")
    assert "Traceback" not in added, added[-3000:]


def count(reply: dict) -> None:
    """Counts the answers by kind (and the param refused) for --hypothesis-show-statistics."""
    event(reply["type"] if reply["type"] != "error" else f"error {reply['error']['param']}")


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def same(sent, shown) -> bool:
    # pydantic reads "5" as 5 where a number is expected, as the HTTP routes do
    return shown == sent or (isinstance(sent, str) and number(sent) is not None and number(sent) == shown)


def modalities(sent, shown) -> bool:
    return bool(shown) and set(shown) <= set(sent)


BETA_FORMATS = {"pcm16": ("audio/pcm", 24000), "g711_ulaw": ("audio/pcmu", None), "g711_alaw": ("audio/pcma", None)}


def audio_format(sent, shown) -> bool:
    if isinstance(sent, str):
        kind, rate = BETA_FORMATS.get(sent, (None, None))
    else:
        kind = sent.get("type", "audio/pcm")
        rate = sent.get("rate") if kind == "audio/pcm" else None
    return shown["type"] == kind and (rate is None or shown["rate"] == rate)


VAD_FIELDS = ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms")


def turn_detection(sent, shown) -> bool:
    if sent is None:
        return shown is None  # null turns server VAD off
    given = {
        k: v
        for k, v in sent.items()
        if v is not None and k in (*VAD_FIELDS, "create_response", "interrupt_response", "type")
    }
    return shown is not None and all(same(v, shown[k]) for k, v in given.items())


# (where the session object shows a field, the names a client sets it by (GA, beta), the check)
SESSION_SHOWS = [
    (("instructions",), [("instructions",)], same),
    (("output_modalities",), [("output_modalities",), ("modalities",)], modalities),
    (("max_output_tokens",), [("max_output_tokens",), ("max_response_output_tokens",)], same),
    (("temperature",), [("temperature",)], same),
    (("seed",), [("seed",)], same),
    (("audio", "output", "voice"), [("audio", "output", "voice"), ("voice",)], same),
    (("audio", "input", "format"), [("audio", "input", "format"), ("input_audio_format",)], audio_format),
    (("audio", "output", "format"), [("audio", "output", "format"), ("output_audio_format",)], audio_format),
    (
        ("audio", "input", "turn_detection"),
        [("audio", "input", "turn_detection"), ("turn_detection",)],
        turn_detection,
    ),
]


def at(obj, path: tuple[str, ...]):
    """obj[path...], or KeyError when it is not there."""
    for name in path:
        if not isinstance(obj, dict) or name not in obj:
            raise KeyError(path)
        obj = obj[name]
    return obj


def assert_shows(sent: dict, shown: dict, table) -> None:
    """Each field sent (null means unchanged, except for turn_detection) is what `shown` says;
    given by both its GA and beta name, either may win."""
    for where, names, check in table:
        values = []
        for name in names:
            try:
                values.append(at(sent, name))
            except KeyError:
                continue
        if check is not turn_detection:
            values = [v for v in values if v is not None]
        if values:
            assert any(check(v, at(shown, where)) for v in values), (where, values, at(shown, where))


# -- session.update --------------------------------------------------------------------------
SESSION_FIELDS = [
    "type", "model", "instructions", "output_modalities", "modalities", "voice", "temperature", "seed",
    "max_output_tokens", "max_response_output_tokens", "tools", "tool_choice", "tracing", "truncation",
    "include", "prompt", "input_audio_format", "output_audio_format", "input_audio_transcription",
    "turn_detection", "turn_detection.type", "turn_detection.threshold", "turn_detection.prefix_padding_ms",
    "turn_detection.silence_duration_ms", "turn_detection.idle_timeout_ms", "turn_detection.create_response",
    "turn_detection.interrupt_response", "turn_detection.eagerness", "turn_detection.unknown_field",
    "audio", "audio.input", "audio.input.format", "audio.input.format.type", "audio.input.format.rate",
    "audio.input.turn_detection", "audio.input.turn_detection.type", "audio.input.turn_detection.threshold",
    "audio.input.turn_detection.silence_duration_ms", "audio.input.transcription", "audio.input.noise_reduction",
    "audio.output", "audio.output.format", "audio.output.voice", "audio.output.speed", "audio.output.unknown_field",
    "unknown_field",
]  # fmt: skip


SESSION_VALUES = {
    "type": one_of("realtime", "transcription"),
    "model": one_of("tiny-omni", "gpt-realtime"),
    "instructions": st.text(max_size=20),
    "output_modalities": MODALITIES,
    "modalities": MODALITIES,
    "voice": VOICES,
    "audio.output.voice": VOICES,
    "temperature": st.one_of(st.floats(-0.5, 2.5), one_of("0.7")),
    "seed": st.integers(-1, 2**64),
    "max_output_tokens": TOKENS,
    "max_response_output_tokens": TOKENS,
    "tools": one_of([], [{"type": "function", "name": "f", "parameters": {}}]),
    "tool_choice": one_of("auto", "none", "required"),
    "tracing": one_of("auto", None),
    "truncation": one_of("auto", "disabled"),
    "include": one_of([], ["item.input_audio_transcription.logprobs"]),
    "input_audio_format": FORMATS,
    "output_audio_format": FORMATS,
    "audio.input.format": FORMATS,
    "audio.output.format": FORMATS,
    "audio.input.format.type": one_of("audio/pcm", "audio/pcmu", "audio/pcma", "audio/opus"),
    "audio.input.format.rate": st.integers(0, 50_000),
    "input_audio_transcription": one_of(None, {"model": "whisper-1"}),
    "audio.input.transcription": one_of(None, {"model": "whisper-1"}),
    "audio.input.noise_reduction": one_of(None, {"type": "near_field"}),
    "turn_detection": TURN_DETECTION,
    "audio.input.turn_detection": TURN_DETECTION,
    **{f"turn_detection.{k}": v for k, v in VAD.items()},
    **{f"audio.input.turn_detection.{k}": v for k, v in VAD.items()},
    "audio.output.speed": st.floats(0, 2),
    "audio": one_of({}, {"input": {}}, {"output": {}}),
}


@settings(FUZZ, max_examples=60)
@given(some_fields(SESSION_FIELDS, SESSION_VALUES))
@example({"max_output_tokens": "many"})  # pydantic locates it at ("max_output_tokens", "int")
@example({"output_modalities": []})
@example({"output_modalities": ["video"]})  # pydantic locates it at ("output_modalities", 0)
@example({"max_response_output_tokens": 0})
@example({"turn_detection.type": "semantic_vad"})
@example({"audio.input.format": {"type": "audio/pcm", "rate": 0}})
@example({"voice": ""})
@example({"seed": 2**64})
@example({"voice": "Nobody"})
def test_session_update_is_applied_or_refused_naming_the_field(omni_server, drawn):
    session = nested(drawn)
    sent = {"type": "session.update", "event_id": "event_fuzz", "session": session}

    async def scenario(ws):
        await ws.send(json.dumps(sent))
        reply = await answer(ws, sent)
        count(reply)
        if reply["type"] == "error":
            assert_named_error(reply, sent)
            await still_answers(ws)
            return
        assert reply["type"] == "session.updated", (sent, reply)
        assert_shows(session, reply["session"], SESSION_SHOWS)
        await turn(ws)

    run(omni_server, scenario)


# -- response.create -------------------------------------------------------------------------
RESPONSE_FIELDS = [
    "output_modalities", "modalities", "instructions", "audio", "audio.output", "audio.output.format",
    "audio.output.voice", "audio.output.unknown_field", "voice", "output_audio_format", "max_output_tokens",
    "max_response_output_tokens", "temperature", "conversation", "input", "metadata", "tools", "tool_choice",
    "prompt", "unknown_field",
]  # fmt: skip
HI = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
RESPONSE_VALUES = {
    "output_modalities": MODALITIES,
    "modalities": MODALITIES,
    "instructions": st.text(max_size=20),
    "audio": one_of({}, {"output": {}}, {"output": {"voice": "Ethan"}}),
    "audio.output.format": FORMATS,
    "output_audio_format": FORMATS,
    "audio.output.voice": VOICES,
    "voice": VOICES,
    "max_output_tokens": TOKENS,
    "max_response_output_tokens": TOKENS,
    "temperature": st.floats(-0.5, 2.5),
    "conversation": one_of("auto", "none", "default"),
    "input": one_of([HI], [], [{"type": "item_reference", "id": "x"}], [{"role": ["user"]}], [5], [HI, HI]),
    "metadata": one_of({}, {"k": "v"}, {"k": 1}),
    "tools": one_of([], [{"type": "function", "name": "f"}]),
    "tool_choice": one_of("auto", "none"),
}
RESPONSE_SHOWS = [
    (("output_modalities",), [("output_modalities",), ("modalities",)], modalities),
    (("max_output_tokens",), [("max_output_tokens",), ("max_response_output_tokens",)], same),
    (("audio", "output", "voice"), [("audio", "output", "voice"), ("voice",)], same),
    (("audio", "output", "format"), [("audio", "output", "format"), ("output_audio_format",)], audio_format),
    (("metadata",), [("metadata",)], same),
]


def bounded(overrides: dict) -> dict:
    """A response's token limit capped ("inf" too): a long answer is not abuse, only slow."""
    out = capped(overrides)
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if out.get(key) == "inf":
            out[key] = 16
    return out


@settings(FUZZ, max_examples=30)
@given(some_fields(RESPONSE_FIELDS, RESPONSE_VALUES))
@example({"max_output_tokens": "many"})
@example({"input": [{"role": ["user"]}]})
@example({"input": [{"type": "message", "role": "tool", "content": []}]})
@example({"voice": "Nobody"})
def test_response_overrides_are_applied_or_refused_naming_the_field(omni_server, drawn):
    response = nested(bounded(drawn))
    if "max_output_tokens" not in response and "max_response_output_tokens" not in response:
        response["max_output_tokens"] = 4
    sent = {"type": "response.create", "event_id": "event_fuzz", "response": response}

    async def scenario(ws):
        reply = await after_a_user_text(ws, sent)
        if reply["type"] == "error":
            assert_named_error(reply, sent)
            await turn(ws, TEXT_TURN)  # the session goes on
            return
        assert reply["type"] == "response.created", (sent, reply)
        assert_shows(response, reply["response"], RESPONSE_SHOWS)
        try:
            done = await until(ws, "response.done", timeout=TURN_S)
        except TimeoutError:
            pytest.fail(f"no response.done within {TURN_S} s to {sent!r}")
        assert_ended_well(done["response"])

    run(omni_server, scenario)


# -- conversation.item.create ----------------------------------------------------------------
ITEM_FIELDS = ["type", "role", "content", "id", "status", "object", "unknown_field"]
PART_FIELDS = ["type", "text", "audio", "transcript", "unknown_field"]
PART_VALUES = {
    "type": one_of(
        "input_text", "input_audio", "text", "audio", "output_text", "output_audio", "image", ["input_text"]
    ),
    "text": st.text(max_size=10),
    "audio": one_of("", "AAAAAA==", "AAAA", "not base64!"),  # 4 bytes, 3 bytes (half a sample), not base64
    "transcript": st.one_of(st.text(max_size=10), one_of(None, 5)),
}
ITEM_VALUES = {
    "type": one_of("message", "function_call", None),
    "role": one_of("user", "assistant", "system", "tool", ["user"]),
    "content": st.lists(some_fields(PART_FIELDS, PART_VALUES), max_size=3),
    "id": one_of("item_1", "", 5),
    "status": one_of("completed", "incomplete"),
    "object": one_of("realtime.item"),
}


@settings(FUZZ, max_examples=100)
@given(
    some_fields(ITEM_FIELDS, ITEM_VALUES),
    one_of(None, None, None, "root", "item_missing", 5),
)
@example({"role": ["user"]}, None)
@example({"content": [{"type": ["input_text"]}]}, None)
@example({"role": "user", "content": [{"type": "input_audio", "audio": "AAAAAA==", "transcript": 5}]}, None)
@example({}, "item_missing")
def test_items_are_added_or_refused_naming_the_field(omni_server, drawn, previous):
    item = {**HI, **drawn}
    sent = {"type": "conversation.item.create", "event_id": "event_fuzz", "item": item}
    if previous is not None:
        sent["previous_item_id"] = previous

    async def scenario(ws):
        reply = await after_a_user_text(ws, sent)
        if reply["type"] == "error":
            assert_named_error(reply, sent)
        else:
            assert reply["type"] == "conversation.item.added", (sent, reply)
            added = reply["item"]
            assert added["role"] == item["role"] and len(added["content"]) == len(item["content"]), (sent, added)
            seen: list = []
            await send(ws, "conversation.item.retrieve", item_id=added["id"])
            await until(ws, "conversation.item.retrieved", seen, timeout=WAIT_S)
            assert [e["type"] for e in seen] == ["conversation.item.done"], (sent, seen)
        await turn(ws, TEXT_TURN)

    run(omni_server, scenario)


# -- a fault of the server's -----------------------------------------------------------------
def test_a_fault_in_one_event_is_its_error_and_the_session_goes_on(monkeypatch):
    """No fault is known (the fuzz above finds none): one is made, in-process, to check that
    it answers its event with a server_error and the next event is served."""

    async def fault(self, _event):
        raise RuntimeError("a bug")

    monkeypatch.setattr(RealtimeSession, "_session_update", fault)
    sent: list[dict] = []

    async def collect(event: dict) -> None:
        sent.append(event)

    async def main():
        session = RealtimeSession(served=None, send=collect, vad=None)
        await session.handle(json.dumps({"type": "session.update", "event_id": "e1", "session": {}}))
        await session.handle(json.dumps({"type": "input_audio_buffer.clear"}))

    asyncio.run(main())
    assert [e["type"] for e in sent] == ["error", "input_audio_buffer.cleared"], sent
    assert sent[0]["error"]["type"] == "server_error" and sent[0]["error"]["event_id"] == "e1", sent


def test_a_fault_in_a_response_still_ends_it_with_response_done(monkeypatch):
    """A response whose stream fails with an error that is not omnistage's own (a bug) ends
    with `response.done` (status failed, server_error): a client waiting for it is not left
    waiting for ever."""
    from omnistage.serving.realtime.response import ResponseRunner

    async def fault(self, _ids):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ResponseRunner, "_stream", fault)
    sent: list[dict] = []

    async def collect(event: dict) -> None:
        sent.append(event)

    async def main():
        session = RealtimeSession(served=None, send=collect, vad=None)
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        await session.handle(json.dumps({"type": "conversation.item.create", "item": item}))
        await session.handle(json.dumps({"type": "response.create"}))
        await asyncio.wait_for(session.response.task, 10)

    asyncio.run(main())
    done = [e for e in sent if e["type"] == "response.done"]
    assert len(done) == 1, [e["type"] for e in sent]
    response = done[0]["response"]
    assert response["status"] == "failed", response
    assert response["status_details"]["error"]["type"] == "server_error", response


def _text_turn_session(send) -> RealtimeSession:
    return RealtimeSession(served=None, send=send, vad=None)


async def _user_turn(session: RealtimeSession) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    await session.handle(json.dumps({"type": "conversation.item.create", "item": item}))


def test_a_cancel_while_a_response_sends_its_last_events_keeps_its_done(monkeypatch):
    """A barge-in that lands after the answer's stream ended, while its closing events are
    still going out (a loaded server), must not cut them: the client waits for the
    response's `response.done`. The response stays completed (nothing was left to stop)."""
    from omnistage.serving.realtime.response import ResponseRunner

    async def no_output(self, _ids):
        return None

    monkeypatch.setattr(ResponseRunner, "_stream", no_output)
    sent: list[dict] = []
    closing = asyncio.Event()
    release = asyncio.Event()

    async def slow_send(event: dict) -> None:
        sent.append(event)
        if event["type"] == "response.output_item.done":
            closing.set()
            await release.wait()  # the socket is slow: the barge-in arrives now

    async def main():
        session = _text_turn_session(slow_send)
        await _user_turn(session)
        await session.handle(json.dumps({"type": "response.create"}))
        await asyncio.wait_for(closing.wait(), 10)
        barge_in = asyncio.ensure_future(session.cancel_response("turn_detected"))
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.wait_for(barge_in, 10)

    asyncio.run(main())
    done = [e for e in sent if e["type"] == "response.done"]
    assert len(done) == 1, [e["type"] for e in sent]
    assert done[0]["response"]["status"] == "completed", done[0]["response"]


def test_a_response_cancelled_before_it_ran_still_starts_and_ends(monkeypatch):
    """`response.create` then `response.cancel` handled back to back (the response's task has
    not run yet): the client still gets `response.created` and then `response.done`
    (cancelled), as for any response it asked for, and the pipeline is never asked."""
    from omnistage.serving.realtime.response import ResponseRunner

    streamed = []

    async def record(self, _ids):
        streamed.append(self.state.id)

    monkeypatch.setattr(ResponseRunner, "_stream", record)
    sent: list[dict] = []

    async def collect(event: dict) -> None:
        sent.append(event)

    async def main():
        session = _text_turn_session(collect)
        await _user_turn(session)
        await session.handle(json.dumps({"type": "response.create"}))
        await session.handle(json.dumps({"type": "response.cancel"}))
        await asyncio.wait_for(session.response.task, 10)

    asyncio.run(main())
    kinds = [e["type"] for e in sent]
    assert "error" not in kinds, sent
    assert kinds.count("response.created") == 1 and kinds.count("response.done") == 1, kinds
    assert kinds.index("response.created") < kinds.index("response.done"), kinds
    done = next(e for e in sent if e["type"] == "response.done")["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled", done
    assert streamed == [], "a cancelled response must not reach the pipeline"
