"""Conversation events over /v1/realtime: items created, deleted and retrieved; a response
outside the conversation (`conversation: none` with its own `input`); one response at a time
and `response.cancel`; server VAD's `idle_timeout_ms` answering a silent user."""

from __future__ import annotations

import asyncio
import time

from omnistage.tests.realtime.conftest import connect, send, until

TEXT = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4, "seed": 0}


def _user(text: str, item_id: str | None = None) -> dict:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return {**item, "id": item_id} if item_id else item


def test_items_and_responses_outside_the_conversation(rt_server):
    async def talk():
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            await send(ws, "session.update", session={**TEXT, "audio": {"input": {"turn_detection": None}}})
            await until(ws, "session.updated")
            await send(ws, "conversation.item.create", item=_user("First.", "item_a"))
            added_a = await until(ws, "conversation.item.added")
            system = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]}
            await send(ws, "conversation.item.create", item={**system, "id": "item_s"}, previous_item_id="root")
            added_s = await until(ws, "conversation.item.added")
            await send(ws, "conversation.item.create", item=_user("Again.", "item_a"))
            duplicate = await until(ws, "error")
            await send(ws, "conversation.item.delete", item_id="item_s")
            deleted = await until(ws, "conversation.item.deleted")
            await send(ws, "conversation.item.retrieve", item_id="item_s")
            gone = await until(ws, "error")
            side = {"conversation": "none", "input": [_user("Side question?")], "metadata": {"topic": "side"}}
            await send(ws, "response.create", response=side)
            side_done = (await until(ws, "response.done"))["response"]
            await send(ws, "conversation.item.retrieve", item_id=side_done["output"][0]["id"])
            not_added = await until(ws, "error")
            long = {"max_output_tokens": 2000}
            await send(ws, "response.create", response=long)
            created = await until(ws, "response.created")
            await send(ws, "response.create")
            busy = await until(ws, "error")
            await send(ws, "response.cancel", response_id=created["response"]["id"])
            cancelled = (await until(ws, "response.done"))["response"]
            return added_a, added_s, duplicate, deleted, gone, side_done, not_added, busy, cancelled

    added_a, added_s, duplicate, deleted, gone, side, not_added, busy, cancelled = asyncio.run(talk())
    assert added_a["item"]["id"] == "item_a" and added_a["previous_item_id"] is None
    assert added_s["item"]["id"] == "item_s" and added_s["previous_item_id"] is None  # inserted first
    assert duplicate["error"]["code"] == "item_exists"
    assert deleted["item_id"] == "item_s" and gone["error"]["code"] == "item_not_found"
    assert side["conversation_id"] is None and side["metadata"] == {"topic": "side"}
    assert side["status"] in ("completed", "incomplete") and side["usage"]["output_tokens"] > 0
    assert not_added["error"]["code"] == "item_not_found"  # the side answer never joined the conversation
    assert busy["error"]["code"] == "conversation_already_has_active_response"
    assert cancelled["status"] == "cancelled" and cancelled["status_details"]["reason"] == "client_cancelled"
    assert cancelled["usage"]["output_tokens"] < 2000


def test_idle_timeout_answers_a_silent_user(rt_server):
    idle_ms = 1500
    vad = {"type": "server_vad", "idle_timeout_ms": idle_ms}

    async def talk():
        async with connect(rt_server) as ws:
            await until(ws, "session.created")
            await send(ws, "session.update", session={**TEXT, "audio": {"input": {"turn_detection": vad}}})
            updated = await until(ws, "session.updated")
            await send(ws, "conversation.item.create", item=_user("Hello?"))
            await send(ws, "response.create")
            first = (await until(ws, "response.done"))["response"]
            done_at = time.monotonic()
            timeout = await until(ws, "input_audio_buffer.timeout_triggered", timeout=60)
            waited = time.monotonic() - done_at
            second = (await until(ws, "response.done"))["response"]
            return updated, first, waited, timeout, second

    updated, first, waited, timeout, second = asyncio.run(talk())
    assert updated["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == idle_ms
    assert waited >= idle_ms / 1000 - 0.1  # a text answer has no audio to play first
    assert timeout["audio_end_ms"] >= timeout["audio_start_ms"] >= 0
    assert second["id"] != first["id"] and second["status"] in ("completed", "incomplete")
