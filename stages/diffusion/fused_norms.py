"""The DiT's adaLN-Zero norms on the fused Triton kernel (kernels/triton/adaln.py).

`fuse_adaln(transformer)` turns each diffusers AdaLayerNormZero / AdaLayerNormZeroSingle that
normalizes with a plain LayerNorm into its fused form in place (same parameters, same outputs
up to the last bit of a half-precision value); the denoiser does it when a transformer is
loaded on CUDA (kernels.triton.selected; OMNISTAGE_TRITON=0 keeps diffusers' modules). SD3's
and FLUX's blocks open both halves with one; other norms are left as they are.
"""

from __future__ import annotations

import torch
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle


def _fusable(norm: torch.nn.Module, x: torch.Tensor, emb: torch.Tensor | None) -> bool:
    """The kernel's case: [B, N, D] hidden states with a conditioning row per sample of their
    dtype, and no gradient wanted (it has no backward); anything else runs diffusers' code."""
    return (
        emb is not None
        and x.dim() == 3
        and x.stride(-1) == 1
        and emb.shape[0] == x.shape[0]
        and emb.dtype == x.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or emb.requires_grad or norm.linear.weight.requires_grad))
    )


class FusedAdaLayerNormZero(AdaLayerNormZero):
    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        if self.emb is not None or not _fusable(self, x, emb):
            return super().forward(x, timestep, class_labels, hidden_dtype, emb)
        from omnistage.kernels.triton import adaln

        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(6, dim=1)
        return adaln.ada_layer_norm(x, shift_msa, scale_msa, self.norm.eps), gate_msa, shift_mlp, scale_mlp, gate_mlp


class FusedAdaLayerNormZeroSingle(AdaLayerNormZeroSingle):
    def forward(self, x, emb=None):
        if not _fusable(self, x, emb):
            return super().forward(x, emb)
        from omnistage.kernels.triton import adaln

        shift_msa, scale_msa, gate_msa = self.linear(self.silu(emb)).chunk(3, dim=1)
        return adaln.ada_layer_norm(x, shift_msa, scale_msa, self.norm.eps), gate_msa


_FUSED = {AdaLayerNormZero: FusedAdaLayerNormZero, AdaLayerNormZeroSingle: FusedAdaLayerNormZeroSingle}


def fuse_adaln(model: torch.nn.Module) -> int:
    """Swap the fusable adaLN-Zero norms of `model` for their fused forms; returns how many."""
    swapped = 0
    for module in model.modules():
        fused = _FUSED.get(type(module))
        norm = getattr(module, "norm", None)
        # a plain LayerNorm without affine (FP32LayerNorm, a subclass, computes otherwise)
        if fused is not None and type(norm) is torch.nn.LayerNorm and norm.weight is None:
            module.__class__ = fused
            swapped += 1
    return swapped


def unfuse_adaln(model: torch.nn.Module) -> int:
    """Back to diffusers' modules (the GPU bench times both on one model)."""
    back = {fused: plain for plain, fused in _FUSED.items()}
    restored = 0
    for module in model.modules():
        plain = back.get(type(module))
        if plain is not None:
            module.__class__ = plain
            restored += 1
    return restored
