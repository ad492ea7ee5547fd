"""Load a decoder's weights from a Hugging Face directory (single or sharded safetensors)."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from tqdm import tqdm

from omnistage.stages.ar.config import ModelConfig
from omnistage.stages.ar.model import DecoderModel


def checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_path}")
    return files


def load_model(
    cfg: ModelConfig,
    model_path: str,
    dtype: torch.dtype,
    device: str | torch.device,
    weight_prefix: str = "",
    show_progress: bool | None = None,
) -> DecoderModel:
    """Build the decoder in `dtype` on `device` and fill it by parameter name.

    weight_prefix: only tensors named "<prefix>model.*" / "<prefix>lm_head.*" (and a talker's
    "<prefix>codec_head.*" / "<prefix>thinker_to_talker_proj.*") are loaded
    (e.g. "thinker." inside a Qwen2.5-Omni checkpoint); others are ignored.
    """
    with torch.device("meta"):
        model = DecoderModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    files = checkpoint_files(model_path)
    total_bytes = sum(os.path.getsize(f) for f in files)
    if show_progress is None:
        show_progress = total_bytes > 256 * 2**20
    expected = model.expected_weights()
    loaded: set[str] = set()
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights", disable=not show_progress) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if not key.startswith(weight_prefix):
                        continue
                    name = key[len(weight_prefix) :]
                    owned = ("model.", cfg.lm_head_name + ".") + (
                        (cfg.input_projection + ".",) if cfg.input_projection else ()
                    )
                    if not name.startswith(owned):
                        continue
                    t = f.get_tensor(key)
                    if model.load_weight(name, t.to(dtype)):
                        loaded.add(name)
                    bar.update(t.numel() * t.element_size())
    missing = expected - loaded
    if missing:
        raise ValueError(
            f"checkpoint {model_path} (prefix {weight_prefix!r}) lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}"
        )
    model.eval()
    model.finalize()
    return model
