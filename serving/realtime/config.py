"""The session configuration: what `session.update` may set, in the GA shape (nested `audio`
block) or the beta one (flat `modalities`, `input_audio_format`, `turn_detection`, ...), and
what `session.created` / `session.updated` report (always the GA shape).

An update is checked whole before anything changes: a bad field is an `error` event naming
it and the session keeps its previous configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnistage.serving.realtime.audio import AudioFormat
from omnistage.serving.realtime.events import first_problem
from omnistage.serving.realtime.vad import VadSettings
from omnistage.stages.params import MAX_SEED

Modality = Literal["text", "audio"]


class ConfigError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TurnDetectionIn(_Strict):
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    prefix_padding_ms: int | None = Field(default=None, ge=0, le=5000)
    silence_duration_ms: int | None = Field(default=None, ge=32, le=10_000)
    idle_timeout_ms: int | None = Field(default=None, ge=1000, le=600_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    eagerness: str | None = None


class AudioInputIn(_Strict):
    format: Any = None
    turn_detection: TurnDetectionIn | None = None  # null (sent) = manual commit; absent = unchanged
    transcription: Any = None
    noise_reduction: Any = None


class AudioOutputIn(_Strict):
    format: Any = None
    voice: str | None = Field(default=None, min_length=1)
    speed: float | None = Field(default=None, gt=0)


class AudioIn(_Strict):
    input: AudioInputIn | None = None
    output: AudioOutputIn | None = None


class SessionIn(_Strict):
    """GA fields, then the beta names accepted beside them."""

    type: Literal["realtime"] | None = None
    model: str | None = None
    output_modalities: list[Modality] | None = Field(default=None, min_length=1)
    instructions: str | None = None
    audio: AudioIn | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    tracing: Any = None
    truncation: Any = None
    include: list[str] | None = None
    prompt: Any = None
    # beta
    modalities: list[Modality] | None = Field(default=None, min_length=1)
    voice: str | None = Field(default=None, min_length=1)
    input_audio_format: str | None = None
    output_audio_format: str | None = None
    turn_detection: TurnDetectionIn | None = None
    input_audio_transcription: Any = None
    max_response_output_tokens: int | Literal["inf"] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    # omnistage's extension: a seeded session answers reproducibly (every stage's sampling and noise)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)


@dataclass(frozen=True)
class TurnDetection:
    vad: VadSettings = field(default_factory=VadSettings)
    idle_timeout_ms: int | None = None
    create_response: bool = True
    interrupt_response: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.vad.threshold,
            "prefix_padding_ms": self.vad.prefix_padding_ms,
            "silence_duration_ms": self.vad.silence_duration_ms,
            "idle_timeout_ms": self.idle_timeout_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }

    def updated(self, new: TurnDetectionIn, param: str) -> TurnDetection:
        if new.type != "server_vad":
            raise ConfigError("only server_vad turn detection is supported", f"{param}.type")
        vad = VadSettings(
            threshold=self.vad.threshold if new.threshold is None else new.threshold,
            prefix_padding_ms=self.vad.prefix_padding_ms if new.prefix_padding_ms is None else new.prefix_padding_ms,
            silence_duration_ms=(
                self.vad.silence_duration_ms if new.silence_duration_ms is None else new.silence_duration_ms
            ),
        )
        return TurnDetection(
            vad=vad,
            idle_timeout_ms=new.idle_timeout_ms if "idle_timeout_ms" in new.model_fields_set else self.idle_timeout_ms,
            create_response=self.create_response if new.create_response is None else new.create_response,
            interrupt_response=self.interrupt_response if new.interrupt_response is None else new.interrupt_response,
        )


@dataclass(frozen=True)
class SessionConfig:
    output_modalities: tuple[str, ...] = ("audio",)
    instructions: str = ""
    input_format: AudioFormat = field(default_factory=AudioFormat)
    output_format: AudioFormat = field(default_factory=AudioFormat)
    voice: str | None = None
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    max_output_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None

    @property
    def speaks(self) -> bool:
        return "audio" in self.output_modalities

    def as_dict(self) -> dict[str, Any]:
        """The GA session object's configuration fields."""
        return {
            "type": "realtime",
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": self.input_format.as_dict(),
                    "turn_detection": self.turn_detection.as_dict() if self.turn_detection else None,
                    "transcription": None,
                    "noise_reduction": None,
                },
                "output": {"format": self.output_format.as_dict(), "voice": self.voice, "speed": 1.0},
            },
            "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
            "tools": [],
            "tool_choice": "auto",
            "tracing": None,
            "truncation": "disabled",  # the whole conversation is sent every turn
            "include": None,
            "prompt": None,
            "temperature": self.temperature,
            "seed": self.seed,
        }

    def updated(self, payload: Any) -> SessionConfig:
        """A new configuration with `payload` (a session.update's `session`) applied; raises ConfigError."""
        if not isinstance(payload, dict):
            raise ConfigError("session must be an object", "session")
        try:
            new = SessionIn.model_validate(payload)
        except ValidationError as exc:
            param, message = first_problem(exc, "session")
            raise ConfigError(message, param) from None
        if new.tools:
            raise ConfigError("tools (function calling) are not supported", "session.tools")
        changes: dict[str, Any] = {}
        modalities = new.output_modalities or new.modalities  # neither can be empty
        if modalities is not None:
            changes["output_modalities"] = _modalities(modalities)
        if new.instructions is not None:
            changes["instructions"] = new.instructions
        param, limit = first_given(
            ("session.max_output_tokens", new.max_output_tokens),
            ("session.max_response_output_tokens", new.max_response_output_tokens),
        )
        if limit is not None:
            if limit != "inf" and limit < 1:
                raise ConfigError(f"{param} must be >= 1 or 'inf'", param)
            changes["max_output_tokens"] = None if limit == "inf" else limit
        for key in ("temperature", "seed"):
            if getattr(new, key) is not None:
                changes[key] = getattr(new, key)
        changes.update(self._audio_changes(new))
        return dataclasses.replace(self, **changes)

    def _audio_changes(self, new: SessionIn) -> dict[str, Any]:
        changes: dict[str, Any] = {}
        audio_in = new.audio.input if new.audio else None
        audio_out = new.audio.output if new.audio else None
        for side, ga, beta in (
            ("input", audio_in.format if audio_in else None, new.input_audio_format),
            ("output", audio_out.format if audio_out else None, new.output_audio_format),
        ):
            param, value = first_given((f"session.audio.{side}.format", ga), (f"session.{side}_audio_format", beta))
            if value is not None:
                try:
                    changes[f"{side}_format"] = AudioFormat.parse(value)
                except ValueError as exc:
                    raise ConfigError(str(exc), param) from None
        voice = (audio_out.voice if audio_out else None) or new.voice  # neither can be ""
        if voice is not None:
            changes["voice"] = voice
        # null (sent) turns server VAD off; absent leaves it as it is
        if audio_in is not None and "turn_detection" in audio_in.model_fields_set:
            param, detection = "session.audio.input.turn_detection", audio_in.turn_detection
        elif "turn_detection" in new.model_fields_set:
            param, detection = "session.turn_detection", new.turn_detection
        else:
            return changes
        base = self.turn_detection or TurnDetection()
        changes["turn_detection"] = None if detection is None else base.updated(detection, param)
        return changes


def first_given(*named: tuple[str, Any]) -> tuple[str, Any]:
    """The first (param, value) whose value was sent: a field's GA name comes before its beta one."""
    for param, value in named:
        if value is not None:
            return param, value
    return named[0][0], None


def _modalities(values: list[str]) -> tuple[str, ...]:
    """GA asks for ["audio"] or ["text"]; beta's ["text", "audio"] means audio (with its transcript)."""
    return ("audio",) if "audio" in values else ("text",)
