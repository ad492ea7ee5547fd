"""One realtime session: its configuration, conversation, input audio buffer, server VAD and
the response in progress; every client event lands in `handle`.

The session knows nothing of websockets: it sends server events (dicts) through the `send`
it was given and drives the pipeline like any other client (serving/realtime/response.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from omnistage.errors import OmnistageError
from omnistage.graph.inputs import check_params
from omnistage.serving.realtime import events as ev
from omnistage.serving.realtime.audio import AudioDataError, decode_b64
from omnistage.serving.realtime.buffer import MAX_BUFFER_S, MIN_COMMIT_MS, InputBuffer
from omnistage.serving.realtime.config import ConfigError, SessionConfig
from omnistage.serving.realtime.conversation import ContentPart, Conversation, Item, item_from_client
from omnistage.serving.realtime.early import DEFAULT_PAUSE_MS, EarlyResponse
from omnistage.serving.realtime.overrides import response_plan
from omnistage.serving.realtime.response import ResponseRunner
from omnistage.serving.realtime.vad import TurnDetector, VadBatcher, VadStream

log = logging.getLogger("omnistage.serving.realtime")
SESSION_TTL_S = 3600
MAX_APPEND_BYTES = 15 * 1024 * 1024
EARLY_GRACE_S = 2.0  # past silence_duration_ms, how long an early response waits for its turn's stop
KEEP_EARLY = frozenset({"input_audio_buffer.append", "conversation.item.retrieve"})  # events that change no answer


class RealtimeSession:
    def __init__(
        self,
        served: Any,
        send: Callable[[dict[str, Any]], Awaitable[None]],
        vad: VadBatcher,
        preemptive_ms: int | None = DEFAULT_PAUSE_MS,
        on_preemptive: Callable[[str], None] | None = None,
    ):
        """`preemptive_ms`: server VAD starts a turn's response after this much silence (None:
        only when the turn ends; serving/realtime/early.py); `on_preemptive` hears how each
        such start ended ("used" or "discarded")."""
        self.served, self.send, self.vad = served, send, vad
        self.preemptive_ms, self._on_preemptive = preemptive_ms, on_preemptive
        self._early: EarlyResponse | None = None
        self.id = ev.new_id("sess")
        self.created = int(time.time())
        self.config = SessionConfig()
        self.conversation = Conversation()
        self.buffer = InputBuffer()
        self.response: ResponseRunner | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._speech_item: str | None = None
        self._speech_start_ms = 0
        self._input = self.config.input_format.input_stream()  # appended packets, resampled as one stream
        self._reset_vad()
        self._handlers = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
            "output_audio_buffer.clear": self._output_clear,
            "conversation.item.create": self._item_create,
            "conversation.item.retrieve": self._item_retrieve,
            "conversation.item.truncate": self._item_truncate,
            "conversation.item.delete": self._item_delete,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
        }

    @property
    def cache_salt(self) -> str:
        """The thinker's prefix-cache salt: this session's turns share blocks, other sessions never do."""
        return f"realtime:{self.id}"

    def session_object(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.session",
            "model": self.served.name,
            "expires_at": self.created + SESSION_TTL_S,
            **self.config.as_dict(),
        }

    async def start(self) -> None:
        await self.send(ev.server_event("session.created", session=self.session_object()))

    async def handle(self, raw: str | bytes) -> None:
        """One client message; a refusal is an `error` event and the session goes on."""
        event_id = None
        try:
            event = ev.parse_client_event(raw)
            event_id = event.event_id
            if event.type not in KEEP_EARLY:  # it may change what the turn's response is
                await self._drop_early()
            await self._handlers[event.type](event)
        except ev.ProtocolError as err:
            err.event_id = err.event_id or event_id
            await self.send(ev.error_event(err))
        except Exception:
            # a fault of ours in one event is that event's error, not the end of the session
            log.exception("realtime session %s: event failed", self.id)
            err = ev.ProtocolError("the server failed to handle this event", "server_error", None, event_id)
            await self.send(ev.error_event(err, "server_error"))

    async def close(self) -> None:
        """The client is gone: stop the response (aborting it in every stage) and the timers."""
        self._cancel_idle()
        await self._drop_early()
        await self.cancel_response("client_cancelled")

    # -- session and input audio -----------------------------------------------------------
    async def _session_update(self, event: ev.SessionUpdate) -> None:
        try:
            new = self.config.updated(event.session)
        except ConfigError as exc:
            raise ev.ProtocolError(str(exc), "invalid_value", exc.param) from None
        if event.session.get("model") not in (None, self.served.name):
            raise ev.ProtocolError("the session's model cannot change", "invalid_value", "session.model")
        # the voice reaches the speech stages only when the session speaks (a text session may
        # carry a client's default voice it never uses)
        if new.speaks and (new.voice != self.config.voice or not self.config.speaks):
            self._check_voice(new.voice, event.session)
        format_changed = new.input_format != self.config.input_format
        vad_changed = format_changed or new.turn_detection != self.config.turn_detection
        self.config = new
        if format_changed:  # the old stream ends: its held-back samples join the buffer
            self.buffer.append(self._input.flush())
            self._input = new.input_format.input_stream()
        if vad_changed:
            self._reset_vad()
        await self.send(ev.server_event("session.updated", session=self.session_object()))

    def _check_voice(self, voice: str | None, session: dict) -> None:
        """A voice the speech stages would refuse is refused now, not at the next response."""
        stages = self.served.serve.speech_params
        if voice is None or not stages:
            return
        try:
            check_params(self.served.spec, self.served.stage_params({"voice": voice}, stages), queued=True)
        except OmnistageError as exc:
            output = (session.get("audio") or {}).get("output") or {}
            param = "session.audio.output.voice" if "voice" in output else "session.voice"
            raise ev.ProtocolError(str(exc), "invalid_value", param) from None

    def _reset_vad(self) -> None:
        td = self.config.turn_detection
        self._vad_stream = VadStream()
        self._detector = TurnDetector(td.vad, self.preemptive_ms) if td is not None else None
        self._vad_origin_ms = self.buffer.now_ms
        self._speech_item = None

    async def _append(self, event: ev.AudioAppend) -> None:
        if len(event.audio) > MAX_APPEND_BYTES * 4 // 3 + 4:
            raise ev.ProtocolError("an append carries at most 15 MiB of audio", "audio_too_large", "audio")
        try:
            samples = self._input.push(self.config.input_format.to_samples(decode_b64(event.audio)))
        except AudioDataError as exc:
            raise ev.ProtocolError(str(exc), "invalid_audio", "audio") from None
        if self.buffer.too_long():
            raise ev.ProtocolError(
                f"the input audio buffer holds over {MAX_BUFFER_S} s: commit or clear it", "buffer_too_long", "audio"
            )
        self.buffer.append(samples)
        if self._detector is None:
            return
        stream, detector = self._vad_stream, self._detector
        probs = await self.vad.probabilities(stream, samples)
        if detector is not self._detector:  # the configuration changed while the model ran
            return
        for turn in detector.feed(probs, self._vad_origin_ms):
            if turn.kind == "started":
                await self._speech_started(turn.ms)
            elif turn.kind == "paused":
                await self._speech_paused(turn.ms)
            elif turn.kind == "resumed":
                await self._drop_early()
            else:
                await self._speech_stopped(turn.ms)
        if not detector.speaking:
            self.buffer.keep_last(self.config.turn_detection.vad.prefix_padding_ms)

    async def _speech_started(self, audio_start_ms: int) -> None:
        self._cancel_idle()
        self._speech_item, self._speech_start_ms = ev.new_id("item"), audio_start_ms
        await self.send(
            ev.server_event(
                "input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=self._speech_item
            )
        )
        td = self.config.turn_detection
        if td is not None and td.interrupt_response:
            await self.cancel_response("turn_detected")

    async def _speech_paused(self, audio_end_ms: int) -> None:
        """The turn may end here: its response starts in the stages now, held from the client."""
        await self._drop_early()
        td = self.config.turn_detection
        if td is None or not td.create_response or self._responding():
            return
        samples = self.buffer.peek(self._speech_start_ms, audio_end_ms)
        turn = Item("user", [ContentPart("input_audio", samples=samples)], id=self._speech_item or ev.new_id("item"))
        try:
            runner = self._new_runner(None, [*self.conversation.items, turn])
            runner.submit()
        except Exception as exc:  # noqa: BLE001 - the stop starts it (and reports what is wrong) the usual way
            if not isinstance(exc, (ev.ProtocolError, OmnistageError)):
                log.exception("realtime session %s: an early response failed to start", self.id)
            return
        # a client that stops sending audio mid-pause gets neither a stop nor a resume: let go
        expiry = asyncio.get_running_loop().call_later(
            td.vad.silence_duration_ms / 1000 + EARLY_GRACE_S, lambda: asyncio.ensure_future(self._drop_early())
        )
        self._early = EarlyResponse(runner, self._speech_start_ms, audio_end_ms, self._context(), expiry)

    def _context(self) -> tuple:
        """What an early response's prompt was built on besides its audio span."""
        return tuple(item.id for item in self.conversation.items), self.buffer.start_sample

    async def _drop_early(self, outcome: str = "discarded") -> None:
        early, self._early = self._early, None
        if early is None:
            return
        early.expiry.cancel()
        if outcome == "discarded":
            await early.runner.discard()
        if self._on_preemptive is not None:
            self._on_preemptive(outcome)

    async def _speech_stopped(self, audio_end_ms: int) -> None:
        item_id = self._speech_item or ev.new_id("item")
        self._speech_item = None
        await self.send(
            ev.server_event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id)
        )
        start_ms, context, early = self._speech_start_ms, self._context(), self._early
        samples = self.buffer.take(start_ms, audio_end_ms)
        await self._add_user_audio(samples, item_id)
        td = self.config.turn_detection
        if td is not None and td.create_response and not self._responding():
            if early is not None and early.matches(start_ms, audio_end_ms, context) and early is self._early:
                await self._drop_early("used")
                self._launch(early.runner)
            else:
                await self._drop_early()
                await self._start_response(None)
        else:
            await self._drop_early()

    async def _add_user_audio(self, samples, item_id: str) -> None:
        previous = self.conversation.items[-1].id if self.conversation.items else None
        item = Item("user", [ContentPart("input_audio", samples=samples)], id=item_id)
        self.conversation.add(item)
        await self.send(ev.server_event("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id))
        await self.send(ev.server_event("conversation.item.added", previous_item_id=previous, item=item.as_dict()))
        await self.send(ev.server_event("conversation.item.done", previous_item_id=previous, item=item.as_dict()))

    async def _commit(self, event: ev.AudioCommit) -> None:
        if self.buffer.samples * 1000 < MIN_COMMIT_MS * 24_000:
            ms = self.buffer.samples * 1000 // 24_000
            raise ev.ProtocolError(
                f"buffer too small: {ms} ms of audio; a commit needs at least {MIN_COMMIT_MS} ms",
                "input_audio_buffer_commit_empty",
            )
        self.buffer.append(self._input.flush())  # the stream of this item ends here
        await self._add_user_audio(self.buffer.take(), self._speech_item or ev.new_id("item"))
        self._speech_item = None

    async def _clear(self, event: ev.AudioClear) -> None:
        self.buffer.clear()
        self._input.reset()
        await self.send(ev.server_event("input_audio_buffer.cleared"))

    async def _output_clear(self, event: ev.OutputAudioClear) -> None:
        await self.cancel_response("client_cancelled")
        await self.send(ev.server_event("output_audio_buffer.cleared", response_id=None))

    # -- conversation ----------------------------------------------------------------------
    async def _item_create(self, event: ev.ItemCreate) -> None:
        item = item_from_client(event.item, self.config.input_format)
        previous = self.conversation.add(item, event.previous_item_id)
        await self.send(ev.server_event("conversation.item.added", previous_item_id=previous, item=item.as_dict()))
        await self.send(ev.server_event("conversation.item.done", previous_item_id=previous, item=item.as_dict()))

    async def _item_retrieve(self, event: ev.ItemRetrieve) -> None:
        item = self.conversation.get(event.item_id)
        fmt = self.config.output_format if item.role == "assistant" else self.config.input_format
        await self.send(ev.server_event("conversation.item.retrieved", item=item.as_dict(fmt)))

    async def _item_truncate(self, event: ev.ItemTruncate) -> None:
        if self.response is not None and self.response.item.id == event.item_id:
            await self.cancel_response("client_cancelled")  # the rest will not be heard
        self.conversation.truncate(event.item_id, event.content_index, event.audio_end_ms)
        await self.send(
            ev.server_event(
                "conversation.item.truncated",
                item_id=event.item_id,
                content_index=event.content_index,
                audio_end_ms=event.audio_end_ms,
            )
        )

    async def _item_delete(self, event: ev.ItemDelete) -> None:
        self.conversation.delete(event.item_id)
        await self.send(ev.server_event("conversation.item.deleted", item_id=event.item_id))

    # -- responses ---------------------------------------------------------------------------
    def _responding(self) -> bool:
        return self.response is not None and self.response.task is not None and not self.response.task.done()

    async def _response_create(self, event: ev.ResponseCreate) -> None:
        if self._responding():
            raise ev.ProtocolError(
                f"Conversation already has an active response in progress: {self.response.state.id}",
                "conversation_already_has_active_response",
            )
        await self._start_response(event.response or {})

    async def _response_cancel(self, event: ev.ResponseCancel) -> None:
        if not self._responding():
            raise ev.ProtocolError("no response is in progress", "response_cancel_not_active")
        if event.response_id not in (None, self.response.state.id):
            raise ev.ProtocolError(f"no response {event.response_id!r} in progress", "invalid_value", "response_id")
        await self.cancel_response("client_cancelled")

    async def cancel_response(self, reason: str) -> None:
        """Stops the response in progress (if any) and waits for its `response.done`."""
        r = self.response
        if r is None or r.task is None or r.task.done():
            return
        r.cancel(reason)
        await asyncio.wait({r.task})

    async def _start_response(self, overrides: dict[str, Any] | None) -> None:
        self._launch(self._new_runner(overrides))

    def _new_runner(self, overrides: dict[str, Any] | None, items: list[Item] | None = None) -> ResponseRunner:
        """The response `overrides` ask for, on the conversation (or on `items` in its place)."""
        plan, input_items = response_plan(self.config, overrides or {}, self.cache_salt)
        if input_items is None and items is not None:
            input_items = Conversation()
            input_items.items = items
        messages, audio = (self.conversation if input_items is None else input_items).prompt(plan.instructions)
        if not messages:
            raise ev.ProtocolError("the conversation is empty: add an item or commit audio first", "empty_conversation")
        return ResponseRunner(self.served, plan.with_prompt(messages, audio), Item("assistant"), self.send)

    def _launch(self, runner: ResponseRunner) -> None:
        if runner.plan.conversation != "none":
            runner.previous_item_id = self.conversation.add(runner.item)
        self._cancel_idle()
        self.response = runner
        runner.task = asyncio.get_running_loop().create_task(runner.run())
        runner.task.add_done_callback(lambda _t: self._response_ended(runner))

    def _response_ended(self, runner: ResponseRunner) -> None:
        td = self.config.turn_detection
        if td is not None and td.idle_timeout_ms and runner is self.response:
            delay = (td.idle_timeout_ms + runner.state.audio_ms) / 1000
            self._idle = asyncio.get_running_loop().call_later(delay, self._idle_fired)

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_fired(self) -> None:
        self._idle = None
        if not self._responding() and self._speech_item is None:
            asyncio.get_running_loop().create_task(self._idle_timeout())

    async def _idle_timeout(self) -> None:
        await self._drop_early()  # the buffer and the conversation change under it
        start, end = self.buffer.start_ms, self.buffer.now_ms
        item_id = ev.new_id("item")
        await self.send(
            ev.server_event(
                "input_audio_buffer.timeout_triggered", audio_start_ms=start, audio_end_ms=end, item_id=item_id
            )
        )
        if self.buffer.samples * 1000 >= MIN_COMMIT_MS * 24_000:
            await self._add_user_audio(self.buffer.take(), item_id)
        try:
            await self._start_response(None)
        except ev.ProtocolError as err:
            await self.send(ev.error_event(err))
