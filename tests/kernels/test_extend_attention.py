"""Prefill / extend attention over paged K/V vs torch SDPA per chunk (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from omnistage.kernels.triton.extend_attention import paged_extend_attention, paged_extend_attention_ref

from .conftest import TOL

BLOCK = 8
# (cached prefix, new tokens): a fresh prompt, an odd chunk after an odd prefix, a chunk that
# starts exactly on a block boundary, one crossing two boundaries, a single-token extend, a
# chunk longer than the kernel's query tile (16 rows).
CHUNKS = [(0, 5), (3, 7), (BLOCK, BLOCK), (BLOCK - 1, BLOCK + 3), (21, 1), (2, 19)]


def _batch(chunks, kvh, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nb = [-(-(c + n) // BLOCK) for c, n in chunks]
    total = sum(nb) + 2
    kv = torch.randn(2, kvh, total * BLOCK, d, generator=g).to(dtype)
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(len(chunks), max(nb), dtype=torch.int32)
    used = 0
    for i, n in enumerate(nb):
        tables[i, :n] = perm[used : used + n]
        used += n
    q_lens = [n for _, n in chunks]
    starts = [sum(q_lens[:i]) + 2 for i in range(len(chunks))]  # rows 0-1 belong to decodes
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return kv, tables, as_t(starts), as_t(q_lens), as_t([c for c, _ in chunks]), g


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_extend_matches_sdpa(group, dtype):
    kvh, d = 1 if group == 8 else 2, 16
    dt = getattr(torch, dtype)
    kv, tables, starts, q_lens, ctx, g = _batch(CHUNKS, kvh, d, dt, seed=group)
    n_rows = 2 + int(q_lens.sum())
    q = torch.randn(n_rows, kvh * group, d, generator=g).to(dt)
    out = torch.full_like(q, 5.0)
    paged_extend_attention(q, kv, tables, starts, q_lens, ctx, int(q_lens.max()), 0.3, BLOCK, out=out)
    ref = paged_extend_attention_ref(q, kv, tables, starts, q_lens, ctx, 0.3, BLOCK)
    torch.testing.assert_close(out[2:], ref[2:], **TOL[dtype])
    assert (out[:2] == 5).all()  # rows outside every chunk are left alone


def test_causal_mask_is_relative_to_the_prefix():
    """Changing a key after a query's position must not change that query's output."""
    kv, tables, starts, q_lens, ctx, g = _batch([(6, 9)], 2, 16, torch.float32, seed=3)
    q = torch.randn(11, 4, 16, generator=g)
    first = paged_extend_attention(q, kv, tables, starts, q_lens, ctx, 9, 0.3, BLOCK).clone()
    pos = 6 + 4  # query row 4 of the chunk sits at position 10; poison the key at position 11
    slot = int(tables[0, (pos + 1) // BLOCK]) * BLOCK + (pos + 1) % BLOCK
    kv[:, :, slot] += 100.0
    second = paged_extend_attention(q, kv, tables, starts, q_lens, ctx, 9, 0.3, BLOCK)
    torch.testing.assert_close(second[2 : 2 + 5], first[2 : 2 + 5], atol=0, rtol=0)
    assert not torch.allclose(second[2 + 5 :], first[2 + 5 :])
