"""The AR engine's request checks, in one place.

`RequestChecker.check(...)` turns what `LLMEngine.add_request` received into a
`CheckedRequest` (token ids, embeddings and positions on the engine's device and dtype) or
raises InvalidRequestError naming the bad input; nothing is queued before it passes.
`tokens_input` / `embeddings_input` read the `ar_lm` stage's `tokens` / `embeddings` inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import ContextLengthExceededError, InvalidRequestError
from omnistage.stages.ar.config import ModelConfig, SamplingParams


@dataclass
class CheckedRequest:
    token_ids: list[int]  # placeholders (0) where the prompt is given as embeddings
    num_prompt_tokens: int
    sampling: SamplingParams
    prompt_embeds: torch.Tensor | None = None  # [num_prompt_tokens, embedding_size]
    mrope_positions: torch.Tensor | None = None  # (3, num_prompt_tokens)
    mrope_delta: int = 0
    decode_embeds: torch.Tensor | None = None  # [rows, embedding_size]


class RequestChecker:
    def __init__(self, model_config: ModelConfig, max_model_len: int, device: torch.device, dtype: torch.dtype):
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype

    def check(
        self,
        prompt_token_ids: list[int] | None,
        sampling: SamplingParams | dict | None,
        inputs_embeds: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        decode_embeds: torch.Tensor | None,
    ) -> CheckedRequest:
        if sampling is None:
            sampling = SamplingParams()
        elif isinstance(sampling, dict):
            sampling = SamplingParams.from_dict(sampling)
        # a SamplingParams instance was checked when it was built
        if inputs_embeds is not None:
            embeds = self.embedding_rows(inputs_embeds, "inputs_embeds", "num_tokens")
            num_prompt = embeds.shape[0]
            if prompt_token_ids is not None and len(prompt_token_ids) != num_prompt:
                raise InvalidRequestError("prompt_token_ids and inputs_embeds differ in length", param="prompt")
            token_ids = [0] * num_prompt
        else:
            embeds = None
            token_ids = self._token_ids(prompt_token_ids)
            num_prompt = len(token_ids)
        if num_prompt + 1 > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt has {num_prompt} tokens; this model's context is {self.max_model_len} tokens "
                f"(the prompt plus at least one generated token must fit)",
                param="prompt",
            )
        mrope, delta = self._positions(position_ids, num_prompt)
        extra = self.embedding_rows(decode_embeds, "decode_embeds", "rows") if decode_embeds is not None else None
        return CheckedRequest(token_ids, num_prompt, sampling, embeds, mrope, delta, extra)

    def _token_ids(self, prompt_token_ids: list[int] | None) -> list[int]:
        if not prompt_token_ids:
            raise InvalidRequestError("empty prompt", param="prompt")
        token_ids = list(map(int, prompt_token_ids))
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidRequestError(f"token id out of range [0, {vocab})", param="prompt")
        return token_ids

    def embedding_rows(self, rows: torch.Tensor, name: str, rows_name: str) -> torch.Tensor:
        """[rows, embedding_size] (a leading batch dim of 1 is dropped) on the engine's device."""
        t = rows.detach()
        if t.dim() == 3 and t.shape[0] == 1:
            t = t[0]
        e = self.model_config.embedding_size
        if t.dim() != 2 or t.shape[1] != e or t.shape[0] < 1:
            raise InvalidRequestError(f"{name} must be [{rows_name}, {e}], got {tuple(rows.shape)}", param=name)
        return t.to(device=self.device, dtype=self.dtype)

    def _positions(self, position_ids: torch.Tensor | None, num_prompt: int) -> tuple[torch.Tensor | None, int]:
        if position_ids is None:
            return None, 0
        if not self.model_config.uses_mrope:
            raise InvalidRequestError("position_ids are only accepted for M-RoPE models", param="position_ids")
        pos = position_ids.detach().to("cpu", torch.long)
        if pos.dim() == 3 and pos.shape[1] == 1:
            pos = pos[:, 0]
        if pos.shape != (3, num_prompt):
            raise InvalidRequestError(
                f"position_ids must be (3, {num_prompt}), got {tuple(position_ids.shape)}", param="position_ids"
            )
        return pos, int(pos.max()) + 1 - num_prompt


def tokens_input(value: Any) -> list[int]:
    """The `tokens` input of a stage request: a list of ints or a 1-D integer tensor ([1, T] too)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise InvalidRequestError("tokens must be a 1-D integer tensor or a list of ints", param="tokens")
        return [int(t) for t in value.tolist()]
    if isinstance(value, (list, tuple)) and (
        set(map(type, value)) <= {int}  # the common case, checked in C
        or all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return list(value)
    raise InvalidRequestError("tokens must be a list of ints", param="tokens")


def embeddings_input(value: Any) -> torch.Tensor:
    """The `embeddings` input of a stage request: a float tensor [T, hidden] ([1, T, hidden] too)."""
    t = torch.as_tensor(value)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or not t.is_floating_point():
        raise InvalidRequestError("embeddings must be a float tensor [tokens, hidden]", param="embeddings")
    return t
