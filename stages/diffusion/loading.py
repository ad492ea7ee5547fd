"""Loading diffusion components from a diffusers-format directory or from per-component paths.

A diffusers directory has model_index.json ({"_class_name": "StableDiffusion3Pipeline",
"transformer": ["diffusers", "SD3Transformer2DModel"], ...}) and one subfolder per component.
A stage loads only the components its adapter names. Stage params may point single
components elsewhere: `components: {transformer: /path/to/transformer_dir}`; such a folder's
class is read from its own config (diffusers `_class_name`, transformers `architectures`,
tokenizer_config `tokenizer_class`) when model_index.json does not name it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from omnistage.stages.diffusion.adapters import PIPELINE_FAMILIES, TRANSFORMER_FAMILIES

_TRANSFORMERS_TOKENIZER_ALIASES = {
    # transformers 5 folded the *Fast classes into the base names
    "T5TokenizerFast": "T5Tokenizer",
    "CLIPTokenizerFast": "CLIPTokenizer",
}


def read_model_index(root: Path | None) -> dict[str, Any]:
    if root is None:
        return {}
    index = Path(root) / "model_index.json"
    return json.loads(index.read_text()) if index.exists() else {}


def detect_family(root: Path | None, params: dict[str, Any]) -> str:
    """Family from stage params `family`, model_index.json, or the transformer's config."""
    if params.get("family"):
        return str(params["family"])
    index = read_model_index(root)
    name = index.get("_class_name")
    if name in PIPELINE_FAMILIES:
        return PIPELINE_FAMILIES[name]
    candidates = []
    overrides = params.get("components") or {}
    if "transformer" in overrides:
        candidates.append(Path(overrides["transformer"]))
    if root is not None:
        candidates += [Path(root) / "transformer", Path(root)]
    for folder in candidates:
        cfg = folder / "config.json"
        if cfg.exists():
            cls = json.loads(cfg.read_text()).get("_class_name")
            if cls in TRANSFORMER_FAMILIES:
                return TRANSFORMER_FAMILIES[cls]
    raise ValueError(
        f"cannot tell the diffusion family of {root}: no known model_index.json _class_name "
        f"({', '.join(PIPELINE_FAMILIES)}) and no known transformer config; set params.family"
    )


def _class_from_folder(folder: Path) -> tuple[str, str]:
    for fname in ("config.json", "scheduler_config.json"):
        cfg = folder / fname
        if cfg.exists():
            data = json.loads(cfg.read_text())
            if "_class_name" in data:
                return "diffusers", data["_class_name"]
            if data.get("architectures"):
                return "transformers", data["architectures"][0]
    tok = folder / "tokenizer_config.json"
    if tok.exists():
        return "transformers", json.loads(tok.read_text())["tokenizer_class"]
    raise ValueError(f"cannot tell which class to load from {folder}")


def _resolve_class(library: str, class_name: str):
    if library == "transformers":
        class_name = _TRANSFORMERS_TOKENIZER_ALIASES.get(class_name, class_name)
        module = importlib.import_module("transformers")
        if not hasattr(module, class_name):
            raise ValueError(f"transformers has no class {class_name!r}")
        return getattr(module, class_name)
    module = importlib.import_module(library)
    return getattr(module, class_name)


def load_component(
    name: str,
    root: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    overrides: dict[str, str] | None = None,
    adapter_cls: Any = None,
) -> Any:
    """One component (model, tokenizer or scheduler), or None when model_index lists it as null."""
    overrides = overrides or {}
    index = read_model_index(root)
    if name in overrides:
        folder = Path(overrides[name]).expanduser()
        library, class_name = index[name] if index.get(name) and index[name][0] else _class_from_folder(folder)
    else:
        if root is None:
            raise ValueError(f"component {name!r}: no model directory and no components.{name} path")
        folder = Path(root) / name
        entry = index.get(name)
        if entry is None and name in index:
            return None  # listed as absent (e.g. an optional text encoder)
        if entry is None or entry[0] is None:
            if not folder.exists():
                raise ValueError(f"component {name!r} not found under {root}")
            library, class_name = _class_from_folder(folder)
        else:
            library, class_name = entry
    if adapter_cls is not None:
        custom = adapter_cls.load_override(name, folder, dtype)
        if custom is not None:
            if isinstance(custom, torch.nn.Module):
                custom = custom.to(device).eval()
                custom.requires_grad_(False)
            return custom
    cls = _resolve_class(library, class_name)
    if "Tokenizer" in class_name:
        return cls.from_pretrained(folder)
    if "Scheduler" in class_name:
        return cls.from_pretrained(folder)
    model = cls.from_pretrained(folder, dtype=dtype)
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model


def load_components(
    names: tuple[str, ...] | list[str],
    root: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    overrides: dict[str, str] | None = None,
    optional: tuple[str, ...] = (),
    adapter_cls: Any = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = load_component(name, root, dtype, device, overrides, adapter_cls)
        except ValueError:
            if name in optional:
                out[name] = None
            else:
                raise
    return out


def stage_root(model_path: str | Path | None) -> Path | None:
    """The diffusers root for a stage's resolved model path (the path itself, or its parent
    when the stage names a component subfolder), or None (per-component paths only)."""
    if model_path is None:
        return None
    path = Path(model_path)
    if (path / "model_index.json").exists():
        return path
    if (path.parent / "model_index.json").exists():
        return path.parent
    return None


def build_adapter(ctx: Any, role: str, extra_args: tuple = ()) -> Any:
    """Load the components of `role` ("TEXT_ENCODER", "DENOISER" or "VAE") for a stage context
    and build that family's adapter."""
    from omnistage.stages.diffusion.adapters import family_module

    params = dict(ctx.params or {})
    root = stage_root(ctx.model_path)
    overrides = dict(params.get("components") or {})
    if root is None and ctx.model_path is not None:
        # a bare component folder: the stage's own component
        default_component = {"TEXT_ENCODER": "text_encoder", "DENOISER": "transformer", "VAE": "vae"}[role]
        overrides.setdefault(default_component, str(ctx.model_path))
    family = detect_family(root, {**params, "components": overrides})
    cls = getattr(family_module(family), role)
    optional = tuple(getattr(cls, "optional_components", ()))
    components = load_components(
        cls.component_names, root, ctx.dtype, ctx.device, overrides, optional=optional, adapter_cls=cls
    )
    if role == "DENOISER" and "vae" not in components:
        vae_dir = Path(overrides["vae"]) if "vae" in overrides else (root / "vae" if root else None)
        if vae_dir is not None and (vae_dir / "config.json").exists():
            components["vae_config"] = json.loads((vae_dir / "config.json").read_text())
    return cls(components, ctx.device, ctx.dtype, *extra_args)
