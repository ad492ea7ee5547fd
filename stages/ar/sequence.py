"""Per-sequence state and the per-step output of the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from omnistage.stages.ar.config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one sequence of a request.

    new_token_ids: tokens sampled this step (0 or 1 today; 0 while a prompt is being prefilled
        in chunks). new_logprobs: one {token_id: logprob} dict per new token, holding the sampled
        token and the top-`logprobs` tokens (logprobs of the model's raw distribution), or None.
    hidden_states: layer index -> [num_processed, hidden] for the tokens *fed through the model*
        this step (a prompt chunk, or the previously sampled token during decode), so that row j
        of the prompt/decoded stream arrives exactly once, in order; None when not requested or
        nothing was processed for this sequence this step.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    hidden_states: dict[int, torch.Tensor] | None = None
    num_output_tokens: int = 0


@dataclass(frozen=True)
class SequenceOptions:
    """What a stage built on the engine sets per request beyond sampling (the Qwen2.5-Omni
    thinker and talker); each field is the Sequence field of the same name, described there."""

    prompt_cache_keys: list[int] | None = None
    prompt_penalty_ids: list[int] | None = None
    suppress_token_ids: tuple[int, ...] = ()
    decode_embeds_open: bool = False


@dataclass
class PenaltyIds:
    """The repetition penalty's ids of one sequence, grown as it generates."""

    members: set[int]
    ids: torch.Tensor  # int64; ids[:len(members)] are the members
    covered: int  # token_ids[:covered] are counted

    def add(self, token: int) -> None:
        count = len(self.members)
        if count == len(self.ids):
            self.ids = torch.cat([self.ids, torch.empty_like(self.ids)])
        self.ids[count] = token
        self.members.add(token)


@dataclass(eq=False)
class Sequence:
    """One generated stream. A request with n > 1 owns n sequences that share its prompt blocks."""

    request_id: str
    index: int
    token_ids: list[int]  # prompt (placeholders when the prompt is given as embeddings) + output
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival: int  # monotonically increasing admission counter (FCFS order)
    seq_id: int = -1  # unique for the engine's lifetime (never reused, unlike id())
    priority: int = 0
    cache_salt: str | None = None
    prompt_embeds: torch.Tensor | None = None  # [num_prompt_tokens, hidden]
    mrope_positions: torch.Tensor | None = None  # (3, num_prompt_tokens) int64
    mrope_delta: int = 0  # generated token t (t >= prompt len) sits at position t + delta
    # Added to the input embedding of generated token t when it is fed back: row min(t, K - 1)
    # (the Qwen2.5-Omni talker's thinker_reply_part). [K, embedding_size]
    decode_embeds: torch.Tensor | None = None
    # Prefix-cache keys of an embeddings prompt, one per prompt position: the token id where the
    # embedding is the token's, a key derived from the content elsewhere (multimodal rows), so
    # equal keys mean equal embeddings. None: an embeddings prompt is never cached.
    prompt_cache_keys: list[int] | None = None
    # More decode_embeds rows will come (a streaming input): generated token t is fed back only
    # once its row t exists; the sequence waits meanwhile without holding up the others.
    decode_embeds_open: bool = False
    # Held back by flow control (the request's consumer is behind): skipped like a sequence
    # awaiting rows, keeping its blocks.
    held: bool = False
    # Token ids the sampler never picks (transformers' suppress_tokens).
    suppress_token_ids: tuple[int, ...] = ()
    # An embeddings prompt's token ids as the repetition penalty should see them (the Qwen2.5-Omni
    # talker's codec prompt); None: only the generated tokens count.
    prompt_penalty_ids: list[int] | None = None
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of this sequence's full blocks
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached_tokens: int = -1  # prefix-cache hit on first admission (-1: not admitted yet)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # hidden-state rows already reported: a recompute after preemption reports only the rest
    num_hidden_reported: int = 0
    # n > 1: siblings wait until the parent's prompt is computed, then fork its blocks.
    fork_parent: Sequence | None = None
    fork_children: list[Sequence] = field(default_factory=list)
    output_counts: dict[int, int] = field(default_factory=dict)
    penalty_ids: PenaltyIds | None = None  # kept by repetition_ids()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def prompt_ids_known(self) -> bool:
        return self.prompt_embeds is None

    @property
    def prompt_hashable(self) -> bool:
        """The prompt can be keyed in the prefix cache (token ids, or content keys for embeddings)."""
        return self.prompt_embeds is None or self.prompt_cache_keys is not None

    @property
    def awaiting_decode_embeds(self) -> bool:
        """Its next fed-back token (generated token t = outputs - 1) has no decode_embeds row yet."""
        if not self.decode_embeds_open or self.num_output_tokens == 0:
            return False
        rows = 0 if self.decode_embeds is None else self.decode_embeds.shape[0]
        return self.num_output_tokens - 1 >= rows

    @property
    def stalled(self) -> bool:
        """It cannot advance now; the others in the batch go on without it."""
        return self.held or self.awaiting_decode_embeds

    def cache_key_ids(self, start: int, end: int) -> list[int]:
        """What the prefix cache hashes for positions [start, end): token ids, with the prompt's
        content keys in place of embedding placeholders."""
        keys = self.prompt_cache_keys
        if keys is None or start >= self.num_prompt_tokens:
            return self.token_ids[start:end]
        return keys[start : min(end, self.num_prompt_tokens)] + self.token_ids[self.num_prompt_tokens : end]

    def repetition_ids(self) -> torch.Tensor:
        """The ids the repetition penalty sees, each once: the prompt's (its token ids, or
        `prompt_penalty_ids` for an embeddings prompt) and every generated one. Kept between
        steps; a step adds only the ids first generated since the last call."""
        cache = self.penalty_ids
        if cache is None:
            prompt = self.token_ids[: self.num_prompt_tokens] if self.prompt_ids_known else self.prompt_penalty_ids
            members = set(prompt or ())
            ids = torch.empty(max(64, 2 * len(members)), dtype=torch.long)
            ids[: len(members)] = torch.tensor(sorted(members), dtype=torch.long)
            cache = self.penalty_ids = PenaltyIds(members, ids, self.num_prompt_tokens)
        for token in self.token_ids[cache.covered :]:
            if token not in cache.members:
                cache.add(token)
        cache.covered = len(self.token_ids)
        return cache.ids[: len(cache.members)]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def mrope_position_of(self, start: int, end: int) -> torch.Tensor:
        """(3, end-start) M-RoPE positions; text-only sequences use the same id on all three axes."""
        p = self.position_of(start, end)
        return p.unsqueeze(0).expand(3, -1) if p.dim() == 1 else p

    def position_of(self, start: int, end: int) -> torch.Tensor:
        """Positions of tokens [start, end): (end-start,) or (3, end-start) for M-RoPE prompts."""
        if self.mrope_positions is None:
            return torch.arange(start, end, dtype=torch.long)
        p = self.num_prompt_tokens
        parts = []
        if start < p:
            parts.append(self.mrope_positions[:, start : min(end, p)])
        if end > p:
            gen = torch.arange(max(start, p), end, dtype=torch.long) + self.mrope_delta
            parts.append(gen.unsqueeze(0).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
