"""adaLN-modulate: LayerNorm without affine, then `* (1 + scale) + shift` per sample, in one pass.

A DiT block opens each of its attention and MLP halves with it (diffusers' AdaLayerNormZero and
AdaLayerNormZeroSingle: SD3, FLUX). In torch it is a LayerNorm kernel and two broadcast
elementwise kernels, three reads and writes of the hidden states; here it is one read and one
write. The statistics and the modulation are computed in float32 and rounded once; torch
rounds the normalized rows to the input dtype before modulating, so half-precision results
differ from it in the last bit or two (tests/kernels/test_adaln.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _ada_layer_norm_kernel(
    X, SHIFT, SCALE, OUT, eps, rows_per_sample, stride_xb, stride_xn, stride_sb, stride_cb, stride_ob, stride_on,
    D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    b = r // rows_per_sample
    n = r % rows_per_sample
    dd = tl.arange(0, D_PAD)
    mask = dd < D
    x = tl.load(X + b.to(tl.int64) * stride_xb + n.to(tl.int64) * stride_xn + dd, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, 0) / D
    centered = tl.where(mask, xf - mean, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / D + eps)
    shift = tl.load(SHIFT + b.to(tl.int64) * stride_sb + dd, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(SCALE + b.to(tl.int64) * stride_cb + dd, mask=mask, other=0.0).to(tl.float32)
    y = centered * inv * (1.0 + scale) + shift
    tl.store(OUT + b.to(tl.int64) * stride_ob + n.to(tl.int64) * stride_on + dd, y.to(x.dtype), mask=mask)


def ada_layer_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, N, D] (last dim contiguous); shift, scale [B, D] (rows may be strided, as the chunks
    of one projection are). Returns layer_norm(x) * (1 + scale[:, None]) + shift[:, None]."""
    B, N, D = x.shape
    assert x.stride(2) == 1 and shift.stride(1) == 1 and scale.stride(1) == 1
    assert shift.shape == (B, D) and scale.shape == (B, D)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    _ada_layer_norm_kernel[(B * N,)](
        x, shift, scale, out, eps, N, x.stride(0), x.stride(1), shift.stride(0), scale.stride(0),
        out.stride(0), out.stride(1), D=D, D_PAD=triton.next_power_of_2(D),
    )  # fmt: skip
    return out


def ada_layer_norm_ref(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers' arithmetic: LayerNorm in the input dtype, then the modulation."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]
