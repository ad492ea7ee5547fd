"""Realtime events: the client events a session takes (pydantic models, checked on arrival)
and the framing of the server events it sends.

Client events carry their GA names; the beta names that differ are accepted as aliases.
Server events leave with their GA names, or with the beta names when the client asked for
the beta protocol (`OpenAI-Beta: realtime=v1`). A client event that does not parse is answered
with an `error` event naming the problem; the session stays open.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnistage.serving.errors import loc_to_param


class ProtocolError(ValueError):
    """A client event the session refuses: answered with an `error` event."""

    def __init__(
        self, message: str, code: str = "invalid_value", param: str | None = None, event_id: str | None = None
    ):
        super().__init__(message)
        self.code, self.param, self.event_id = code, param, event_id


class ClientEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    event_id: str | None = None


class SessionUpdate(ClientEvent):
    session: dict[str, Any]


class AudioAppend(ClientEvent):
    audio: str


class AudioCommit(ClientEvent):
    pass


class AudioClear(ClientEvent):
    pass


class OutputAudioClear(ClientEvent):
    pass


class ItemCreate(ClientEvent):
    previous_item_id: str | None = None
    item: dict[str, Any]


class ItemRetrieve(ClientEvent):
    item_id: str


class ItemDelete(ClientEvent):
    item_id: str


class ItemTruncate(ClientEvent):
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ResponseCreate(ClientEvent):
    response: dict[str, Any] | None = None


class ResponseCancel(ClientEvent):
    response_id: str | None = None


CLIENT_EVENTS: dict[str, type[ClientEvent]] = {
    "session.update": SessionUpdate,
    "input_audio_buffer.append": AudioAppend,
    "input_audio_buffer.commit": AudioCommit,
    "input_audio_buffer.clear": AudioClear,
    "output_audio_buffer.clear": OutputAudioClear,
    "conversation.item.create": ItemCreate,
    "conversation.item.retrieve": ItemRetrieve,
    "conversation.item.truncate": ItemTruncate,
    "conversation.item.delete": ItemDelete,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
}
CLIENT_ALIASES = {"transcription_session.update": "session.update"}

# GA server event name -> the beta protocol's name (where they differ)
BETA_SERVER_NAMES = {
    "conversation.item.added": "conversation.item.created",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
}
BETA_ONLY_SKIPPED = {"conversation.item.done"}  # no beta counterpart


def parse_client_event(raw: str | bytes) -> ClientEvent:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the message is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise ProtocolError("an event is a JSON object with a 'type'", "invalid_event")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("the event has no 'type'", "invalid_event", "type", event_id)
    kind = CLIENT_ALIASES.get(kind, kind)
    model = CLIENT_EVENTS.get(kind)
    if model is None:
        known = ", ".join(CLIENT_EVENTS)
        raise ProtocolError(f"unknown event type {kind!r} (known: {known})", "invalid_event_type", "type", event_id)
    try:
        return model.model_validate({**data, "type": kind})
    except ValidationError as exc:
        param, message = first_problem(exc)
        raise ProtocolError(f"{kind}: {message}", "invalid_value", param, event_id) from None


def first_problem(exc: ValidationError, *root: str) -> tuple[str | None, str]:
    """(param, message) for pydantic's first complaint; the param names the client's field
    ("session.output_modalities[0]"), never pydantic's union member ("max_output_tokens.int")."""
    first = exc.errors()[0]
    param = loc_to_param((*root, *first["loc"])) or (root[0] if root else None)
    return param, f"{param}: {first['msg']}" if param else first["msg"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(err: ProtocolError, kind: Literal["invalid_request_error", "server_error"] = "invalid_request_error"):
    detail = {"type": kind, "code": err.code, "message": str(err), "param": err.param, "event_id": err.event_id}
    return server_event("error", error=detail)


def beta_names(event: dict[str, Any]) -> dict[str, Any] | None:
    """The event as the beta protocol names it (None: the beta protocol has no such event)."""
    kind = event["type"]
    if kind in BETA_ONLY_SKIPPED:
        return None
    if kind in BETA_SERVER_NAMES:
        return {**event, "type": BETA_SERVER_NAMES[kind]}
    return event
