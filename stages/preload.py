"""What the worker fork server imports: the stage kinds this process uses, and their libraries.

Every stage worker is forked from one fork server (runtime/fork_server.py). What the fork server
imported, each worker shares copy-on-write; what a worker imports after the fork is its own
copy. So the fork server imports the modules of the stage kinds in use — those `omnistage
serve` read from its files before starting it, or else the kinds whose module this process
has imported, which loading a pipeline file does for every kind it names — plus the library modules those kinds' workers import while building their engines
(diffusers' model classes are loaded lazily, on first attribute access, so `import
diffusers` alone shares almost nothing). A kind no pipeline uses costs nothing: an LLM-only
or torch_module-only server never imports diffusers.

`omnistage.runtime.preload_done`, imported last, freezes the fork server's heap so that
workers' garbage collections do not copy those shared pages (see that module).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

# kind -> library modules its workers import while building an engine, beyond the kind's own
_DIFFUSERS_MODELS = (
    "transformers.modeling_utils",
    "diffusers.models.modeling_utils",
    "diffusers.models.transformers",
    "diffusers.models.autoencoders",
    "diffusers.schedulers",
)
# Module.to_empty, which the AR loader calls, imports it (about a second per worker otherwise)
_AR_ENGINE = ("transformers", "torch.fx.experimental.symbolic_shapes")
# Qwen2.5-Omni's towers and token2wav come from transformers' modeling module (seconds to import)
_OMNI_MODELS = ("transformers.models.qwen2_5_omni.modeling_qwen2_5_omni",)
# the thinker's and the audio encoder's input processing (stages/omni/inputs.py)
_OMNI_PROCESSOR = (
    "transformers.models.auto.tokenization_auto",
    "transformers.models.whisper.feature_extraction_whisper",
)
KIND_LIBRARIES: dict[str, tuple[str, ...]] = {
    "ar_lm": _AR_ENGINE,
    "text_encoder": _DIFFUSERS_MODELS,
    "denoiser": _DIFFUSERS_MODELS,
    "vae_decoder": _DIFFUSERS_MODELS,
    "audio_encoder": _OMNI_MODELS + _OMNI_PROCESSOR,
    "vision_encoder": _OMNI_MODELS + ("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",),
    "thinker": _AR_ENGINE + _OMNI_PROCESSOR,
    "talker": _AR_ENGINE,
    "token2wav": _OMNI_MODELS,
}
FREEZE_MODULE = "omnistage.runtime.preload_done"


def stage_preload_modules(kinds: Iterable[str] | None = None) -> list[str]:
    """The modules of `kinds` (default: every stage kind imported in this process), then their
    libraries."""
    from omnistage.stages.registry import KIND_MODULES

    if kinds is None:
        kinds = [kind for kind, module in KIND_MODULES.items() if module in sys.modules]
    kinds = [kind for kind in kinds if kind in KIND_MODULES]
    mods = [KIND_MODULES[kind] for kind in kinds]
    for kind in kinds:
        mods.extend(KIND_LIBRARIES.get(kind, ()))
    return list(dict.fromkeys(mods))
