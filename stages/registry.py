"""Stage kind registry.

Kinds are listed here by import path so validation imports only the kinds a file uses.
Each module registers its class with @register_stage; `get_stage_class` imports lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnistage.stages.base import StageEngine

# kind -> module that defines it. Add a line when you add a kind.
KIND_MODULES: dict[str, str] = {
    # generic / test kinds (dynamic batching)
    "torch_module": "omnistage.stages.generic",
    "noop": "omnistage.stages.generic",
    # autoregressive LM (continuous batching over a paged KV cache)
    "ar_lm": "omnistage.stages.ar.stage",
    # diffusion
    "text_encoder": "omnistage.stages.diffusion.text_encoder",
    "denoiser": "omnistage.stages.diffusion.denoiser",
    "vae_decoder": "omnistage.stages.diffusion.vae",
    # Qwen2.5-Omni (stages/omni)
    "audio_encoder": "omnistage.stages.omni.audio_encoder",
    "vision_encoder": "omnistage.stages.omni.vision_encoder",
    "thinker": "omnistage.stages.omni.thinker",
    "talker": "omnistage.stages.omni.talker",
    "token2wav": "omnistage.stages.omni.token2wav",
}

_REGISTRY: dict[str, type[StageEngine]] = {}


def register_stage(kind: str):
    def deco(cls: type[StageEngine]) -> type[StageEngine]:
        cls.kind = kind
        _REGISTRY[kind] = cls
        return cls

    return deco


def known_kinds() -> list[str]:
    return sorted(set(KIND_MODULES) | set(_REGISTRY))


def get_stage_class(kind: str) -> type[StageEngine]:
    if kind not in _REGISTRY:
        module = KIND_MODULES.get(kind)
        if module is None:
            raise KeyError(kind)
        importlib.import_module(module)
    return _REGISTRY[kind]
