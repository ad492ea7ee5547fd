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
    block_ids: torch.Tensor  # [B * nb] int64: each sequence's block table padded to nb blocks (pad: block 0)
    context_len: int  # L = nb * block_size (padded)
    mask: torch.Tensor | None  # [1, B, 1, L] bool (True = attend); None when no padding


@dataclass
class PrefillChunk:
    token_start: int
    num_tokens: int
    context_len: int  # tokens before this chunk already in the cache
    block_ids: torch.Tensor | None  # [nb] the sequence's blocks covering context + chunk, when context_len > 0
    mask: torch.Tensor | None  # [num_tokens, nb * block_size] bool when context_len > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_tokens: int = 0
    block_size: int = 16


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
    meta = AttentionMetadata(slot_mapping=slot_mapping.to(device), num_tokens=int(slot_mapping.numel()), block_size=block_size)
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
        nb = -(-max(lens) // block_size)
        L = nb * block_size
        table = torch.zeros(b - a, nb, dtype=torch.long)
        for r, bt in enumerate(decode_tables[a:b]):
            used = bt[: -(-lens[r] // block_size)]
            table[r, : len(used)] = torch.tensor(used, dtype=torch.long)
        mask = None
        if any(n != L for n in lens):
            mask = (torch.arange(L).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).view(1, b - a, 1, L).to(device)
        meta.decode_groups.append(DecodeGroup(a, b - a, table.flatten().to(device), L, mask))
    start = len(decode_lens)
    for ctx, n, bt in prefill_specs:
        if ctx > 0:
            total = ctx + n
            nb = -(-total // block_size)
            q_pos = torch.arange(ctx, total).unsqueeze(1)
            k_pos = torch.arange(nb * block_size).unsqueeze(0)
            ids = torch.tensor(bt[:nb], dtype=torch.long, device=device)
            chunk = PrefillChunk(start, n, ctx, ids, (k_pos <= q_pos).to(device))
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
    num_slots = kv_cache.shape[2]
    # [2, kvh, slots, d] viewed as [2 * kvh, slots, d]: one index op writes K and V together.
    flat = kv_cache.view(2 * kvh, num_slots, d)
    flat.index_copy_(1, meta.slot_mapping, torch.cat((k, v), dim=1).transpose(0, 1))
    # ... and as [2 * kvh, num_blocks, block_size * d]: one index_select gathers whole blocks of K and V.
    by_block = kv_cache.view(2 * kvh, -1, meta.block_size * d)
    out = torch.empty(n_tok, n_heads, d, dtype=q.dtype, device=q.device)

    for g in meta.decode_groups:
        b = g.num_seqs
        rows = slice(g.token_start, g.token_start + b)
        kv = torch.index_select(by_block, 1, g.block_ids).view(2, kvh, b, g.context_len, d)
        # [B, H, d] -> [kvh, B, group, d]: the query heads of one KV head play the query-length axis.
        qg = q[rows].view(b, kvh, group, d).transpose(0, 1)
        o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=g.mask, scale=scale)
        out[rows] = o.transpose(0, 1).reshape(b, n_heads, d)

    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
        if p.context_len == 0:
            o = F.scaled_dot_product_attention(
                qp, k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=scale, enable_gqa=True,
            )
        else:
            kv = torch.index_select(by_block, 1, p.block_ids).view(2, 1, kvh, -1, d)
            o = F.scaled_dot_product_attention(qp, kv[0], kv[1], attn_mask=p.mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out.view(n_tok, n_heads * d)
