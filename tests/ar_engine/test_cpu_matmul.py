"""The column-split CPU matmul against F.linear (the op transformers runs), with two threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.stages.ar import cpu_matmul

from .conftest import torch_threads


@pytest.fixture
def two_threads():
    with torch_threads(2):
        yield


def test_column_slabs():
    assert cpu_matmul.column_slabs(768, 2) == 2
    assert cpu_matmul.column_slabs(768, 1) == 1
    assert cpu_matmul.column_slabs(100, 2) == 1  # two slabs of 50 are too narrow
    assert cpu_matmul.column_slabs(999, 4) == 3  # equal slabs only
    assert cpu_matmul.column_slabs(151936, 16) == 16


@pytest.mark.parametrize("k,n", [(64, 128), (512, 768), (1408, 512), (512, 1000)])
@pytest.mark.parametrize("rows", [1, 23, 24, 64, 192, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(two_threads, k, n, rows, bias):
    g = torch.Generator().manual_seed(rows * 7 + k)
    weight = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    weight_t = weight.t().contiguous()
    split = cpu_matmul.slabs_for(x, weight_t)
    assert split == (2 if cpu_matmul.MIN_ROWS <= rows <= cpu_matmul.MAX_ROWS else 1)
    got = cpu_matmul.matmul(x, weight_t, b)
    assert got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    # a column range of the weight (the last layer's query-only projection uses one)
    part = cpu_matmul.matmul(x, weight_t[:, n // 2 :], None if b is None else b[n // 2 :])
    torch.testing.assert_close(
        part, F.linear(x, weight[n // 2 :], None if b is None else b[n // 2 :]), rtol=1e-5, atol=1e-5
    )


def test_workspace_is_reused(two_threads):
    weight = torch.randn(1000, 64) * 0.1
    weight_t = weight.t().contiguous()
    ws = cpu_matmul.Workspace()
    x1, x2 = torch.randn(40, 64), torch.randn(30, 64)
    first = cpu_matmul.matmul(x1, weight_t, workspace=ws)
    torch.testing.assert_close(first, F.linear(x1, weight), rtol=1e-5, atol=1e-5)
    storage = ws.out.data_ptr()
    second = cpu_matmul.matmul(x2, weight_t, workspace=ws)  # fewer rows: the same memory
    assert ws.out.data_ptr() == storage and second.data_ptr() == storage
    torch.testing.assert_close(second, F.linear(x2, weight), rtol=1e-5, atol=1e-5)
