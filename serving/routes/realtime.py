"""WS /v1/realtime?model=NAME: the OpenAI Realtime protocol on a pipeline that `serves: chat`
with audio in and out (docs/realtime.md).

The connection is accepted first (with the `realtime` subprotocol when the client offers it,
as browsers must), then a refusal - unknown model, a model that cannot hear and speak, too
many sessions for the key - is an `error` event followed by a close. Every message is handed
to the session (serving/realtime/session.py); when the client goes away, the response in
progress is aborted in every stage and the session is dropped.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from omnistage.errors import OmnistageError
from omnistage.serving.realtime.early import preemptive_pause_ms
from omnistage.serving.realtime.events import ProtocolError, beta_names, error_event
from omnistage.serving.realtime.session import RealtimeSession
from omnistage.serving.realtime.vad import VadBatcher
from omnistage.serving.routes.served import ModelNotServingError, served_pipeline

router = APIRouter(tags=["realtime"])

SESSIONS_ENV = "OMNISTAGE_REALTIME_SESSIONS_PER_KEY"
DEFAULT_SESSIONS_PER_KEY = 64
CLOSE_POLICY = 1008  # refused: bad model, too many sessions
SUBPROTOCOL = "realtime"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"


def _offered(websocket: WebSocket) -> list[str]:
    raw = websocket.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


@asynccontextmanager
async def lifespan(app: Any):
    """A bad OMNISTAGE_REALTIME_PREEMPTIVE_MS stops the server at start, not each session."""
    app.state.realtime_preemptive_ms = preemptive_pause_ms()
    yield


def _shared(app: Any) -> tuple[VadBatcher, Counter]:
    state = app.state
    if getattr(state, "realtime_vad", None) is None:
        state.realtime_vad = VadBatcher()
        state.realtime_vad.preload()
        state.realtime_sessions = Counter()
    if not hasattr(state, "realtime_preemptive_ms"):  # an app run without its lifespan
        state.realtime_preemptive_ms = preemptive_pause_ms()
    return state.realtime_vad, state.realtime_sessions


def sessions_per_key() -> int:
    return int(os.environ.get(SESSIONS_ENV) or DEFAULT_SESSIONS_PER_KEY)


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket, model: str | None = None) -> None:
    offered = _offered(websocket)
    beta = "realtime=v1" in websocket.headers.get("openai-beta", "") or BETA_SUBPROTOCOL in offered
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    lock = asyncio.Lock()

    async def send(event: dict[str, Any]) -> None:
        out = beta_names(event) if beta else event
        if out is None or websocket.application_state != WebSocketState.CONNECTED:
            return
        async with lock:
            try:
                await websocket.send_text(json.dumps(out))
            except (WebSocketDisconnect, RuntimeError, OSError):
                pass  # the client is gone: the receive loop ends the session

    vad, sessions = _shared(websocket.app)
    owner = (websocket.scope.get("state") or {}).get("api_key") or ""
    try:
        served = _served(websocket, model)
    except OmnistageError as err:
        await send(error_event(ProtocolError(str(err), err.code or "invalid_request", getattr(err, "param", None))))
        await websocket.close(CLOSE_POLICY, (err.code or "refused")[:120])
        return
    if sessions[owner] >= sessions_per_key():
        message = f"this API key already has {sessions[owner]} realtime sessions open (the limit)"
        await send(error_event(ProtocolError(message, "session_limit_exceeded")))
        await websocket.close(CLOSE_POLICY, "session_limit_exceeded")
        return
    sessions[owner] += 1
    metrics = getattr(websocket.app.state, "metrics", None)
    outcome = (lambda o: metrics.realtime_preemptive.labels(o).inc()) if metrics is not None else None
    preemptive_ms = websocket.app.state.realtime_preemptive_ms
    session = RealtimeSession(served, send, vad, preemptive_ms=preemptive_ms, on_preemptive=outcome)
    try:
        await session.start()
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            await session.handle(message.get("text") if message.get("text") is not None else message.get("bytes"))
    except WebSocketDisconnect:
        pass
    finally:
        sessions[owner] -= 1
        await session.close()


def _served(websocket: WebSocket, model: str | None):
    if not model:
        raise ModelNotServingError("the model query parameter is required: /v1/realtime?model=NAME", "model")
    served = served_pipeline(websocket, model, "chat")  # type: ignore[arg-type]  # reads only .app
    if served.port("audio") is None or served.port("audio_in") is None:
        raise ModelNotServingError(f"the model {model!r} does not take and give audio (serves: chat)", "model")
    return served
