"""Attention over the paged KV cache (pure torch, CPU and GPU).

The KV cache of one layer is a tensor [2, num_kv_heads, num_slots, head_dim]
(slot = block_id * block_size + offset). One step's tokens are flattened into one batch:
first the decode tokens (one per sequence), then each prefill chunk. `AttentionMetadata`
is built once per step and shared by every layer.

Decode. Gathering every decoding sequence's context through its block table costs a full
copy of the batch's KV per layer per step; `DecodeBuffer` (decode_buffer.py) keeps a
contiguous copy across steps instead. When it would exceed its memory cap, each step gathers
(`DecodeGroup`).

Prefill chunks attend one SDPA call each (causal; chunks that continue a cached prefix gather
their earlier context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from omnistage.kernels.triton.metadata import PagedKernelMeta, build_paged_meta
from omnistage.stages.ar.decode_buffer import BufferPlan, DecodeBuffer, length_groups, length_mask, padded_block_ids


@dataclass
class DecodeGroup:
    """Gather path: decode rows [token_start, token_start + num_seqs) of the flat batch."""

    token_start: int
    num_seqs: int
    block_ids: torch.Tensor  # [B * nb] each sequence's block table padded to nb blocks (pad: block 0)
    context_len: int  # nb * block_size
    mask: torch.Tensor | None  # [1, B, 1, L] additive; None when no padding


@dataclass
class PrefillChunk:
    token_start: int
    num_tokens: int
    context_len: int  # tokens before this chunk already in the cache
    block_ids: torch.Tensor | None  # [nb] the sequence's blocks covering context + chunk, when context_len > 0
    mask: torch.Tensor | None  # [num_tokens, nb * block_size] additive float when context_len > 0
    needs_output: bool = True  # its last row's final hidden state is needed (the prompt completes)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    buffer_plan: BufferPlan | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_tokens: int = 0
    num_decodes: int = 0
    block_size: int = 16
    # Rows whose final hidden state is needed: every decode row, then the last row of each
    # prefill chunk with needs_output. The last layer computes attention/MLP for these only.
    out_rows: torch.Tensor | None = None
    # Set instead of the decode buffer / groups and prefill masks when the Triton kernels run.
    paged: PagedKernelMeta | None = None


def build_metadata(
    decode_keys: list[int],
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefill_specs: list[tuple[int, int, list[int]]],
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device,
    decode_buffer: DecodeBuffer | None = None,
    prefill_needs_output: list[bool] | None = None,
    dtype: torch.dtype = torch.float32,  # of the queries: SDPA wants float masks in the same dtype
    max_padding_ratio: float = 1.25,
    paged_kernels: bool = False,
    kv_heads: int = 1,
) -> AttentionMetadata:
    """decode_*: per decoding sequence (the first rows of the batch, sorted by context length):
    a unique key, its block table and context length (incl. the new token).
    prefill_specs: per prefill chunk, (context_len, num_tokens, block table).
    prefill_needs_output: per prefill chunk, whether its last row's final hidden state is needed
    (default: all).
    paged_kernels: build meta.paged for the Triton kernels (kernels/triton) instead.
    """
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        num_tokens=int(slot_mapping.numel()),
        num_decodes=len(decode_lens),
        block_size=block_size,
    )
    needs = prefill_needs_output if prefill_needs_output is not None else [True] * len(prefill_specs)
    if paged_kernels:
        meta.paged = build_paged_meta(decode_tables, decode_lens, prefill_specs, needs, block_size, kv_heads, device)
        out_rows = list(range(len(decode_lens))) + [
            len(decode_lens) + sum(n for _, n, _ in prefill_specs[: i + 1]) - 1 for i, need in enumerate(needs) if need
        ]
        meta.out_rows = torch.tensor(out_rows, dtype=torch.long, device=device)
        return meta
    if decode_lens and decode_buffer is not None:
        meta.buffer_plan = decode_buffer.plan(decode_keys, decode_lens, decode_tables, max_padding_ratio)
    elif decode_buffer is not None:
        decode_buffer.reset()
    if decode_lens and meta.buffer_plan is None:
        for a, b in length_groups(decode_lens, max_padding_ratio):
            lens = decode_lens[a:b]
            ids, L = padded_block_ids(decode_tables[a:b], lens, block_size, device)
            meta.decode_groups.append(DecodeGroup(a, b - a, ids, L, length_mask(lens, L, device, dtype)))
    start = len(decode_lens)
    out_rows = list(range(len(decode_lens)))
    for (ctx, n, bt), need in zip(prefill_specs, needs):
        if need:
            out_rows.append(start + n - 1)
        if ctx > 0:
            total = ctx + n
            nb = -(-total // block_size)
            q_pos = torch.arange(ctx, total).unsqueeze(1)
            k_pos = torch.arange(nb * block_size).unsqueeze(0)
            ids = torch.tensor(bt[:nb], dtype=torch.long, device=device)
            mask = torch.zeros(n, nb * block_size, dtype=dtype).masked_fill_(
                k_pos > q_pos, float("-inf")
            )  # additive: faster SDPA
            chunk = PrefillChunk(start, n, ctx, ids, mask.to(device))
        else:
            chunk = PrefillChunk(start, n, 0, None, None)
        chunk.needs_output = need
        meta.prefills.append(chunk)
        start += n
    meta.out_rows = torch.tensor(out_rows, dtype=torch.long, device=device)
    return meta


def paged_attention(
    q: torch.Tensor,  # [N, num_heads, d] (rotary applied)
    k: torch.Tensor,  # [N, kv_heads, d]
    v: torch.Tensor,  # [N, kv_heads, d]
    kv_cache: torch.Tensor,  # [2, kv_heads, num_slots, d]
    meta: AttentionMetadata,
    scale: float,
    layer_index: int,
    out_only: bool = False,
    kv: torch.Tensor | None = None,  # [N, 2 * kv_heads, d] holding k | v, when they are adjacent already
) -> torch.Tensor:
    """Writes this step's K/V into the cache and returns the attention output [N, num_heads * d].

    out_only: q holds only the rows of meta.out_rows (in that order) and so does the output."""
    n_tok, n_heads, d = q.shape
    kvh = k.shape[1]
    num_slots = kv_cache.shape[2]
    # [2, kvh, slots, d] viewed as [2 * kvh, slots, d]: one index op writes K and V together.
    flat = kv_cache.view(2 * kvh, num_slots, d)
    if kv is None:
        kv = torch.cat((k, v), dim=1)
    flat.index_copy_(1, meta.slot_mapping, kv.transpose(0, 1))
    # ... and as [2 * kvh, num_blocks, block_size * d]: one index_select gathers whole blocks of K and V.
    by_block = kv_cache.view(2 * kvh, -1, meta.block_size * d)
    out = torch.empty(n_tok, n_heads, d, dtype=q.dtype, device=q.device)

    if meta.buffer_plan is not None:
        _buffered_decodes(q, kv, by_block, meta, layer_index, scale, out)
    if out_only:
        _last_rows_of_prefills(q, k, v, by_block, meta, scale, out)
    _grouped_decodes(q, by_block, meta, scale, out)
    if not out_only:
        _prefills(q, k, v, by_block, meta, scale, out)
    return out.view(n_tok, n_heads * d)


def _buffered_decodes(q, kv, by_block, meta: AttentionMetadata, layer_index: int, scale: float, out) -> None:
    """Decode rows attend over the contiguous decode buffer (appended to, or rebuilt)."""
    _, n_heads, d = q.shape
    plan = meta.buffer_plan
    nd = meta.num_decodes
    buf = plan.buffers[layer_index]
    kvh = buf.shape[1]
    group = n_heads // kvh
    R = plan.num_rows
    if plan.rebuild_block_ids is not None:
        L = plan.rebuild_len
        buf[:, :, :R, :L] = torch.index_select(by_block, 1, plan.rebuild_block_ids).view(2, kvh, R, L, d)
    else:
        if plan.join_rows is not None:
            J, L = plan.join_rows.numel(), plan.join_len
            buf[:, :, plan.join_rows, :L] = torch.index_select(by_block, 1, plan.join_block_ids).view(2, kvh, J, L, d)
        new_kv = kv[:nd].view(nd, 2, kvh, d).permute(1, 2, 0, 3)  # [2, kvh, B, d]
        buf[:, :, plan.token_rows, plan.token_pos] = new_kv
    q_rows = q.new_zeros(R, n_heads, d)
    q_rows[plan.token_rows] = q[:nd]
    q_rows = q_rows.view(R, kvh, group, d).transpose(0, 1)  # [kvh, R, group, d]
    o_rows = torch.empty(kvh, R, group, d, dtype=q.dtype, device=q.device)
    for a, b, L, mask in plan.groups:
        o_rows[:, a:b] = F.scaled_dot_product_attention(
            q_rows[:, a:b], buf[0, :, a:b, :L], buf[1, :, a:b, :L], attn_mask=mask, scale=scale
        )
    out[:nd] = o_rows.transpose(0, 1).reshape(R, n_heads, d)[plan.token_rows]


def _last_rows_of_prefills(q, k, v, by_block, meta: AttentionMetadata, scale: float, out) -> None:
    """out_only: each prefill that needs logits contributes one query row (its last token)."""
    kvh, d = k.shape[1], k.shape[2]
    j = meta.num_decodes
    for p in meta.prefills:
        if not p.needs_output:
            continue
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        q_last = q[j : j + 1].transpose(0, 1).unsqueeze(0)  # [1, H, 1, d]: sees the whole chunk
        if p.context_len == 0:
            kp, vp = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
        else:
            total = p.context_len + p.num_tokens
            kv = torch.index_select(by_block, 1, p.block_ids).view(2, 1, kvh, -1, d)[:, :, :, :total]
            kp, vp = kv[0], kv[1]
        o = F.scaled_dot_product_attention(q_last, kp, vp, scale=scale, enable_gqa=True)
        out[j] = o[0, :, 0]
        j += 1


def _grouped_decodes(q, by_block, meta: AttentionMetadata, scale: float, out) -> None:
    """Decode rows without the buffer: groups of similar length gather their blocks."""
    _, n_heads, d = q.shape
    kvh = by_block.shape[0] // 2
    group = n_heads // kvh
    for g in meta.decode_groups:
        b = g.num_seqs
        rows = slice(g.token_start, g.token_start + b)
        kv = torch.index_select(by_block, 1, g.block_ids).view(2, kvh, b, g.context_len, d)
        # [B, H, d] -> [kvh, B, group, d]: the query heads of one KV head play the query-length axis.
        qg = q[rows].view(b, kvh, group, d).transpose(0, 1)
        o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=g.mask, scale=scale)
        out[rows] = o.transpose(0, 1).reshape(b, n_heads, d)


def _prefills(q, k, v, by_block, meta: AttentionMetadata, scale: float, out) -> None:
    """Prefill chunks: causal over themselves, or masked over their cached context too."""
    kvh, d = k.shape[1], k.shape[2]
    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
        if p.context_len == 0:
            o = F.scaled_dot_product_attention(
                qp,
                k[rows].transpose(0, 1).unsqueeze(0),
                v[rows].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
        else:
            kv = torch.index_select(by_block, 1, p.block_ids).view(2, 1, kvh, -1, d)
            o = F.scaled_dot_product_attention(qp, kv[0], kv[1], attn_mask=p.mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
