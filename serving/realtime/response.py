"""One response of a realtime session: the pipeline request built from the conversation, and
its output streamed back as GA events, from `response.created` to `response.done`.

`ResponseRunner.cancel` (barge-in, `response.cancel`, a vanished client) stops the pipeline
stream, which aborts the request in every stage (KV blocks freed, talker and token2wav stop);
no delta leaves after that, and `response.done` reports `cancelled`. Only the streaming part
is ever cancelled: a response whose `response.created` was sent always ends with its
`response.done`, also when the cancel comes before it started or while its last events go
out.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.errors import InvalidRequestError, OmnistageError
from omnistage.serving.realtime.audio import SESSION_RATE, AudioFormat
from omnistage.serving.realtime.conversation import ContentPart, Item
from omnistage.serving.realtime.early import SubmittedStream
from omnistage.serving.realtime.events import new_id, server_event

log = logging.getLogger("omnistage.serving.realtime")

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class ResponsePlan:
    """What one response asks of the pipeline (the session's config with the response's overrides)."""

    speaks: bool
    output_format: AudioFormat
    voice: str | None
    max_output_tokens: int | None
    temperature: float | None
    cache_salt: str
    seed: int | None = None
    instructions: str = ""
    conversation: str = "auto"  # "none": the answer is not added to the conversation
    metadata: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    audio: list[dict[str, Any]] = field(default_factory=list)

    def with_prompt(self, messages: list[dict[str, Any]], audio: list[dict[str, Any]]) -> ResponsePlan:
        return dataclasses.replace(self, messages=messages, audio=audio)


@dataclass
class ResponseState:
    id: str = field(default_factory=lambda: new_id("resp"))
    status: str = "in_progress"
    reason: str | None = None
    error: dict[str, Any] | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    audio_chunks: list[np.ndarray] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    first_audio_at: float | None = None

    @property
    def audio_ms(self) -> int:
        return sum(len(c) for c in self.audio_chunks) * 1000 // SESSION_RATE


class ResponseRunner:
    def __init__(self, served: Any, plan: ResponsePlan, item: Item, send: Send):
        self.served, self.plan, self.item, self.send = served, plan, item, send
        self.state = ResponseState()
        self.task: asyncio.Task | None = None
        self.previous_item_id: str | None = None
        self._cancelled = False
        self._streaming: asyncio.Task | None = None
        self._submitted: SubmittedStream | None = None
        self._output = plan.output_format.output_stream()

    def submit(self) -> None:
        """Starts the request in the stages before `run` (a preemptive response); its output
        waits for `run`, or `discard` aborts it."""
        inputs, params = self._inputs_and_params()
        self._submitted = SubmittedStream(self.served.pipeline.stream(inputs, params, request_id=self.state.id))

    def submit_failed(self) -> bool:
        return self._submitted is not None and self._submitted.failed()

    async def discard(self) -> None:
        """Aborts a submitted request that will never run (nothing was sent of it)."""
        if self._submitted is not None:
            await self._submitted.aclose()

    def cancel(self, reason: str) -> None:
        """Stops the deltas (a cancel after the stream ended changes nothing); `run` still
        sends the closing events, so the caller awaits `task` for `response.done`."""
        if self._cancelled or (self._streaming is not None and self._streaming.done()):
            return
        self._cancelled = True
        self.state.reason = self.state.reason or reason
        if self._streaming is not None:
            self._streaming.cancel()

    # -- pipeline request ------------------------------------------------------------------
    def _inputs_and_params(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        served, plan = self.served, self.plan
        inputs: dict[str, Any] = {served.port("messages"): plan.messages}
        if plan.audio:
            inputs[served.port("audio_in")] = plan.audio
        fields: dict[str, Any] = {"cache_salt": plan.cache_salt}
        if plan.max_output_tokens is not None:
            fields["max_tokens"] = plan.max_output_tokens
        if plan.temperature is not None:
            fields["temperature"] = plan.temperature
        if plan.seed is not None:
            fields["seed"] = plan.seed
        if served.port("audio") is not None:
            fields["modalities"] = ["text", "audio"] if plan.speaks else ["text"]
        params = served.stage_params(fields)
        speech = {k: v for k, v in (("voice", plan.voice), ("seed", plan.seed)) if v is not None}
        if plan.speaks and speech and served.serve.speech_params:
            for stage, values in served.stage_params(speech, served.serve.speech_params).items():
                params.setdefault(stage, {}).update(values)
        return inputs, params

    def resource(self) -> dict[str, Any]:
        s = self.state
        usage = _usage(s.usage)
        return {
            "id": s.id,
            "object": "realtime.response",
            "status": s.status,
            "status_details": _status_details(s),
            "output": [self.item.as_dict()] if s.status != "in_progress" else [],
            "conversation_id": None if self.plan.conversation == "none" else "conv_default",
            "output_modalities": ["audio" if self.plan.speaks else "text"],
            "max_output_tokens": self.plan.max_output_tokens or "inf",
            "audio": {"output": {"format": self.plan.output_format.as_dict(), "voice": self.plan.voice}},
            "usage": usage if s.status != "in_progress" else None,
            "metadata": self.plan.metadata,
        }

    # -- the events ------------------------------------------------------------------------
    async def run(self) -> None:
        """Streams the response; returns after `response.done` was sent (also when cancelled)."""
        s, item = self.state, self.item
        part = ContentPart("output_audio", transcript="") if self.plan.speaks else ContentPart("output_text", text="")
        item.content, item.status = [part], "in_progress"
        ids = {"response_id": s.id, "item_id": item.id, "output_index": 0}
        try:
            await self._start(ids)
            if self._cancelled:
                raise asyncio.CancelledError
            self._streaming = asyncio.ensure_future(self._stream(ids))
            await self._streaming
            s.status = "completed" if s.usage.get("finish_reason") != "length" else "incomplete"
            s.reason = "max_output_tokens" if s.status == "incomplete" else None
        except asyncio.CancelledError:
            s.status = "cancelled"
            s.reason = s.reason or "client_cancelled"
        except OmnistageError as err:
            s.status, s.error = "failed", {"type": _error_type(err), "code": err.code, "message": str(err)}
        except Exception:  # noqa: BLE001 - a fault of ours still ends the response: the client waits for its done
            log.exception("realtime response %s failed", s.id)
            s.status, s.error = "failed", {"type": "server_error", "code": "server_error", "message": "internal error"}
        await self.discard()  # a submitted stream cancelled before it was read: aborted here
        await self._finish(ids, part)

    async def _start(self, ids: dict[str, Any]) -> None:
        s, item = self.state, self.item
        await self.send(server_event("response.created", response=self.resource()))
        await self.send(
            server_event("response.output_item.added", response_id=s.id, output_index=0, item=item.as_dict())
        )
        if self.plan.conversation != "none":
            previous = self.previous_item_id
            await self.send(server_event("conversation.item.added", previous_item_id=previous, item=item.as_dict()))
        part_shape = {"type": "audio", "transcript": ""} if self.plan.speaks else {"type": "text", "text": ""}
        await self.send(server_event("response.content_part.added", **ids, content_index=0, part=part_shape))

    async def _stream(self, ids: dict[str, Any]) -> None:
        roles = ("text", "audio", "info", "speech_info")
        text_port, audio_port, info_port, speech_port = (self.served.port(r) for r in roles)
        kind = "response.output_audio_transcript.delta" if self.plan.speaks else "response.output_text.delta"
        if self._submitted is None:
            self.submit()
        stream = self._submitted
        try:
            async for chunk in stream:
                if chunk.data is None:
                    continue
                if chunk.port == text_port and chunk.data:
                    self.state.text.append(chunk.data)
                    await self.send(server_event(kind, **ids, content_index=0, delta=chunk.data))
                elif chunk.port == audio_port and self.plan.speaks and len(chunk.data):
                    await self._audio_delta(ids, chunk.data)
                elif chunk.port == info_port:
                    self.state.usage.update(chunk.data.get("usage", {}), finish_reason=chunk.data.get("finish_reason"))
                elif chunk.port == speech_port and speech_port is not None:
                    self.state.usage["codec_tokens"] = (chunk.data.get("usage") or {}).get("codec_tokens", 0)
        finally:
            await stream.aclose()

    async def _audio_delta(self, ids: dict[str, Any], data: Any) -> None:
        samples = np.asarray(data.detach().cpu() if hasattr(data, "detach") else data, dtype=np.float32).reshape(-1)
        self.state.audio_chunks.append(samples)
        if self.state.first_audio_at is None:
            self.state.first_audio_at = asyncio.get_running_loop().time()
        await self._send_audio(ids, self._output.push(samples))

    async def _send_audio(self, ids: dict[str, Any], samples: np.ndarray) -> None:
        """Samples at the output format's rate as one delta (none while the resampler holds them)."""
        if len(samples):
            delta = base64.b64encode(self.plan.output_format.from_samples(samples)).decode("ascii")
            await self.send(server_event("response.output_audio.delta", **ids, content_index=0, delta=delta))

    async def _finish(self, ids: dict[str, Any], part: ContentPart) -> None:
        s, item = self.state, self.item
        text = "".join(s.text)
        if self.plan.speaks:
            part.transcript = text
            part.samples = np.concatenate(s.audio_chunks) if s.audio_chunks else np.zeros(0, dtype=np.float32)
        else:
            part.text = text
        item.status = "completed" if s.status == "completed" else "incomplete"
        if s.status != "cancelled":  # a cancelled response stops its deltas at once
            if self.plan.speaks:
                await self._send_audio(ids, self._output.flush())  # the resampler's last samples
                await self.send(server_event("response.output_audio.done", **ids, content_index=0))
                done = "response.output_audio_transcript.done"
                await self.send(server_event(done, **ids, content_index=0, transcript=text))
            else:
                await self.send(server_event("response.output_text.done", **ids, content_index=0, text=text))
            shape = {"type": "audio", "transcript": text} if self.plan.speaks else {"type": "text", "text": text}
            await self.send(server_event("response.content_part.done", **ids, content_index=0, part=shape))
        await self.send(
            server_event("response.output_item.done", response_id=s.id, output_index=0, item=item.as_dict())
        )
        if self.plan.conversation != "none":
            await self.send(server_event("conversation.item.done", item=item.as_dict()))
        await self.send(server_event("response.done", response=self.resource()))


def _error_type(err: OmnistageError) -> str:
    """A stage refusing the request (a voice the model lacks) is the client's error, not the server's."""
    return "invalid_request_error" if isinstance(err, InvalidRequestError) else "server_error"


def _status_details(s: ResponseState) -> dict[str, Any] | None:
    if s.status == "cancelled":
        return {"type": "cancelled", "reason": s.reason}
    if s.status == "incomplete":
        return {"type": "incomplete", "reason": s.reason}
    if s.status == "failed":
        return {"type": "failed", "error": s.error}
    return None


def _usage(raw: dict[str, Any]) -> dict[str, Any]:
    """Realtime usage from the thinker's info (prompt audio positions counted apart) and the
    talker's (codec tokens: the spoken output, counted as OpenAI counts audio output tokens)."""
    prompt, text_out = int(raw.get("prompt_tokens", 0)), int(raw.get("completion_tokens", 0))
    audio_in, audio_out = int(raw.get("audio_tokens") or 0), int(raw.get("codec_tokens") or 0)
    return {
        "total_tokens": prompt + text_out + audio_out,
        "input_tokens": prompt,
        "output_tokens": text_out + audio_out,
        "input_token_details": {
            "cached_tokens": int(raw.get("cached_tokens") or 0),
            "text_tokens": prompt - audio_in,
            "audio_tokens": audio_in,
        },
        "output_token_details": {"text_tokens": text_out, "audio_tokens": audio_out},
    }
