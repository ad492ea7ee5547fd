"""Stage kind `text_encoder`: prompt (+ negative prompt) -> prompt embeddings, dynamic batching.

Built on PreparedBatchEngine (dynamic batching, each request parsed once when added): a batch
holds requests with the same max_sequence_length; their distinct prompts and negative prompts go through each encoder in
ONE call.
Output rows per request: [prompt] or [prompt, negative prompt] (see docs/diffusion.md), plus
`warnings` (diffusers' truncation notices for over-long prompts).
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Port, StageRequest
from omnistage.stages.diffusion.adapters.base import GENERATION_PARAMS, LOADING_PARAMS, GenerationParams
from omnistage.stages.diffusion.limits import checkpoint_limits
from omnistage.stages.diffusion.loading import build_adapter
from omnistage.stages.diffusion.request_caps import check_queued_generation
from omnistage.stages.dynamic import PreparedBatchEngine
from omnistage.stages.params import ParamSet
from omnistage.stages.registry import register_stage


@register_stage("text_encoder")
class TextEncoderStage(PreparedBatchEngine):
    inputs = {"prompt": Port("text")}
    outputs = {
        "prompt_embeds": Port("embeddings"),
        "pooled_prompt_embeds": Port("embeddings"),
        "prompt_mask": Port("tensor"),
        "warnings": Port("json"),
    }
    needs_model = True
    stage_params = ParamSet("text_encoder", LOADING_PARAMS)
    request_params = GENERATION_PARAMS

    @classmethod
    def check_queued(cls, stage, params):
        check_queued_generation(stage, params)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.adapter = build_adapter(ctx, "TEXT_ENCODER")
        # the checkpoint's size range, so a size the denoiser cannot take fails here, first
        self.model_limits = checkpoint_limits(ctx)

    prepare_errors = (InvalidRequestError,)

    def prepare(self, request: StageRequest) -> tuple[list[str], int]:
        """(prompts to encode, max_sequence_length); the latter is the batch key."""
        raw = dict(request.params or {})
        prompt = request.inputs.get("prompt", raw.get("prompt"))
        if isinstance(prompt, (list, tuple)) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        raw["prompt"] = prompt
        params = GenerationParams.from_dict(raw)
        if self.model_limits is not None:
            self.model_limits.check(params)
        msl = params.max_sequence_length or self.adapter.default_max_sequence_length()
        limit = self.adapter.max_allowed_sequence_length()
        if msl > limit:
            raise InvalidRequestError(
                f"max_sequence_length cannot be greater than {limit}, got {msl}", param="max_sequence_length"
            )
        prompts = [prompt]
        if self.adapter.uses_negative_prompt(params):
            prompts.append(params.negative_prompt or "")
        return prompts, msl

    def forward_batch(self, requests: list[StageRequest]) -> list[Any]:
        parsed = [self._parsed.pop(r.request_id, None) for r in requests]
        good = [p for p in parsed if isinstance(p, tuple)]
        enc, index = None, {}
        if good:
            # each distinct text once (the empty negative prompt is shared by most requests);
            # rows do not depend on their batch mates, so this changes no result
            unique = list(dict.fromkeys(t for prompts, _ in good for t in prompts))
            index = {t: i for i, t in enumerate(unique)}
            enc = self.adapter.encode(unique, good[0][1])
        results: list[Any] = []
        for p in parsed:
            if not isinstance(p, tuple):
                results.append(p if p is not None else RuntimeError("request state lost"))
                continue
            rows = torch.tensor([index[t] for t in p[0]])
            out: dict[str, Any] = {"prompt_embeds": enc.embeds.index_select(0, rows.to(enc.embeds.device))}
            if enc.pooled is not None:
                out["pooled_prompt_embeds"] = enc.pooled.index_select(0, rows.to(enc.pooled.device))
            if enc.mask is not None:
                out["prompt_mask"] = enc.mask.index_select(0, rows.to(enc.mask.device))
            out["warnings"] = [w for i in rows.tolist() for w in (enc.warnings[i] if enc.warnings else [])]
            results.append(out)
        return results
