"""kernels.cpu_fused against the reference ops, bit for bit: transformers' Qwen2 RMSNorm and
rotary embedding, and F.silu; plus the fallback when the kernels cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from omnistage.kernels import cpu_fused
from omnistage.stages.ar.model import signed_sin


@pytest.fixture(scope="module")
def ops():
    mod = cpu_fused.load()
    assert mod is not None, "the fused CPU kernels did not build on this machine"
    return mod


@pytest.mark.parametrize(
    "rows,hidden", [(1, 64), (7, 512), (32, 896), (416, 512), (3, 40), (2, 5), (4, 100), (1, 3584), (3, 20000)]
)
def test_rms_norm_equals_transformers_bit_for_bit(ops, rows, hidden):
    # the sum of squares follows ATen's summation order (a near-tie in a greedy decode tips on
    # a last-bit difference), so the norm is exact, not close
    g = torch.Generator().manual_seed(rows * hidden)
    ref = Qwen2RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(hidden, generator=g))
    wide = torch.randn(rows, hidden + 16, generator=g) * 3
    x = wide[:, 8 : 8 + hidden]  # rows strided, as a column slice of a wider output
    with torch.no_grad():
        want = ref(x)
    got = ops.rms_norm(x, ref.weight.detach(), 1e-6)
    assert torch.equal(got, want)

    y = torch.randn(rows, hidden, generator=g)
    y0 = y.clone()
    got = ops.add_rms_norm_(y, x, ref.weight.detach(), 1e-6)
    assert torch.equal(y, y0 + x)  # the residual sum rounds as an eager add
    with torch.no_grad():
        assert torch.equal(got, ref(y0 + x))


def test_rope_equals_transformers_bit_for_bit(ops):
    g = torch.Generator().manual_seed(0)
    n, heads, kv_heads, d = 19, 8, 2, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g)
    pos = torch.arange(100, 100 + n)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q = qkv[:, : heads * d].view(n, heads, d).transpose(0, 1).unsqueeze(0)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d).transpose(0, 1).unsqueeze(0)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    ops.rope_(qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d), cos, signed_sin(sin))
    assert torch.equal(qkv[:, : heads * d].view(n, heads, d), want_q[0].transpose(0, 1))
    assert torch.equal(qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d), want_k[0].transpose(0, 1))
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # V untouched


def test_qk_norm_then_rope_matches_transformers_qwen3(ops):
    # Qwen3: per-head RMSNorm of q and k (own weights), then RoPE, in place on the qkv output
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, d = 11, 4, 2, 32
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g) * 2
    q_norm, k_norm = Qwen2RMSNorm(d, eps=1e-6), Qwen2RMSNorm(d, eps=1e-6)  # Qwen3's is the same module
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(d, generator=g))
        k_norm.weight.copy_(torch.randn(d, generator=g))
    pos = torch.arange(7, 7 + n)
    inv = 1.0 / (1_000_000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    with torch.no_grad():
        q = q_norm(qkv[:, : heads * d].view(n, heads, d)).transpose(0, 1).unsqueeze(0)
        k = k_norm(qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)).transpose(0, 1).unsqueeze(0)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    ops.qk_norm_rope_(
        qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d),
        heads,
        q_norm.weight.detach(),
        k_norm.weight.detach(),
        1e-6,
        cos,
        signed_sin(sin),
    )
    assert torch.equal(qkv[:, : heads * d].view(n, heads, d), want_q[0].transpose(0, 1))
    assert torch.equal(qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d), want_k[0].transpose(0, 1))
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)


@pytest.mark.parametrize("rows,width", [(1, 1408), (32, 1408), (130, 4864), (5, 37)])
def test_silu_mul_matches_f_silu(ops, rows, width):
    g = torch.Generator().manual_seed(width)
    both = torch.randn(rows, 2 * width, generator=g) * 4
    gate, up = both[:, :width], both[:, width:]  # strided halves, as forward_halves may give
    want = F.silu(gate) * up
    got = ops.silu_mul(gate, up)
    if width % 16 == 0:
        assert torch.equal(got, want)
    else:  # the tail may round differently
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_wrong_input_is_a_clear_error(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.randn(4, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="unit column stride"):
        ops.rms_norm(torch.randn(8, 4).t(), torch.ones(8), 1e-6)


def test_build_failure_falls_back_to_eager_ops(tmp_path):
    # a fresh cache directory and a compiler that fails: load() reports and returns None
    env = dict(os.environ, OMNISTAGE_KERNEL_CACHE=str(tmp_path), CXX="/bin/false", PYTHONSAFEPATH="1")
    code = "import torch; from omnistage.kernels import cpu_fused; print('MODULE', cpu_fused.load())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "MODULE None" in out.stdout, out.stdout + out.stderr
    assert "fused CPU kernels unavailable" in out.stderr


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("OMNISTAGE_CPU_FUSED", "0")
    cpu_fused._reset_for_tests()
    try:
        assert cpu_fused.load() is None
    finally:
        monkeypatch.undo()
        cpu_fused._reset_for_tests()
