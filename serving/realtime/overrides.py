"""`response.create`'s `response` object: per-response overrides of the session's
configuration, and an optional `input` that replaces the conversation as the prompt."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnistage.serving.realtime.audio import AudioFormat
from omnistage.serving.realtime.config import SessionConfig, first_given
from omnistage.serving.realtime.conversation import Conversation, item_from_client
from omnistage.serving.realtime.events import ProtocolError, first_problem
from omnistage.serving.realtime.response import ResponsePlan


class _Output(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Any = None
    voice: str | None = Field(default=None, min_length=1)


class _Audio(BaseModel):
    model_config = ConfigDict(extra="forbid")
    output: _Output | None = None


class ResponseOverrides(BaseModel):
    model_config = ConfigDict(extra="forbid")
    output_modalities: list[Literal["text", "audio"]] | None = Field(default=None, min_length=1)
    modalities: list[Literal["text", "audio"]] | None = Field(default=None, min_length=1)  # beta
    instructions: str | None = None
    audio: _Audio | None = None
    voice: str | None = Field(default=None, min_length=1)  # beta
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
        param, message = first_problem(exc, "response")
        raise ProtocolError(message, "invalid_value", param) from None
    if o.tools:
        raise ProtocolError("tools (function calling) are not supported", "unsupported_value", "response.tools")
    modalities = o.output_modalities or o.modalities  # neither can be empty
    speaks = ("audio" in modalities) if modalities else config.speaks
    output = o.audio.output if o.audio and o.audio.output else None
    fmt = config.output_format
    param, given = first_given(
        ("response.audio.output.format", output.format if output else None),
        ("response.output_audio_format", o.output_audio_format),
    )
    if given is not None:
        try:
            fmt = AudioFormat.parse(given)
        except ValueError as exc:
            raise ProtocolError(str(exc), "invalid_value", param) from None
    voice = (output.voice if output else None) or o.voice or config.voice  # none can be ""
    param, limit = first_given(
        ("response.max_output_tokens", o.max_output_tokens),
        ("response.max_response_output_tokens", o.max_response_output_tokens),
    )
    if isinstance(limit, int) and limit < 1:
        raise ProtocolError(f"{param} must be >= 1 or 'inf'", "invalid_value", param)
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
            where = f"response.input[{i}]"
            if entry.get("type") == "item_reference":
                raise ProtocolError("item references are not supported", "unsupported_value", where)
            items.add(item_from_client(entry, config.input_format, where), where=where)
    return plan, items
