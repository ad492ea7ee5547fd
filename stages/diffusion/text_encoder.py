"""Stage kind `text_encoder`: prompt (+ negative prompt) -> prompt embeddings, dynamic batching.

Each step encodes the prompts of every waiting request (up to max_batch_size requests), the
positive and negative prompts in one encoder call per max_sequence_length group. Output rows
per request: [prompt] or [prompt, negative prompt] (see docs/diffusion.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Emission, Port, StageEngine, StageRequest, StepRecord
from omnistage.stages.diffusion.adapters.base import GenerationParams
from omnistage.stages.diffusion.loading import build_adapter
from omnistage.stages.registry import register_stage
import time


@dataclass
class _Pending:
    request_id: str
    params: GenerationParams
    prompts: list[str]  # [prompt] or [prompt, negative]
    max_sequence_length: int


@register_stage("text_encoder")
class TextEncoderStage(StageEngine):
    inputs = {"prompt": Port("text")}
    outputs = {
        "prompt_embeds": Port("embeddings"),
        "pooled_prompt_embeds": Port("embeddings"),
        "prompt_mask": Port("tensor"),
        "warnings": Port("json"),
    }
    batching_policies = ("dynamic", "none")
    needs_model = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.adapter = build_adapter(ctx, "TEXT_ENCODER")
        self.max_batch_size = max(1, int(getattr(ctx.batching, "max_batch_size", 8) or 8))
        if getattr(ctx.batching, "policy", "dynamic") == "none":
            self.max_batch_size = 1
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._errors: list[Emission] = []

    def add(self, request: StageRequest) -> None:
        try:
            raw = dict(request.params or {})
            prompt = request.inputs.get("prompt", raw.get("prompt"))
            if isinstance(prompt, (list, tuple)) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
            raw["prompt"] = prompt
            params = GenerationParams.from_dict(raw)
            msl = params.max_sequence_length or self.adapter.default_max_sequence_length()
            limit = self.adapter.max_allowed_sequence_length()
            if msl > limit:
                raise InvalidRequestError(
                    f"max_sequence_length cannot be greater than {limit}, got {msl}", param="max_sequence_length"
                )
            prompts = [prompt]
            if self.adapter.uses_negative_prompt(params):
                prompts.append(params.negative_prompt or "")
        except InvalidRequestError as exc:
            self._errors.append(Emission(request.request_id, error=str(exc), error_kind="invalid_request", finished=True))
            return
        self._pending[request.request_id] = _Pending(request.request_id, params, prompts, msl)

    def abort(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._errors = [e for e in self._errors if e.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self._pending or self._errors)

    def num_requests(self) -> int:
        return len(self._pending)

    def step(self) -> list[Emission]:
        emissions, self._errors = self._errors, []
        batch: list[_Pending] = []
        while self._pending and len(batch) < self.max_batch_size:
            batch.append(self._pending.popitem(last=False)[1])
        if not batch:
            return emissions
        t0 = time.perf_counter()
        groups: dict[int, list[_Pending]] = {}
        for p in batch:
            groups.setdefault(p.max_sequence_length, []).append(p)
        for msl, members in groups.items():
            prompts = [text for p in members for text in p.prompts]
            try:
                enc = self.adapter.encode(prompts, msl)
            except Exception as exc:  # noqa: BLE001 - retry alone so one bad request fails alone
                for p in members:
                    emissions.append(self._encode_one(p))
                continue
            row = 0
            for p in members:
                emissions.append(self._emission(p, enc, row))
                row += len(p.prompts)
        self.step_log.append(
            StepRecord(tuple(p.request_id for p in batch), len(batch), time.perf_counter() - t0)
        )
        return emissions

    def _encode_one(self, p: _Pending) -> Emission:
        try:
            return self._emission(p, self.adapter.encode(p.prompts, p.max_sequence_length), 0)
        except Exception as exc:  # noqa: BLE001
            return Emission(p.request_id, error=f"{type(exc).__name__}: {exc}", finished=True)

    @staticmethod
    def _emission(p: _Pending, enc, row: int) -> Emission:
        rows = slice(row, row + len(p.prompts))
        outputs = {"prompt_embeds": enc.embeds[rows].contiguous()}
        if enc.pooled is not None:
            outputs["pooled_prompt_embeds"] = enc.pooled[rows].contiguous()
        if enc.mask is not None:
            outputs["prompt_mask"] = enc.mask[rows].contiguous()
        warnings: list[str] = []
        if enc.warnings:
            for w in enc.warnings[rows]:
                warnings.extend(w)
        outputs["warnings"] = warnings
        return Emission(p.request_id, outputs=outputs, finished=True)

    def stats(self) -> dict[str, float]:
        return {"pending": float(len(self._pending))}
