"""What the AR engine calls when the Triton kernels are selected (see the package doc).

`OPS` has the interface of kernels.cpu_fused's module (rms_norm, add_rms_norm_, rope_,
qk_norm_rope_, silu_mul), so the model's norm / attention / MLP modules take it in the same
`fused` slot; `paged_attention` replaces stages.ar.attention.paged_attention.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from omnistage.kernels.triton import elementwise as ew
from omnistage.kernels.triton.decode_attention import paged_decode_attention
from omnistage.kernels.triton.extend_attention import paged_extend_attention


def _rope_signed_(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    return ew.rope_(qk, cos, sin_signed, signed_sin=True)


def _qk_norm_rope_(qk, num_q_heads, q_weight, k_weight, eps, cos, sin_signed) -> torch.Tensor:
    """Qwen3: per-head RMSNorm of q and k in place, then RoPE, all inside the fused qkv output."""
    q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
    ew.rms_norm(q, q_weight, eps, out=q)
    ew.rms_norm(k, k_weight, eps, out=k)
    return _rope_signed_(qk, cos, sin_signed)


OPS = SimpleNamespace(
    rms_norm=ew.rms_norm,
    add_rms_norm_=ew.add_rms_norm_,
    rope_=_rope_signed_,
    qk_norm_rope_=_qk_norm_rope_,
    silu_mul=ew.silu_mul,
)


def paged_attention(q, k, v, kv_cache, meta, scale: float, layer_index: int, out_only: bool = False, kv=None):
    """Same contract as stages.ar.attention.paged_attention, with meta.paged set: store this
    step's K/V, decode rows through the decode kernel, prefill rows through the extend kernel."""
    n_q, n_heads, d = q.shape
    if kv is None:
        kv = torch.cat((k, v), dim=1)
    ew.store_kv(kv, meta.slot_mapping, kv_cache)
    pm = meta.paged
    out = torch.empty(n_q, n_heads, d, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    bs = meta.block_size
    if nd:
        paged_decode_attention(
            q[:nd], kv_cache, pm.decode_tables, pm.decode_lens, scale, bs, pm.num_splits, out=out[:nd]
        )
    chunks = pm.prefill_last_rows if out_only else pm.prefills
    if chunks.max_q_len:
        paged_extend_attention(
            q,
            kv_cache,
            chunks.block_tables,
            chunks.q_starts,
            chunks.q_lens,
            chunks.ctx_lens,
            chunks.max_q_len,
            scale,
            bs,
            out=out,
        )
    return out.view(n_q, n_heads * d)
