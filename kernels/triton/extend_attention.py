"""Prefill / extend attention over paged K/V: a chunk of new tokens attends causally over
itself and over its sequence's cached prefix.

The chunk's own K/V are stored in the cache first (elementwise.store_kv), so every key is read
through the block table the same way. A program handles one (chunk, query head, tile of
BLOCK_M query rows); query row i of a chunk sits at position ctx_len + i and sees keys at
positions <= its own. Chunks are described by flat-row start, length, cached-prefix length and
a block-table row, so one launch covers a whole batch of chunks of mixed lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnistage.kernels.triton.decode_attention import dot_precision

_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _extend_kernel(
    Q, KV, BT, Q_START, Q_LEN, CTX, Out,
    scale,
    stride_qn, stride_qh,
    stride_kv_which, stride_kv_head, stride_kv_slot,
    stride_bt,
    stride_on, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_len = tl.load(Q_LEN + c)
    if mt * BLOCK_M < q_len:
        q_start = tl.load(Q_START + c)
        ctx = tl.load(CTX + c)
        rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        dd = tl.arange(0, D_PAD)
        qmask = rmask[:, None] & (dd[None, :] < D)
        q_off = (q_start + rows).to(tl.int64)[:, None] * stride_qn + h * stride_qh + dd[None, :]
        q = tl.load(Q + q_off, mask=qmask, other=0.0)
        q_pos = ctx + rows
        kh = h // GROUP
        k_base = KV + kh * stride_kv_head
        v_base = KV + stride_kv_which + kh * stride_kv_head
        end = ctx + tl.minimum((mt + 1) * BLOCK_M, q_len)  # keys the tile's last row can see

        m_i = tl.full([BLOCK_M], _NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for t0 in range(0, end, TILE_N):
            pos = t0 + tl.arange(0, TILE_N)
            kmask = pos < end
            block = tl.load(BT + c * stride_bt + pos // BLOCK_SIZE, mask=kmask, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            lmask = kmask[:, None] & (dd[None, :] < D)
            k = tl.load(k_base + slot[:, None] * stride_kv_slot + dd[None, :], mask=lmask, other=0.0)
            v = tl.load(v_base + slot[:, None] * stride_kv_slot + dd[None, :], mask=lmask, other=0.0)
            visible = kmask[None, :] & (pos[None, :] <= q_pos[:, None])
            qk = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale, _NEG)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(visible, tl.exp(qk - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        o_off = (q_start + rows).to(tl.int64)[:, None] * stride_on + h * stride_oh + dd[None, :]
        tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=qmask)


def paged_extend_attention(
    q: torch.Tensor,  # [N, H, d]: the chunks' query rows, flat
    kv_cache: torch.Tensor,  # [2, kvh, slots, d], holding the chunks' own K/V already
    block_tables: torch.Tensor,  # [C, max_blocks] int32
    q_starts: torch.Tensor,  # [C] int32: first row of each chunk in q / out
    q_lens: torch.Tensor,  # [C] int32
    ctx_lens: torch.Tensor,  # [C] int32: cached tokens before each chunk
    max_q_len: int,
    scale: float,
    block_size: int,
    out: torch.Tensor | None = None,
    block_m: int = 16,
    tile_n: int = 32,
) -> torch.Tensor:
    N, H, d = q.shape
    kvh = kv_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    C = block_tables.shape[0]
    if C == 0 or max_q_len == 0:
        return out
    assert q.stride(2) == 1 and kv_cache.stride(3) == 1 and out.stride(2) == 1
    _extend_kernel[(C, H, triton.cdiv(max_q_len, block_m))](
        q, kv_cache, block_tables, q_starts, q_lens, ctx_lens, out,
        scale,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=H // kvh, D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_N=tile_n,
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out


def paged_extend_attention_ref(q, kv_cache, block_tables, q_starts, q_lens, ctx_lens, scale, block_size):
    """The same result with torch's SDPA per chunk (causal mask offset by the cached prefix)."""
    H = q.shape[1]
    kvh = kv_cache.shape[1]
    out = torch.zeros_like(q)
    for c in range(block_tables.shape[0]):
        s, n, ctx = int(q_starts[c]), int(q_lens[c]), int(ctx_lens[c])
        pos = torch.arange(ctx + n, device=q.device)
        slots = block_tables[c].long()[pos // block_size] * block_size + pos % block_size
        k = kv_cache[0][:, slots].float().unsqueeze(0)  # [1, kvh, T, d]
        v = kv_cache[1][:, slots].float().unsqueeze(0)
        qc = q[s : s + n].float().transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        visible = pos.unsqueeze(0) <= (ctx + torch.arange(n, device=q.device)).unsqueeze(1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qc, k, v, attn_mask=visible, scale=scale, enable_gqa=H != kvh
        )
        out[s : s + n] = o[0].transpose(0, 1).to(q.dtype)
    return out
