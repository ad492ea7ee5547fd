"""Paged decode attention kernel vs its torch reference (TRITON_INTERPRET=1, see conftest)."""

from __future__ import annotations

import pytest
import torch

from omnistage.kernels.triton.decode_attention import paged_decode_attention, paged_decode_attention_ref

from .conftest import TOL

BLOCK = 8


def _paged_batch(lens: list[int], kvh: int, d: int, dtype, seed: int):
    """A cache with shuffled blocks (a sequence's blocks are never adjacent) and the tables."""
    g = torch.Generator().manual_seed(seed)
    nb = [-(-n // BLOCK) for n in lens]
    total = sum(nb) + 3
    kv = torch.randn(2, kvh, total * BLOCK, d, generator=g).to(dtype)
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(len(lens), max(nb) + 1, dtype=torch.int32)  # one padding column
    used = 0
    for b, n in enumerate(nb):
        tables[b, :n] = perm[used : used + n]
        used += n
    return kv, tables, torch.tensor(lens, dtype=torch.int32), g


# Lengths: 1, odd, exactly one and two blocks, one past a block boundary, several blocks.
LENS = [1, 5, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK + 3, 45]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_matches_reference(group, dtype):
    kvh, d = 2, 16
    dt = getattr(torch, dtype)
    kv, tables, lens, g = _paged_batch(LENS, kvh, d, dt, seed=group)
    q = torch.randn(len(LENS), kvh * group, d, generator=g).to(dt)
    ref = paged_decode_attention_ref(q, kv, tables, lens, 0.3, BLOCK)
    for splits in (1, 4):  # 4 splits: the short sequences leave some splits empty
        out = paged_decode_attention(q, kv, tables, lens, 0.3, BLOCK, num_splits=splits, tile_n=16)
        torch.testing.assert_close(out, ref, **TOL[dtype], msg=f"num_splits={splits}")


def test_decode_reads_q_and_writes_out_through_strides():
    """q as a view of a fused qkv output; out as rows of a larger buffer."""
    kvh, group, d = 2, 2, 16
    kv, tables, lens, g = _paged_batch([3, 20], kvh, d, torch.float32, seed=9)
    h = kvh * group
    qkv = torch.randn(2, (h + 2 * kvh) * d, generator=g)
    q = qkv[:, : h * d].view(2, h, d)
    out = torch.full((5, h, d), 7.0)
    paged_decode_attention(q, kv, tables, lens, 0.25, BLOCK, out=out[1:3], tile_n=16)
    ref = paged_decode_attention_ref(q, kv, tables, lens, 0.25, BLOCK)
    torch.testing.assert_close(out[1:3], ref, **TOL["float32"])
    assert (out[0] == 7).all() and (out[3:] == 7).all()
