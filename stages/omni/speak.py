"""Speak mode: the thinker says exactly a given text (text-to-speech through the talker).

A request with a `speak` text renders its conversation (its `messages`, or one user turn
holding the text) with the generation prompt, then appends the text's tokens as the
assistant's reply. The engine prefills prompt and reply in one pass: causal attention makes
each reply row's hidden state what teacher-forcing that token would give, so the talker gets
exactly the rows a thinker that had written this text would have streamed, and nothing is
sampled. The engine still samples one token after the reply (its minimum); that token is not
fed back, so it makes no row, and the stage drops it from the text it reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import InvalidRequestError

# what a speak request keeps of its thinker params; sampling does not apply
KEPT_PARAMS = ("cache_salt", "priority", "return_audio", "modalities", "use_audio_in_video")


@dataclass
class ForcedReply:
    """The reply a speak request forces: its text, token ids, and where the prompt ends."""

    text: str
    ids: list[int]
    num_prompt: int = 0


def speak_text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError("speak must be a non-empty string", param="speak")
    return value


def speak_params(params: dict[str, Any]) -> dict[str, Any]:
    """The engine params of a speak request: one greedy token after the forced reply."""
    kept = {k: v for k, v in params.items() if k in KEPT_PARAMS}
    return {**kept, "max_tokens": 1, "temperature": 0.0}


def speak_messages(messages: Any, text: str) -> list[dict[str, Any]]:
    """The conversation a forced reply answers: the given one, else a user turn with the text."""
    return [{"role": "user", "content": text}] if messages is None else messages


def extend_positions(positions: torch.Tensor, n: int) -> torch.Tensor:
    """(3, P) M-RoPE positions followed by n text rows (one id on all three axes each)."""
    start = int(positions.max()) + 1
    return torch.cat([positions, torch.arange(start, start + n).expand(3, -1)], dim=1)


def append_embeds(embeds: torch.Tensor, table: torch.nn.Embedding, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        rows = table(torch.tensor(ids, dtype=torch.long, device=table.weight.device)).float().cpu()
    return torch.cat([embeds, rows])
