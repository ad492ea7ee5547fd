"""Stage kind `vae_decoder`: latents -> pixels, dynamic batching.

Requests whose latents the adapter says can share a call (equal `batch_key`) decode together,
up to max_batch_size outputs per call. Requests with key None (video) decode alone through
`decode_chunks`, one chunk per step, so the first frames leave before the whole video is
decoded. Output: `image` [n, H, W, 3] (or `video` [n, F, H, W, 3] chunks along F when the
stage param `output: video`), uint8 or float ([0,1]) per the request's `output_type`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Emission, Port, StageEngine, StageRequest, StepRecord
from omnistage.stages.diffusion.adapters.base import GenerationParams, to_output
from omnistage.stages.diffusion.loading import build_adapter
from omnistage.stages.registry import register_stage


@dataclass
class _Job:
    request_id: str
    latents: torch.Tensor
    params: GenerationParams
    key: Any
    chunks: Iterator[torch.Tensor] | None = None


@register_stage("vae_decoder")
class VaeDecoderStage(StageEngine):
    inputs = {"latents": Port("latents")}
    outputs = {"image": Port("image")}
    batching_policies = ("dynamic", "none")
    needs_model = True

    @classmethod
    def ports(cls, params: dict[str, Any]):
        if (params or {}).get("output") == "video":
            return dict(cls.inputs), {"video": Port("video", streaming=True)}
        return dict(cls.inputs), dict(cls.outputs)

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> list[str]:
        out = (params or {}).get("output", "image")
        return [] if out in ("image", "video") else [f"output must be image or video, got {out!r}"]

    def __init__(self, ctx):
        super().__init__(ctx)
        self.adapter = build_adapter(ctx, "VAE", extra_args=(dict(ctx.params or {}),))
        self.port = self.ports(ctx.params)[1].popitem()[0]
        self.max_batch_size = max(1, int(getattr(ctx.batching, "max_batch_size", 8) or 8))
        if getattr(ctx.batching, "policy", "dynamic") == "none":
            self.max_batch_size = 1
        self._pending: OrderedDict[str, _Job] = OrderedDict()
        self._streaming: OrderedDict[str, _Job] = OrderedDict()
        self._errors: list[Emission] = []

    def add(self, request: StageRequest) -> None:
        rid = request.request_id
        try:
            params = GenerationParams.from_dict(request.params)
            latents = request.inputs.get("latents")
            if not isinstance(latents, torch.Tensor):
                raise ValueError("vae_decoder request without latents")
            key = self.adapter.batch_key(latents, params)
        except InvalidRequestError as exc:
            self._errors.append(Emission(rid, error=str(exc), error_kind="invalid_request", finished=True))
            return
        except Exception as exc:  # noqa: BLE001
            self._errors.append(Emission(rid, error=f"{type(exc).__name__}: {exc}", finished=True))
            return
        self._pending[rid] = _Job(rid, latents, params, key)

    def abort(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        job = self._streaming.pop(request_id, None)
        if job is not None and job.chunks is not None and hasattr(job.chunks, "close"):
            job.chunks.close()
        self._errors = [e for e in self._errors if e.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self._pending or self._streaming or self._errors)

    def num_requests(self) -> int:
        return len(self._pending) + len(self._streaming)

    def step(self) -> list[Emission]:
        emissions, self._errors = self._errors, []
        t0 = time.perf_counter()
        served: list[str] = []
        # one batched decode: the oldest request's key, its mates up to the budget
        if self._pending:
            head = next(iter(self._pending.values()))
            if head.key is None:
                self._pending.pop(head.request_id)
                head.chunks = iter(self.adapter.decode_chunks(head.latents, head.params))
                self._streaming[head.request_id] = head
            else:
                batch, images = [], 0
                for job in list(self._pending.values()):
                    n = int(job.latents.shape[0])
                    if job.key != head.key or (batch and images + n > self.max_batch_size):
                        continue
                    batch.append(job)
                    images += n
                for job in batch:
                    self._pending.pop(job.request_id)
                emissions += self._decode(batch)
                served += [j.request_id for j in batch]
        # one chunk of every streaming request
        for rid, job in list(self._streaming.items()):
            served.append(rid)
            try:
                chunk = next(job.chunks)  # type: ignore[arg-type]
            except StopIteration:
                self._streaming.pop(rid)
                emissions.append(Emission(rid, finished=True))
                continue
            except Exception as exc:  # noqa: BLE001
                self._streaming.pop(rid)
                emissions.append(Emission(rid, error=f"{type(exc).__name__}: {exc}", finished=True))
                continue
            emissions.append(Emission(rid, outputs={self.port: to_output(chunk, job.params.output_type)}))
        if served:
            self.step_log.append(StepRecord(tuple(served), len(served), time.perf_counter() - t0))
        return emissions

    def _decode(self, batch: list[_Job]) -> list[Emission]:
        try:
            pixels = self.adapter.decode_batch(torch.cat([j.latents for j in batch]))
        except Exception:  # noqa: BLE001 - decode alone so one bad request fails alone
            if len(batch) == 1:
                import traceback

                return [Emission(batch[0].request_id, error=traceback.format_exc(limit=1), finished=True)]
            out: list[Emission] = []
            for job in batch:
                out += self._decode([job])
            return out
        out, offset = [], 0
        for job in batch:
            n = int(job.latents.shape[0])
            out.append(
                Emission(
                    job.request_id,
                    outputs={self.port: to_output(pixels[offset : offset + n], job.params.output_type)},
                    finished=True,
                )
            )
            offset += n
        return out
