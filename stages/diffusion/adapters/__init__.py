"""Model-family adapters for the diffusion stages.

FAMILY_MODULES maps a family name to the module that defines its adapters; each module sets
module-level names TEXT_ENCODER, DENOISER and VAE (adapter classes). `PIPELINE_FAMILIES`
maps a diffusers model_index.json `_class_name` to a family.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILY_MODULES: dict[str, str] = {
    "sd3": "omnistage.stages.diffusion.adapters.sd3",
    "flux": "omnistage.stages.diffusion.adapters.flux",
    "wan": "omnistage.stages.diffusion.adapters.wan",
}

PIPELINE_FAMILIES: dict[str, str] = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "WanPipeline": "wan",
}

# transformer class name -> family (for per-stage paths without a model_index.json)
TRANSFORMER_FAMILIES: dict[str, str] = {
    "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux",
    "WanTransformer3DModel": "wan",
}


def family_module(family: str) -> ModuleType:
    if family not in FAMILY_MODULES:
        raise KeyError(f"unknown diffusion family {family!r}; known: {', '.join(sorted(FAMILY_MODULES))}")
    return importlib.import_module(FAMILY_MODULES[family])
