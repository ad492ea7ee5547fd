"""RMSNorm (+ residual), RoPE / M-RoPE, SiLU-and-multiply and the KV-cache store vs torch /
transformers (TRITON_INTERPRET=1, see conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import apply_rotary_pos_emb

from omnistage.kernels.triton import elementwise as ew
from omnistage.stages.ar.model import RotaryEmbedding, signed_sin

from .conftest import TOL

DTYPES = ["float32", "float16"]


def _hf_norm(weight: torch.Tensor, eps: float) -> Qwen2RMSNorm:
    norm = Qwen2RMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_transformers(dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    hidden = 40  # not a power of two: the padded lanes must not count in the mean
    x = (3 * torch.randn(7, hidden, generator=g)).to(dt)
    res = torch.randn(7, hidden, generator=g).to(dt)
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dt)
    hf = _hf_norm(w, 1e-6)
    with torch.no_grad():
        torch.testing.assert_close(ew.rms_norm(x, w, 1e-6), hf(x), **TOL[dtype])
        y = x.clone()
        normed = ew.add_rms_norm_(y, res, w, 1e-6)
        torch.testing.assert_close(y, x + res, atol=0, rtol=0)  # the sum is rounded once, like torch's add
        torch.testing.assert_close(normed, hf(x + res), **TOL[dtype])


def test_per_head_rms_norm_in_place_on_a_strided_view():
    """Qwen3's q/k norms: [tokens, heads, d] columns of the fused qkv output, normalized in place."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (6 + 2) * 16, generator=g)
    before = qkv.clone()
    w = torch.rand(16, generator=g) + 0.5
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    ew.rms_norm(q, w, 1e-6, out=q)
    with torch.no_grad():
        expected = _hf_norm(w, 1e-6)(before[:, : 4 * 16].view(5, 4, 16))
    torch.testing.assert_close(q, expected, **TOL["float32"])
    assert torch.equal(qkv[:, 4 * 16 :], before[:, 4 * 16 :])  # k and v columns untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_fused_qkv_matches_transformers(dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(2)
    n, h, kvh, d = 9, 4, 2, 32
    qkv = torch.randn(n, (h + 2 * kvh) * d, generator=g).to(dt)
    before = qkv.clone()
    positions = torch.tensor([0, 1, 2, 3, 17, 18, 100, 511, 512])
    cos, sin = RotaryEmbedding(d, 10000.0, None)(positions, dt)
    qk = qkv[:, : (h + kvh) * d].view(n, h + kvh, d)
    ew.rope_(qk, cos, signed_sin(sin), signed_sin=True)
    q_ref, k_ref = apply_rotary_pos_emb(
        before[:, : h * d].view(n, h, d).float(),
        before[:, h * d : (h + kvh) * d].view(n, kvh, d).float(),
        cos.float(),
        sin.float(),
    )
    torch.testing.assert_close(qk[:, :h], q_ref.to(dt), **TOL[dtype])
    torch.testing.assert_close(qk[:, h:], k_ref.to(dt), **TOL[dtype])
    assert torch.equal(qkv[:, (h + kvh) * d :], before[:, (h + kvh) * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_mrope_gathered_in_kernel_matches_the_models_rotary(dtype):
    """M-RoPE: each rotary dim takes its position from one of 3 axes (temporal, height, width);
    the kernel gathers cos/sin from the tables itself."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    n, heads, d = 6, 3, 16
    rot = RotaryEmbedding(d, 10000.0, (2, 3, 3))
    positions = torch.stack([torch.arange(n), torch.tensor([0, 0, 1, 1, 2, 9]), torch.tensor([0, 1, 0, 1, 5, 9])])
    cos, sin = rot(positions, dt)  # per token, as the model builds them
    cos_t, sin_t = rot._table(int(positions.max()), dt, positions.device)
    x = torch.randn(n, heads, d, generator=g).to(dt)
    expected, _ = apply_rotary_pos_emb(x.float(), x.float(), cos.float(), sin.float())
    axis = torch.tensor(rot._axis_list, dtype=torch.int32)
    got = ew.rope_(x.clone(), cos_t, sin_t, positions=positions, axis_of_dim=axis)
    torch.testing.assert_close(got, expected.to(dt), **TOL[dtype])
    torch.testing.assert_close(ew.rope_ref(x, cos_t, sin_t, positions, axis), expected.to(dt), **TOL[dtype])
    # 1-D positions with the same tables: plain RoPE
    got_1d = ew.rope_(x.clone(), cos_t, sin_t, positions=positions[1])
    torch.testing.assert_close(got_1d, ew.rope_ref(x, cos_t, sin_t, positions[1]), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_on_gate_up_halves(dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(4)
    inter = 1100  # more than one column block of 1024
    gate_up = (2 * torch.randn(3, 2 * inter, generator=g)).to(dt)
    gate, up = gate_up.split(inter, dim=-1)
    expected = (F.silu(gate.float()) * up.float()).to(dt)
    torch.testing.assert_close(ew.silu_mul(gate, up), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_scatters_into_blocks_like_index_copy(dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(5)
    kvh, d, slots = 2, 24, 64  # d not a power of two
    cache = torch.randn(2, kvh, slots, d, generator=g).to(dt)
    kv_new = torch.randn(6, 2 * kvh, d, generator=g).to(dt)
    slot_mapping = torch.tensor([7, 8, 15, 16, -1, 63])  # across a block boundary (8); -1: padding
    got = cache.clone()
    ew.store_kv(kv_new, slot_mapping, got)
    expected = cache.clone()
    keep = slot_mapping >= 0
    expected.view(2 * kvh, slots, d).index_copy_(1, slot_mapping[keep], kv_new[keep].transpose(0, 1))
    assert torch.equal(got, expected)
