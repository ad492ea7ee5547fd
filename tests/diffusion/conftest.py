"""Fixtures for diffusion tests: tiny checkpoints, diffusers references, an in-process graph.

`LocalGraph` drives the three diffusion engines in one process, routing emissions the way the
runtime does (text_encoder -> denoiser -> vae_decoder), so engine-level tests can run requests
that join at different steps, be cancelled, and so on, with the real engines.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
import torch

from omnistage.graph.spec import BatchingSpec
from omnistage.models.recipes import build_recipe
from omnistage.stages.base import StageContext, StageRequest

torch.set_num_threads(int(os.environ.get("OMNISTAGE_TEST_THREADS", "1")))

TOL = 1e-4  # on [0, 1] pixels; agreement is float32 rounding (see test_sensitivity_and_mixed.py)


def make_ctx(kind: str, model_path, stage_name: str | None = None, params=None, **batching) -> StageContext:
    return StageContext(
        stage_name=stage_name or kind,
        kind=kind,
        model_path=str(model_path),
        model_subfolder=None,
        model_prefix=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
        batching=BatchingSpec(policy="step" if kind == "denoiser" else "dynamic", **{"max_wait_ms": 0.0, **batching}),
        params=dict(params or {}),
    )


class LocalGraph:
    """text_encoder -> denoiser -> vae_decoder engines in this process."""

    def __init__(self, model_dir, max_batch_size: int = 8, max_latent_tokens: int | None = None):
        from omnistage.stages.diffusion.denoiser import DenoiserStage
        from omnistage.stages.diffusion.text_encoder import TextEncoderStage
        from omnistage.stages.diffusion.vae import VaeDecoderStage

        self.te = TextEncoderStage(make_ctx("text_encoder", model_dir))
        self.dn = DenoiserStage(
            make_ctx("denoiser", model_dir, max_batch_size=max_batch_size, max_latent_tokens=max_latent_tokens)
        )
        self.vae = VaeDecoderStage(make_ctx("vae_decoder", model_dir))
        self.params: dict[str, dict] = {}
        self.results: dict[str, Any] = {}
        self.errors: dict[str, tuple[str, str, str]] = {}  # rid -> (stage, kind, message)
        self.warnings: dict[str, list[str]] = {}
        self.progress: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def submit(self, rid: str, prompt: str, **params) -> None:
        params.setdefault("output_type", "float")
        self.params[rid] = params
        self.te.add(StageRequest(rid, {"prompt": prompt}, dict(params)))

    def abort(self, rid: str) -> None:
        for eng in (self.te, self.dn, self.vae):
            eng.abort(rid)

    def busy(self) -> bool:
        return any(e.num_requests() or e.has_work() for e in (self.te, self.dn, self.vae))

    def tick(self) -> None:
        """One step of every stage that has work (as concurrent workers would)."""
        for em in self.te.step():
            if em.error:
                self.errors[em.request_id] = ("text_encoder", em.error_kind, em.error)
                continue
            self.warnings[em.request_id] = em.outputs.get("warnings", [])
            inputs = {k: v for k, v in em.outputs.items() if k != "warnings"}
            self.dn.add(StageRequest(em.request_id, inputs, dict(self.params[em.request_id])))
        for em in self.dn.step():
            if em.error:
                self.errors[em.request_id] = ("denoiser", em.error_kind, em.error)
                continue
            if em.progress is not None:
                self.progress[em.request_id].append(em.progress)
            if em.finished:
                self.vae.add(
                    StageRequest(em.request_id, {"latents": em.outputs["latents"]}, dict(self.params[em.request_id]))
                )
        for em in self.vae.step():
            if em.error:
                self.errors[em.request_id] = ("vae_decoder", em.error_kind, em.error)
            elif em.finished:
                self.results[em.request_id] = em.outputs["image"]

    def run(self) -> None:
        while self.busy():
            self.tick()


@pytest.fixture(scope="session")
def sd3_dir():
    return build_recipe("tiny-sd3")


@pytest.fixture(scope="session")
def flux_dir():
    return build_recipe("tiny-flux")


_PIPES: dict[str, Any] = {}


def diffusers_pipe(model_dir):
    from diffusers import DiffusionPipeline

    key = str(model_dir)
    if key not in _PIPES:
        _PIPES[key] = DiffusionPipeline.from_pretrained(model_dir, dtype=torch.float32)
        _PIPES[key].set_progress_bar_config(disable=True)
    return _PIPES[key]


def reference_image(model_dir, prompt: str, **params) -> np.ndarray:
    """The diffusers pipeline's [0,1] float image(s) [n, H, W, 3] for the same params."""
    pipe = diffusers_pipe(model_dir)
    params = dict(params)
    params.pop("output_type", None)
    seed = params.pop("seed")
    gen = torch.Generator("cpu").manual_seed(seed)
    return pipe(prompt, generator=gen, output_type="np", **params).images


@pytest.fixture
def local_graph():
    return LocalGraph


@pytest.fixture
def reference():
    return reference_image


@pytest.fixture(scope="session")
def sd3_denoise_kit(sd3_dir):
    """(denoiser adapter, text conditioning for "a cat" with its negative row) on tiny-sd3."""
    from omnistage.stages.diffusion.adapters.base import TextConditioning
    from omnistage.stages.diffusion.loading import build_adapter

    te = build_adapter(make_ctx("text_encoder", sd3_dir), "TEXT_ENCODER")
    enc = te.encode(["a cat", ""], 24)
    adapter = build_adapter(make_ctx("denoiser", sd3_dir), "DENOISER")
    return adapter, TextConditioning(enc.embeds, enc.pooled)


@pytest.fixture
def make_ctx_fn():
    return make_ctx
