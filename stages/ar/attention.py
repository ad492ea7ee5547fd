"""Attention over the paged KV cache (pure torch, CPU and GPU).

The KV cache of one layer is a tensor [2, num_kv_heads, num_slots, head_dim]
(slot = block_id * block_size + offset). One step's tokens are flattened into one batch:
first the decode tokens (one per sequence), then each prefill chunk. `AttentionMetadata`
is built once per step and shared by every layer.

Decode: every decoding sequence's context is gathered through its block table into a padded
[kv_heads, B, L, d] view and attended with one SDPA call, the query heads of a KV group laid
out as the query-length axis (GQA without repeating K/V). Sequences are bucketed by context
length so the padding stays small. Prefill chunks attend one SDPA call each (causal; chunks
that continue a cached prefix gather their earlier context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    token_start: int  # rows [token_start, token_start + B) of the flat batch
    num_seqs: int
    gather_slots: torch.Tensor  # [B, L] int64 slot ids (padding points at slot 0)
    mask: torch.Tensor | None  # [1, B, 1, L] bool (True = attend); None when no padding


@dataclass
class PrefillChunk:
    token_start: int
    num_tokens: int
    context_len: int  # tokens before this chunk already in the cache
    gather_slots: torch.Tensor | None  # [context_len + num_tokens] when context_len > 0
    mask: torch.Tensor | None  # [num_tokens, context_len + num_tokens] bool when context_len > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_tokens: int = 0


def _slots(block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size] slot ids."""
    offsets = torch.arange(block_size, dtype=torch.long)
    return (block_table.unsqueeze(-1) * block_size + offsets).flatten(-2)


def build_metadata(
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefill_specs: list[tuple[int, int, list[int]]],
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device,
    max_padding_ratio: float = 1.25,
) -> AttentionMetadata:
    """decode_tables/decode_lens: block table and context length (incl. the new token) of each
    decoding sequence; they occupy the first rows of the batch, sorted by context length.
    prefill_specs: per prefill chunk, (context_len, num_tokens, block table).
    """
    meta = AttentionMetadata(slot_mapping=slot_mapping.to(device), num_tokens=int(slot_mapping.numel()))
    # Cut the (sorted) decodes into groups whose padding stays under max_padding_ratio.
    groups: list[tuple[int, int]] = []  # (start, end)
    start, total = 0, 0
    for i, length in enumerate(decode_lens):
        size = i - start
        if size >= 4 and length * (size + 1) > max_padding_ratio * (total + length):
            groups.append((start, i))
            start, total = i, 0
        total += length
    if decode_lens:
        groups.append((start, len(decode_lens)))
    for a, b in groups:
        lens = decode_lens[a:b]
        L = max(lens)
        nb = -(-L // block_size)
        table = torch.zeros(b - a, nb, dtype=torch.long)
        for r, bt in enumerate(decode_tables[a:b]):
            table[r, : len(bt[:nb])] = torch.tensor(bt[:nb], dtype=torch.long)
        slots = _slots(table, block_size)[:, :L]
        mask = None
        if min(lens) != L:
            mask = (torch.arange(L).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).view(1, b - a, 1, L).to(device)
        meta.decode_groups.append(DecodeGroup(token_start=a, num_seqs=b - a, gather_slots=slots.to(device), mask=mask))
    start = len(decode_lens)
    for ctx, n, bt in prefill_specs:
        if ctx > 0:
            total = ctx + n
            slots = _slots(torch.tensor(bt, dtype=torch.long), block_size)[:total]
            q_pos = torch.arange(ctx, total).unsqueeze(1)
            k_pos = torch.arange(total).unsqueeze(0)
            chunk = PrefillChunk(start, n, ctx, slots.to(device), (k_pos <= q_pos).to(device))
        else:
            chunk = PrefillChunk(start, n, 0, None, None)
        meta.prefills.append(chunk)
        start += n
    return meta


def paged_attention(
    q: torch.Tensor,  # [N, num_heads, d] (rotary applied)
    k: torch.Tensor,  # [N, kv_heads, d]
    v: torch.Tensor,  # [N, kv_heads, d]
    kv_cache: torch.Tensor,  # [2, kv_heads, num_slots, d]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes this step's K/V into the cache and returns the attention output [N, num_heads * d]."""
    n_tok, n_heads, d = q.shape
    kvh = k.shape[1]
    group = n_heads // kvh
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kt = k.transpose(0, 1)
    vt = v.transpose(0, 1)
    k_cache[:, meta.slot_mapping] = kt
    v_cache[:, meta.slot_mapping] = vt
    out = torch.empty(n_tok, n_heads, d, dtype=q.dtype, device=q.device)

    for g in meta.decode_groups:
        b = g.num_seqs
        rows = slice(g.token_start, g.token_start + b)
        # [B, H, d] -> [kvh, B, group, d]: the query heads of one KV head play the query-length axis.
        qg = q[rows].view(b, kvh, group, d).transpose(0, 1)
        kg = k_cache[:, g.gather_slots]  # [kvh, B, L, d]
        vg = v_cache[:, g.gather_slots]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale)
        out[rows] = o.transpose(0, 1).reshape(b, n_heads, d)

    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
        if p.context_len == 0:
            o = F.scaled_dot_product_attention(
                qp, kt[:, rows].unsqueeze(0), vt[:, rows].unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kp = k_cache[:, p.gather_slots].unsqueeze(0)
            vp = v_cache[:, p.gather_slots].unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out.view(n_tok, n_heads * d)
