"""Paged decode attention: one query token per sequence over its K/V in the paged cache.

Cache layout (stages/ar/kv_cache.py): per layer [2, kv_heads, num_slots, head_dim], slot =
block_id * block_size + offset. A program handles one (sequence, KV head, split): the query
heads that share the KV head are rows of one tile (GQA without repeating K/V), keys are read
through the block table TILE_N at a time with an online softmax. With num_splits > 1 the
context is cut into that many ranges whose partial results (max, sum, unnormalized output)
are merged by a second kernel: long contexts with few sequences keep every SM busy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG = tl.constexpr(-1.0e30)  # finite "-inf": a fully masked tile must not turn exp() into NaN


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: exact products (tensor cores would round them to tf32's 10-bit mantissa)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decode_kernel(
    Q, KV, BT, LENS, Out, PART_O, PART_ML,
    scale,
    stride_qn, stride_qh,
    stride_kv_which, stride_kv_head, stride_kv_slot,
    stride_bt,
    stride_on, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(LENS + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    start = s * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    dd = tl.arange(0, D_PAD)
    heads = kh * GROUP + g
    qmask = (g[:, None] < GROUP) & (dd[None, :] < D)
    q = tl.load(Q + b * stride_qn + heads[:, None] * stride_qh + dd[None, :], mask=qmask, other=0.0)

    m_i = tl.full([GROUP_PAD], _NEG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    k_base = KV + kh * stride_kv_head
    v_base = KV + stride_kv_which + kh * stride_kv_head
    for t0 in range(start, end, TILE_N):
        pos = t0 + tl.arange(0, TILE_N)
        kmask = pos < end
        block = tl.load(BT + b * stride_bt + pos // BLOCK_SIZE, mask=kmask, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        lmask = kmask[:, None] & (dd[None, :] < D)
        k = tl.load(k_base + slot[:, None] * stride_kv_slot + dd[None, :], mask=lmask, other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_kv_slot + dd[None, :], mask=lmask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        qk = tl.where(kmask[None, :], qk, _NEG)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        p = tl.where(kmask[None, :], p, 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    omask = (g[:, None] < GROUP) & (dd[None, :] < D)
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            Out + b * stride_on + heads[:, None] * stride_oh + dd[None, :], out.to(Out.dtype.element_ty), mask=omask
        )
    else:
        # PART_O [B, H, S, D_PAD] float32, PART_ML [B, H, S, 2] float32 (contiguous)
        row = (b * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + s
        tl.store(PART_O + row[:, None] * D_PAD + dd[None, :], acc, mask=omask)
        tl.store(PART_ML + row * 2, m_i, mask=g < GROUP)
        tl.store(PART_ML + row * 2 + 1, l_i, mask=g < GROUP)


@triton.jit
def _merge_splits_kernel(
    PART_O, PART_ML, Out, stride_on, stride_oh,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    dd = tl.arange(0, D_PAD)
    row = (b * NUM_HEADS + h) * NUM_SPLITS + s
    m = tl.load(PART_ML + row * 2)
    lsum = tl.load(PART_ML + row * 2 + 1)
    acc = tl.load(PART_O + row[:, None] * D_PAD + dd[None, :])
    w = tl.exp(m - tl.max(m, 0))
    w = tl.where(lsum > 0, w, 0.0)  # an empty split (context shorter than the split count)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(Out + b * stride_on + h * stride_oh + dd, out.to(Out.dtype.element_ty), mask=dd < D)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, d]
    kv_cache: torch.Tensor,  # [2, kvh, slots, d]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1 (incl. the new token, already stored)
    scale: float,
    block_size: int,
    num_splits: int = 1,
    out: torch.Tensor | None = None,  # [B, H, d]
    tile_n: int = 32,
) -> torch.Tensor:
    B, H, d = q.shape
    kvh = kv_cache.shape[1]
    group = H // kvh
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    assert q.stride(2) == 1 and kv_cache.stride(3) == 1 and out.stride(2) == 1
    num_splits = triton.next_power_of_2(max(1, num_splits))
    d_pad = _pow2(d)
    part_o = part_ml = out  # unused when not split
    if num_splits > 1:
        part_o = torch.empty(B, H, num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B, H, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(B, kvh, num_splits)](
        q, kv_cache, block_tables, seq_lens, out, part_o, part_ml,
        scale,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=_pow2(group), D=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(B, H)](
            part_o, part_ml, out, out.stride(0), out.stride(1), NUM_HEADS=H, D=d, D_PAD=d_pad, NUM_SPLITS=num_splits
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """The same result in torch (float32 math): each sequence's K/V gathered slot by slot."""
    B, H, d = q.shape
    kvh = kv_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(seq_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b].long()[pos // block_size] * block_size + pos % block_size
        k = kv_cache[0][:, slots].float().repeat_interleave(H // kvh, dim=0)  # [H, n, d]
        v = kv_cache[1][:, slots].float().repeat_interleave(H // kvh, dim=0)
        att = torch.softmax(torch.einsum("hd,hnd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", att, v).to(q.dtype)
    return out
