"""`response.create`'s `response` object: per-response overrides of the session's
configuration, and an optional `input` that replaces the conversation as the prompt."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnistage.serving.realtime.audio import AudioFormat
from omnistage.serving.realtime.config import SessionConfig
from omnistage.serving.realtime.conversation import Conversation, item_from_client
from omnistage.serving.realtime.events import ProtocolError
from omnistage.serving.realtime.response import ResponsePlan


class _Output(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Any = None
    voice: str | None = None


class _Audio(BaseModel):
    model_config = ConfigDict(extra="forbid")
    output: _Output | None = None


class ResponseOverrides(BaseModel):
    model_config = ConfigDict(extra="forbid")
    output_modalities: list[Literal["text", "audio"]] | None = None
    modalities: list[Literal["text", "audio"]] | None = None  # beta
    instructions: str | None = None
    audio: _Audio | None = None
    voice: str | None = None  # beta
    output_audio_format: str | None = None  # beta
    max_output_tokens: int | Literal["inf"] | None = None
    max_response_output_tokens: int | Literal["inf"] | None = None  # beta
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    conversation: Literal["auto", "none"] | None = None
    input: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    prompt: Any = None


def response_plan(config: SessionConfig, raw: dict[str, Any], salt: str) -> tuple[ResponsePlan, Conversation | None]:
    try:
        o = ResponseOverrides.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in ("response", *first["loc"]))
        raise ProtocolError(f"{param}: {first['msg']}", "invalid_value", param) from None
    if o.tools:
        raise ProtocolError("tools (function calling) are not supported", "unsupported_value", "response.tools")
    modalities = o.output_modalities or o.modalities
    speaks = ("audio" in modalities) if modalities else config.speaks
    fmt = config.output_format
    given = (o.audio.output.format if o.audio and o.audio.output else None) or o.output_audio_format
    if given is not None:
        try:
            fmt = AudioFormat.parse(given)
        except ValueError as exc:
            raise ProtocolError(str(exc), "invalid_value", "response.audio.output.format") from None
    voice = (o.audio.output.voice if o.audio and o.audio.output else None) or o.voice or config.voice
    limit = o.max_output_tokens if o.max_output_tokens is not None else o.max_response_output_tokens
    if isinstance(limit, int) and limit < 1:
        raise ProtocolError("max_output_tokens must be >= 1 or 'inf'", "invalid_value", "response.max_output_tokens")
    plan = ResponsePlan(
        speaks=speaks,
        output_format=fmt,
        voice=voice,
        max_output_tokens=config.max_output_tokens if limit is None else (None if limit == "inf" else limit),
        temperature=o.temperature if o.temperature is not None else config.temperature,
        cache_salt=salt,
        seed=config.seed,
        instructions=o.instructions if o.instructions is not None else config.instructions,
        conversation=o.conversation or "auto",
        metadata=o.metadata,
    )
    items = None
    if o.input is not None:
        items = Conversation()
        for i, entry in enumerate(o.input):
            if entry.get("type") == "item_reference":
                raise ProtocolError("item references are not supported", "unsupported_value", f"response.input[{i}]")
            items.add(item_from_client(entry, config.input_format))
    return plan, items
