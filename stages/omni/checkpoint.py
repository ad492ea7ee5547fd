"""Reading one Qwen2.5-Omni checkpoint directory: configs and weights by prefix.

Every omni stage loads from the same Hugging Face directory and takes only its own tensors
(`thinker.audio_tower.`, `thinker.visual.`, `thinker.`, `talker.`, ...), so a stage never holds
another stage's weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omnistage.stages.ar.loader import checkpoint_files


def read_config(model_dir: str | Path) -> dict[str, Any]:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if "thinker_config" not in raw:
        raise ValueError(f"{model_dir}/config.json is not a Qwen2.5-Omni config (no thinker_config)")
    return raw


def prefixed_state(model_dir: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """Tensors named `<prefix>...`, with the prefix removed."""
    state = {}
    for path in checkpoint_files(str(model_dir)):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = f.get_tensor(key)
    if not state:
        raise ValueError(f"{model_dir}: no weights under {prefix!r}")
    return state


def load_submodule(module: torch.nn.Module, model_dir: str | Path, prefix: str) -> torch.nn.Module:
    """Fill `module` with the checkpoint's `<prefix>*` tensors; every parameter must be there."""
    missing, unexpected = module.load_state_dict(prefixed_state(model_dir, prefix), strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir} {prefix!r}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return module.eval()
