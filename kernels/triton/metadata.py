"""Per-step tensors the Triton attention kernels read (built on the host, once per step,
shared by every layer). Imports torch only, so the engine can build it without triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkTables:
    """Query chunks over paged K/V for the extend kernel."""

    block_tables: torch.Tensor  # [C, max_blocks] int32
    q_starts: torch.Tensor  # [C] int32: first row of the chunk in the step's query rows
    q_lens: torch.Tensor  # [C] int32
    ctx_lens: torch.Tensor  # [C] int32: tokens before the chunk's first query row
    max_q_len: int


@dataclass
class PagedKernelMeta:
    decode_tables: torch.Tensor  # [B, max_blocks] int32
    decode_lens: torch.Tensor  # [B] int32, incl. the new token
    num_splits: int  # split-K factor of decode attention
    prefills: ChunkTables  # every prefill row
    prefill_last_rows: ChunkTables  # out_only: the last row of each chunk that needs output


def _table(rows: list[list[int]], lens: list[int], block_size: int) -> torch.Tensor:
    nb = max([-(-n // block_size) for n in lens], default=0)
    table = torch.zeros(len(rows), max(nb, 1), dtype=torch.int32)
    for r, (bt, n) in enumerate(zip(rows, lens)):
        used = bt[: -(-n // block_size)]
        table[r, : len(used)] = torch.tensor(used, dtype=torch.int32)
    return table


def _chunks(tables, starts, q_lens, ctx_lens, block_size, device) -> ChunkTables:
    totals = [c + n for c, n in zip(ctx_lens, q_lens)]

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int32).to(device)

    return ChunkTables(
        _table(tables, totals, block_size).to(device),
        as_tensor(starts),
        as_tensor(q_lens),
        as_tensor(ctx_lens),
        max(q_lens, default=0),
    )


def empty_chunks(device: torch.device) -> ChunkTables:
    """No query chunks: a decode-only step."""
    none = torch.zeros(0, dtype=torch.int32, device=device)
    return ChunkTables(torch.zeros(0, 1, dtype=torch.int32, device=device), none, none, none, 0)


def split_count(num_seqs: int, kv_heads: int, max_len: int) -> int:
    """Split the context when too few (sequence, KV head) programs would fill the GPU."""
    if max_len <= 1024 or num_seqs * kv_heads >= 256:
        return 1
    return min(16, 1 << (-(-max_len // 1024) - 1).bit_length())


def build_paged_meta(
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefill_specs: list[tuple[int, int, list[int]]],  # (context_len, num_tokens, block table)
    needs_output: list[bool],
    block_size: int,
    kv_heads: int,
    device: torch.device,
) -> PagedKernelMeta:
    nd = len(decode_lens)
    starts, start = [], nd
    for _, n, _ in prefill_specs:
        starts.append(start)
        start += n
    tables = [bt for _, _, bt in prefill_specs]
    full = _chunks(
        tables, starts, [n for _, n, _ in prefill_specs], [c for c, _, _ in prefill_specs], block_size, device
    )
    last = [i for i, need in enumerate(needs_output) if need]
    last_rows = _chunks(
        [tables[i] for i in last],
        [nd + j for j in range(len(last))],
        [1] * len(last),
        [prefill_specs[i][0] + prefill_specs[i][1] - 1 for i in last],
        block_size,
        device,
    )
    return PagedKernelMeta(
        decode_tables=_table(decode_tables, decode_lens, block_size).to(device),
        decode_lens=torch.tensor(decode_lens, dtype=torch.int32).to(device),
        num_splits=split_count(nd, kv_heads, max(decode_lens, default=0)),
        prefills=full,
        prefill_last_rows=last_rows,
    )
