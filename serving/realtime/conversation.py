"""A session's conversation: its items in order, and the chat messages (plus audio clips) a
response sends to the pipeline.

User audio is kept as float32 samples at 24 kHz; an assistant item keeps the audio it sent
and its transcript, so `conversation.item.truncate` can cut both to what the user heard:
the audio at `audio_end_ms`, the transcript in the same proportion (at a word boundary).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.serving.realtime.audio import SESSION_RATE, AudioDataError, AudioFormat, decode_b64
from omnistage.serving.realtime.events import ProtocolError, new_id

USER_PARTS = {"input_text", "input_audio", "text"}
ASSISTANT_PARTS = {"output_text", "output_audio", "text", "audio"}
ROLE_PARTS = {"user": USER_PARTS, "system": {"input_text", "text"}, "assistant": ASSISTANT_PARTS}


@dataclass
class ContentPart:
    type: str  # input_text | input_audio | output_text | output_audio
    text: str | None = None  # input_text / output_text
    transcript: str | None = None  # audio parts
    samples: np.ndarray | None = None  # audio parts: float32 at 24 kHz

    @property
    def audio_ms(self) -> int:
        return 0 if self.samples is None else len(self.samples) * 1000 // SESSION_RATE

    def as_dict(self, fmt: AudioFormat | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type.endswith("_text"):
            out["text"] = self.text or ""
        else:
            out["transcript"] = self.transcript
            if fmt is not None and self.samples is not None:  # only conversation.item.retrieve carries audio
                out["audio"] = base64.b64encode(fmt.encode(self.samples)).decode("ascii")
        return out


@dataclass
class Item:
    role: str  # user | assistant | system
    content: list[ContentPart] = field(default_factory=list)
    id: str = field(default_factory=lambda: new_id("item"))
    status: str = "completed"

    def as_dict(self, fmt: AudioFormat | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": [p.as_dict(fmt) for p in self.content],
        }

    def text(self) -> str:
        return "".join((p.text if p.type.endswith("_text") else p.transcript) or "" for p in self.content)


def item_from_client(data: dict[str, Any], input_format: AudioFormat, where: str = "item") -> Item:
    """A `conversation.item.create` item (or a `response.input` entry, at `where`): a message
    from the user, the assistant or the system."""
    if data.get("type", "message") != "message":
        raise ProtocolError(
            f"items of type {data.get('type')!r} are not supported", "unsupported_value", f"{where}.type"
        )
    role = data.get("role")
    allowed = ROLE_PARTS.get(role) if isinstance(role, str) else None  # a list or object is no role either
    if allowed is None:
        raise ProtocolError(f"{where}.role must be user, assistant or system", "invalid_value", f"{where}.role")
    content = data.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError(f"{where}.content must be a non-empty list", "invalid_value", f"{where}.content")
    item = Item(role, id=data["id"] if isinstance(data.get("id"), str) else new_id("item"))
    for i, part in enumerate(content):
        param = f"{where}.content[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in allowed:
            raise ProtocolError(f"{param}.type must be one of {sorted(allowed)} for a {role} item", param=param)
        transcript = part.get("transcript")
        if transcript is not None and not isinstance(transcript, str):
            raise ProtocolError(f"{param}.transcript must be a string", param=f"{param}.transcript")
        if kind in ("input_audio", "audio", "output_audio") and role == "user":
            try:
                samples = input_format.decode(decode_b64(part.get("audio")))
            except AudioDataError as exc:
                raise ProtocolError(f"{param}.audio: {exc}", "invalid_audio", f"{param}.audio") from None
            item.content.append(ContentPart("input_audio", transcript=transcript, samples=samples))
        elif kind in ("audio", "output_audio"):
            item.content.append(ContentPart("output_audio", transcript=transcript or ""))
        else:
            if not isinstance(part.get("text"), str):
                raise ProtocolError(f"{param}.text must be a string", param=f"{param}.text")
            item.content.append(ContentPart("output_text" if role == "assistant" else "input_text", part["text"]))
    return item


class Conversation:
    def __init__(self) -> None:
        self.items: list[Item] = []

    def get(self, item_id: str) -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise ProtocolError(f"no item with id {item_id!r} in the conversation", "item_not_found", "item_id")

    def add(self, item: Item, previous_item_id: str | None = None, where: str = "item") -> str | None:
        """Adds after `previous_item_id` (root: first; None: last); returns the id before it."""
        if any(i.id == item.id for i in self.items):
            raise ProtocolError(f"an item with id {item.id!r} already exists", "item_exists", f"{where}.id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            try:
                at = self.items.index(self.get(previous_item_id)) + 1
            except ProtocolError as err:
                err.param = "previous_item_id"  # the field that named it
                raise
        self.items.insert(at, item)
        return self.items[at - 1].id if at > 0 else None

    def delete(self, item_id: str) -> None:
        self.items.remove(self.get(item_id))

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        item = self.get(item_id)
        if item.role != "assistant":
            raise ProtocolError("only assistant items can be truncated", "invalid_value", "item_id")
        if content_index >= len(item.content) or item.content[content_index].type != "output_audio":
            raise ProtocolError("content_index does not name an audio part", "invalid_value", "content_index")
        part = item.content[content_index]
        if audio_end_ms > part.audio_ms:
            raise ProtocolError(
                f"audio_end_ms {audio_end_ms} is past the audio's end ({part.audio_ms} ms)",
                "invalid_value",
                "audio_end_ms",
            )
        kept = audio_end_ms * SESSION_RATE // 1000
        share = kept / max(1, len(part.samples))
        part.samples = part.samples[:kept]
        part.transcript = _cut_text(part.transcript or "", share)

    def prompt(self, instructions: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The chat messages (audio parts as {"type": "audio"}) and the audio clips, in order."""
        system = [instructions] if instructions else []
        messages: list[dict[str, Any]] = []
        audio: list[dict[str, Any]] = []
        for item in self.items:
            if item.role == "system":
                system.append(item.text())
            elif item.role == "assistant":
                if item.text():  # an answer cancelled before its first word says nothing
                    messages.append({"role": "assistant", "content": item.text()})
            else:
                parts: list[dict[str, Any]] = []
                for p in item.content:
                    if p.type == "input_audio" and p.samples is not None and len(p.samples):
                        parts.append({"type": "audio"})
                        audio.append({"samples": p.samples, "sampling_rate": SESSION_RATE})
                    elif p.type == "input_text":
                        parts.append({"type": "text", "text": p.text or ""})
                if parts:
                    messages.append({"role": "user", "content": parts})
        if system:
            messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
        return messages, audio


def _cut_text(text: str, share: float) -> str:
    """The first `share` of `text`, ending at a word boundary."""
    if share >= 1.0:
        return text
    cut = int(len(text) * share)
    if cut < len(text) and cut > 0 and not text[cut].isspace():
        space = text.rfind(" ", 0, cut)
        cut = space if space > 0 else cut
    return text[:cut].rstrip()
