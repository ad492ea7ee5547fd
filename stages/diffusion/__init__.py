"""Diffusion stages: text encoder(s) -> denoiser (step-level batching) -> VAE decoder.

See docs/diffusion.md. `stage_params` builds the per-stage params dict a caller passes to
Pipeline.run for a diffusion graph: the same generation parameters under every diffusion stage.
"""

from __future__ import annotations

from typing import Any

DIFFUSION_KINDS = ("text_encoder", "denoiser", "vae_decoder")


def stage_params(spec: Any, generation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{stage_name: generation} for every diffusion stage of `spec` (a PipelineSpec, or a
    Pipeline whose .spec is one)."""
    spec = getattr(spec, "spec", spec)
    return {name: dict(generation) for name, st in spec.stages.items() if st.kind in DIFFUSION_KINDS}
