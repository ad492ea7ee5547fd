"""Fused elementwise kernels of a decoder layer, each beside its torch reference.

- rms_norm / add_rms_norm_: RMSNorm over the last dim of 2-D rows or of a strided 3-D view
  (Qwen3's per-head q/k norms inside the fused qkv output), optionally adding the residual
  in place first. Arithmetic as transformers does it: normalize in float32, round to the
  input dtype, then scale by the weight.
- rope_: rotate-half RoPE in place on a strided [tokens, heads, d] view (the q|k columns of
  the fused qkv output). cos/sin either per token ([N, d]) or gathered in the kernel from
  tables by position; M-RoPE gives 3 position rows and each rotary dim's axis.
- silu_mul: silu(gate) * up of the fused gate|up projection output.
- store_kv: scatter of a step's new K|V rows into their cache slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


# ---------------------------------------------------------------- RMSNorm (+ residual)
@triton.jit
def _rms_norm_kernel(
    X, RES, W, OUT, eps, rows_per_outer, stride_x0, stride_x1, stride_r0, stride_o0, stride_o1,
    D: tl.constexpr, D_PAD: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    i = r // rows_per_outer
    j = r % rows_per_outer
    dd = tl.arange(0, D_PAD)
    mask = dd < D
    x_ptr = X + i.to(tl.int64) * stride_x0 + j * stride_x1 + dd
    x = tl.load(x_ptr, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(RES + i.to(tl.int64) * stride_r0 + dd, mask=mask, other=0.0)).to(x.dtype)
        tl.store(x_ptr, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(W + dd, mask=mask, other=0.0).to(tl.float32)
    y = normed * w
    tl.store(OUT + i.to(tl.int64) * stride_o0 + j * stride_o1 + dd, y.to(OUT.dtype.element_ty), mask=mask)


def _rms_launch(x, residual, weight, eps, out):
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    o3 = out.unsqueeze(1) if out.dim() == 2 else out
    n0, n1, d = x3.shape
    assert x3.stride(2) == 1 and o3.stride(2) == 1
    if x3.numel() == 0:
        return
    res = residual if residual is not None else x3
    _rms_norm_kernel[(n0 * n1,)](
        x3, res, weight, o3, eps, n1, x3.stride(0), x3.stride(1), res.stride(0), o3.stride(0), o3.stride(1),
        D=d, D_PAD=_pow2(d), HAS_RES=residual is not None,
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, d] or a [N, heads, d] view (last dim contiguous); out may be x (in place)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_launch(x, None, weight, eps, out)
    return out


def add_rms_norm_(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y += residual in place (y [N, d] with unit last stride); returns rms_norm(y)."""
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    _rms_launch(y, residual, weight, eps, out)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


# ---------------------------------------------------------------- RoPE / M-RoPE in place
@triton.jit
def _rope_kernel(
    X, COS, SIN, POS, AXIS, stride_xn, stride_xh, stride_cos, stride_pos,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, GATHER: tl.constexpr, SIGNED_SIN: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, HALF_PAD)
    mask = j < HALF
    if GATHER:  # table row = the position of this token on each dim's axis (M-RoPE: 3 axes)
        ax1 = tl.load(AXIS + j, mask=mask, other=0)
        ax2 = tl.load(AXIS + HALF + j, mask=mask, other=0)
        row1 = tl.load(POS + ax1 * stride_pos + n, mask=mask, other=0).to(tl.int64) * stride_cos
        row2 = tl.load(POS + ax2 * stride_pos + n, mask=mask, other=0).to(tl.int64) * stride_cos
    else:
        row1 = n.to(tl.int64) * stride_cos
        row2 = row1
    c1 = tl.load(COS + row1 + j, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + row2 + HALF + j, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + row1 + j, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + row2 + HALF + j, mask=mask, other=0.0).to(tl.float32)
    if not SIGNED_SIN:
        s1 = -s1
    ptr = X + n.to(tl.int64) * stride_xn + h * stride_xh + j
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(ptr, (x1f * c1 + x2f * s1).to(x1.dtype), mask=mask)
    tl.store(ptr + HALF, (x2f * c2 + x1f * s2).to(x1.dtype), mask=mask)


def rope_(
    x: torch.Tensor,  # [N, heads, d] view, last dim contiguous; rotated in place
    cos: torch.Tensor,  # [N, d] per token, or [max_pos, d] table when positions is given
    sin: torch.Tensor,  # like cos; signed_sin=True: [-sin | sin] by halves (model.signed_sin)
    positions: torch.Tensor | None = None,  # [N] or [axes, N]: gather cos/sin rows in the kernel
    axis_of_dim: torch.Tensor | None = None,  # [d] int32: the positions row driving each dim (M-RoPE)
    signed_sin: bool = False,
) -> torch.Tensor:
    N, heads, d = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    if N == 0:
        return x
    gather = positions is not None
    pos = axis = cos
    stride_pos = 0
    if gather:
        pos = positions if positions.dim() == 2 else positions.unsqueeze(0)
        pos = pos.contiguous()
        stride_pos = pos.stride(0)
        axis = axis_of_dim if axis_of_dim is not None else torch.zeros(d, dtype=torch.int32, device=x.device)
    _rope_kernel[(N, heads)](
        x, cos, sin, pos, axis, x.stride(0), x.stride(1), cos.stride(0), stride_pos,
        HALF=d // 2, HALF_PAD=_pow2(d // 2), GATHER=gather, SIGNED_SIN=signed_sin,
    )  # fmt: skip
    return x


def rope_ref(x, cos_table, sin_table, positions, axis_of_dim=None) -> torch.Tensor:
    """Out of place, float32 math: rows of the tables picked per dim from that dim's axis."""
    pos = positions if positions.dim() == 2 else positions.unsqueeze(0)
    d = x.shape[-1]
    axis = axis_of_dim.long() if axis_of_dim is not None else torch.zeros(d, dtype=torch.long)
    dims = torch.arange(d)
    rows = pos[axis.to(pos.device)].long()  # [d, N]
    cos = cos_table[rows, dims.unsqueeze(1)].t().float()  # [N, d]
    sin = sin_table[rows, dims.unsqueeze(1)].t().float()
    xf = x.float()
    half = d // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


# ---------------------------------------------------------------- SiLU-and-multiply
@triton.jit
def _silu_mul_kernel(G, U, OUT, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + r * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(OUT + r * stride_o + cols, y.to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [N, I] views with unit last stride (e.g. halves of gate|up)."""
    n, cols = gate.shape
    out = torch.empty(n, cols, dtype=gate.dtype, device=gate.device)
    if n == 0:
        return out
    assert gate.stride(1) == 1 and up.stride(1) == 1
    block = min(1024, _pow2(cols))
    _silu_mul_kernel[(n, triton.cdiv(cols, block))](
        gate, up, out, cols, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block
    )
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


# ---------------------------------------------------------------- KV-cache store
@triton.jit
def _store_kv_kernel(
    KV_NEW, SLOTS, CACHE, kv_heads, stride_n, stride_h, stride_c0, stride_c1, stride_c2,
    D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    hh = tl.program_id(1)  # 0..2*kv_heads-1: K heads then V heads
    slot = tl.load(SLOTS + n).to(tl.int64)
    if slot >= 0:  # negative: a padding row with nothing to store
        dd = tl.arange(0, D_PAD)
        mask = dd < D
        x = tl.load(KV_NEW + n.to(tl.int64) * stride_n + hh * stride_h + dd, mask=mask)
        which = hh // kv_heads
        head = hh % kv_heads
        tl.store(CACHE + which * stride_c0 + head * stride_c1 + slot * stride_c2 + dd, x, mask=mask)


def store_kv(kv_new: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """kv_new [N, 2 * kvh, d] (K heads, then V heads); kv_cache [2, kvh, slots, d]."""
    n, hh, d = kv_new.shape
    if n == 0:
        return
    assert kv_new.stride(2) == 1 and kv_cache.stride(3) == 1
    _store_kv_kernel[(n, hh)](
        kv_new, slot_mapping, kv_cache, hh // 2, kv_new.stride(0), kv_new.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), D=d, D_PAD=_pow2(d),
    )  # fmt: skip


def store_kv_ref(kv_new: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> None:
    kvh = kv_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kv_cache[0][:, slots] = kv_new[keep, :kvh].transpose(0, 1)
    kv_cache[1][:, slots] = kv_new[keep, kvh:].transpose(0, 1)
