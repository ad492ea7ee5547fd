"""Attention over the paged KV cache (pure torch, CPU and GPU).

The KV cache of one layer is a tensor [2, num_kv_heads, num_slots, head_dim]
(slot = block_id * block_size + offset). One step's tokens are flattened into one batch:
first the decode tokens (one per sequence), then each prefill chunk. `AttentionMetadata`
is built once per step and shared by every layer.

Decode. Gathering every decoding sequence's context through its block table costs a full
copy of the batch's KV per layer per step. `DecodeBuffer` avoids it: it keeps a contiguous,
padded copy [2, kv_heads, rows, L, d] of the decoding sequences' K/V (the paged cache stays
the source of truth). A step appends each sequence's new K/V to its row; a sequence that
leaves leaves a dead row, and one that joins takes a dead or unused row, filled from its
blocks. The buffer is rebuilt with one block gather, its rows sorted by context length, when
too many rows are dead, there is no row free, a row outgrows it, or joins have left the rows
so far out of length order that they need more length groups (one SDPA call each, so
padding stays small) than sorted rows would, by more than JOIN_EXTRA_GROUPS. The query heads
of one KV head play the query-length axis (GQA without repeating K/V). When the buffer would exceed its memory cap,
each step gathers instead (`DecodeGroup`).

Prefill chunks attend one SDPA call each (causal; chunks that continue a cached prefix gather
their earlier context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from omnistage.kernels.triton.metadata import PagedKernelMeta, build_paged_meta

JOIN_EXTRA_GROUPS = 0  # SDPA calls per layer that rows joined out of length order may add before a rebuild


def _additive_mask(lens: list[int], length: int, device, dtype=torch.float32) -> torch.Tensor:
    """[1, B, 1, length] float mask: 0 where position < len, -inf after (SDPA is faster with it)."""
    keep = torch.arange(length).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    mask = torch.zeros(len(lens), length, dtype=dtype).masked_fill_(~keep, float("-inf"))
    return mask.view(1, len(lens), 1, length).to(device)


def _length_groups(lens: list[int], max_padding_ratio: float, min_group: int = 4) -> list[tuple[int, int]]:
    """Cut rows (roughly sorted by length) into ranges whose padded size stays under the ratio."""
    groups: list[tuple[int, int]] = []
    start, total, longest = 0, 0, 0
    for i, n in enumerate(lens):
        size = i - start
        new_longest = max(longest, n)
        if size >= min_group and new_longest * (size + 1) > max_padding_ratio * (total + n):
            groups.append((start, i))
            start, total, new_longest = i, 0, n
        total += n
        longest = new_longest
    if lens:
        groups.append((start, len(lens)))
    return groups


def _attended_lens(row_len: list[int]) -> list[int]:
    """Each buffer row's attended length; a dead row (0) takes the previous live row's (leading
    dead rows the first live row's), so it does not split a length group: it attends stale but
    finite K/V and its output is never read."""
    out, prev = [], 0
    for n in row_len:
        prev = n if n > 0 else prev
        out.append(prev)
    first = next((n for n in out if n > 0), 1)
    return [n if n > 0 else first for n in out]


@dataclass
class DecodeGroup:
    """Gather path: decode rows [token_start, token_start + num_seqs) of the flat batch."""

    token_start: int
    num_seqs: int
    block_ids: torch.Tensor  # [B * nb] each sequence's block table padded to nb blocks (pad: block 0)
    context_len: int  # nb * block_size
    mask: torch.Tensor | None  # [1, B, 1, L] additive; None when no padding


@dataclass
class BufferPlan:
    """Buffer path for this step's decodes (see DecodeBuffer)."""

    buffers: list[torch.Tensor]  # per layer [2, kvh, rows_cap >= R, len_cap, d]
    token_rows: torch.Tensor  # [B] buffer row of each decode token (decode tokens are batch rows 0..B-1)
    token_pos: torch.Tensor  # [B] position of each new token in its row
    num_rows: int
    groups: list[tuple[int, int, int, torch.Tensor]]  # (row_start, row_end, L, additive mask [1, rows, 1, L])
    rebuild_block_ids: torch.Tensor | None = None  # [R * nb] when the buffer is (re)filled this step
    rebuild_len: int = 0  # nb * block_size
    join_rows: torch.Tensor | None = None  # [J] rows taken this step by sequences new to the buffer
    join_block_ids: torch.Tensor | None = None  # [J * nb] their blocks
    join_len: int = 0  # nb * block_size


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


class DecodeBuffer:
    """Contiguous per-row K/V copy of the decoding sequences, kept across steps."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype,
        device,
        max_bytes: int,
        max_len: int,
        headroom: int = 128,
        max_dead_fraction: float = 0.25,
    ):
        self.num_layers, self.kvh, self.d, self.block_size = num_layers, num_kv_heads, head_dim, block_size
        self.dtype, self.device = dtype, device
        self.elt = torch.empty((), dtype=dtype).element_size()
        self.max_bytes, self.max_len, self.headroom = max_bytes, max_len, headroom
        self.max_dead_fraction = max_dead_fraction
        self.buffers: list[torch.Tensor] = []
        self.row_of: dict[int, int] = {}
        self.row_len: list[int] = []
        self.capacity_len = 0
        self.num_rebuilds = 0
        self.num_joins = 0

    def reset(self) -> None:
        self.row_of, self.row_len = {}, []

    def reserve(self, rows: int, length: int) -> bool:
        """Allocate (and page in) the buffer for `rows` sequences of up to `length` tokens now,
        at engine start, so the first batches do not pay for growing it step by step. False
        when that would exceed the memory cap: the buffer then grows on demand."""
        bs = self.block_size
        length = -(-min(length, self.max_len) // bs) * bs
        if rows < 1 or length < 1:
            return False
        if self.num_layers * 2 * self.kvh * rows * length * self.d * self.elt > self.max_bytes:
            return False
        shape = (2, self.kvh, rows, length, self.d)
        self.buffers = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.reset()
        return True

    def plan(
        self, keys: list[int], lens: list[int], tables: list[list[int]], max_padding_ratio: float
    ) -> BufferPlan | None:
        """keys: a never-reused id per decoding sequence; lens: context length incl. the new token.
        Returns None when the buffer would not fit its memory cap (the caller gathers instead)."""
        joins = self._place_joiners(keys, lens, max_padding_ratio)
        if joins is None:
            rows, rebuild_ids, rebuild_len = self._rebuild(keys, lens, tables)
            if rows is None:
                return None
            join_rows = join_ids = None
            join_len = 0
        else:
            rows = [self.row_of[k] for k in keys]
            for r, n in zip(rows, lens):
                self.row_len[r] = n
            rebuild_ids, rebuild_len = None, 0
            join_rows, join_ids, join_len = self._join_gather(joins, lens, tables)
        mask_lens = _attended_lens(self.row_len)
        groups = []
        for a, b in _length_groups(mask_lens, max_padding_ratio):
            L = max(mask_lens[a:b])
            lens_ab = mask_lens[a:b]
            mask = None if min(lens_ab) == L else _additive_mask(lens_ab, L, self.device, self.dtype)
            groups.append((a, b, L, mask))
        return BufferPlan(
            buffers=self.buffers,
            token_rows=torch.tensor(rows, dtype=torch.long, device=self.device),
            token_pos=torch.tensor([n - 1 for n in lens], dtype=torch.long, device=self.device),
            num_rows=len(self.row_len),
            groups=groups,
            rebuild_block_ids=rebuild_ids,
            rebuild_len=rebuild_len,
            join_rows=join_rows,
            join_block_ids=join_ids,
            join_len=join_len,
        )

    def _place_joiners(
        self, keys: list[int], lens: list[int], max_padding_ratio: float
    ) -> list[tuple[int, int]] | None:
        """Keeps the buffer when every sequence already in it grew by exactly its new token:
        rows of sequences gone become dead, and sequences new to the buffer take dead or unused
        rows. Returns (batch index, row) per joining sequence, or None: rebuild instead (too many
        dead rows, no room, a row outgrowing the buffer's length, or none kept yet)."""
        if not self.row_len:
            return None
        joining = []
        for i, (k, n) in enumerate(zip(keys, lens)):
            if n > self.capacity_len:
                return None
            r = self.row_of.get(k)
            if r is None:
                joining.append(i)
            elif self.row_len[r] != n - 1:
                return None
        live = set(keys)
        free = [self.row_of.pop(k) for k in [k for k in self.row_of if k not in live]]
        for r in free:
            self.row_len[r] = 0  # finished / paused: a dead row until reused or rebuilt
        free = sorted(r for r, n in enumerate(self.row_len) if n == 0)
        spare = self.buffers[0].shape[2] - len(self.row_len)
        if len(joining) > len(free) + spare:
            return None
        joins = []
        for i in joining:
            if free:
                r = free.pop(0)
            else:
                r = len(self.row_len)
                self.row_len.append(0)
            self.row_of[keys[i]] = r
            joins.append((i, r))
        dead = len(self.row_len) - len(keys)
        if dead > self.max_dead_fraction * len(self.row_len):
            return None
        if joins and self._scattered(keys, lens, max_padding_ratio):
            return None  # joined out of length order: rebuild (sorts the rows again)
        self.num_joins += len(joins)
        return joins

    def _scattered(self, keys: list[int], lens: list[int], max_padding_ratio: float) -> bool:
        """Whether the rows, once every one has its new length, would need more length groups
        (SDPA calls) than the same lengths sorted, by more than JOIN_EXTRA_GROUPS."""
        row_len = list(self.row_len)
        for k, n in zip(keys, lens):
            row_len[self.row_of[k]] = n
        mask_lens = _attended_lens(row_len)
        here = len(_length_groups(mask_lens, max_padding_ratio))
        return here > len(_length_groups(sorted(mask_lens), max_padding_ratio)) + JOIN_EXTRA_GROUPS

    def _join_gather(
        self, joins: list[tuple[int, int]], lens: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """Block ids that copy each joining sequence's context into its row."""
        if not joins:
            return None, None, 0
        bs = self.block_size
        nb = -(-max(lens[i] for i, _ in joins) // bs)
        ids = [(tables[i][: -(-lens[i] // bs)] + [0] * nb)[:nb] for i, _ in joins]
        rows = torch.tensor([r for _, r in joins], dtype=torch.long, device=self.device)
        return rows, torch.tensor(ids, dtype=torch.long).flatten().to(self.device), nb * bs

    def _rebuild(
        self, keys: list[int], lens: list[int], tables: list[list[int]]
    ) -> tuple[list[int] | None, torch.Tensor | None, int]:
        """Rows for every decoding sequence, sorted by length, filled by one block gather: (each
        sequence's row, the block ids, the gathered length); (None, None, 0) over the memory cap."""
        bs = self.block_size
        cap = min(-(-(max(lens) + self.headroom) // bs) * bs, -(-self.max_len // bs) * bs)
        have_rows, have_len = (self.buffers[0].shape[2], self.buffers[0].shape[3]) if self.buffers else (0, 0)
        # Grow-only allocation: a fresh one is page-faulted in at first touch, which costs more than the gather.
        rows_cap, len_cap = max(have_rows, len(keys)), max(have_len, cap)
        need = self.num_layers * 2 * self.kvh * rows_cap * len_cap * self.d * self.elt
        if need > self.max_bytes:
            rows_cap, len_cap = len(keys), cap
            need = self.num_layers * 2 * self.kvh * rows_cap * len_cap * self.d * self.elt
            if need > self.max_bytes:
                self.buffers = []
                self.reset()
                return None, None, 0
        order = sorted(range(len(keys)), key=lambda i: lens[i])
        self.row_of = {keys[i]: r for r, i in enumerate(order)}
        self.row_len = [lens[i] for i in order]
        if (rows_cap, len_cap) != (have_rows, have_len):
            shape = (2, self.kvh, rows_cap, len_cap, self.d)
            # Zeros, not empty: masked positions still enter SDPA's P @ V (0 * NaN = NaN), so
            # every slot must always hold a finite value.
            self.buffers = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.capacity_len = len_cap
        nb = -(-max(lens) // bs)
        table = [(tables[i][: -(-lens[i] // bs)] + [0] * nb)[:nb] for i in order]
        self.num_rebuilds += 1
        rows = [self.row_of[k] for k in keys]
        return rows, torch.tensor(table, dtype=torch.long).flatten().to(self.device), nb * bs


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
        for a, b in _length_groups(decode_lens, max_padding_ratio):
            lens = decode_lens[a:b]
            nb = -(-max(lens) // block_size)
            L = nb * block_size
            table = torch.zeros(b - a, nb, dtype=torch.long)
            for r, bt in enumerate(decode_tables[a:b]):
                used = bt[: -(-lens[r] // block_size)]
                table[r, : len(used)] = torch.tensor(used, dtype=torch.long)
            mask = None if all(n == L for n in lens) else _additive_mask(lens, L, device, dtype)
            meta.decode_groups.append(DecodeGroup(a, b - a, table.flatten().to(device), L, mask))
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
