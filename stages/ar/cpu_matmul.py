"""CPU matmul against a pre-transposed [in, out] weight, split by output columns across threads.

For the row counts of decode batches and short prefill chunks (tens of rows), MKL's sgemm
divides the rows among its threads and each thread packs the whole weight matrix, so a second
thread adds little. A batched GEMM over column slabs of the weight (bmm runs its batch entries
on separate threads) gives each thread one slab of the weight to pack and multiply instead,
with the same per-element dot products (bit-identical). Below `MIN_ROWS` rows the plain GEMM
is as fast or faster, and from `MAX_ROWS` rows on MKL's own threading catches up and joining
the slabs costs more, so the plain GEMM stays. docs/ar-engine.md ("Performance notes") has
the figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MIN_ROWS = 24  # fewer rows: one mm (the split does not pay)
MAX_ROWS = 192  # more rows: one mm (MKL's own threading has caught up)
MIN_SLAB_COLS = 64  # narrower slabs waste each thread's GEMM kernel


def column_slabs(num_cols: int, threads: int) -> int:
    """Slab count for a weight of `num_cols` output columns: up to one per thread, equal
    slabs (so one strided view covers them) of at least MIN_SLAB_COLS columns."""
    s = max(threads, 1)
    while s > 1 and (num_cols % s or num_cols // s < MIN_SLAB_COLS):
        s -= 1
    return s


def slabs_for(x: torch.Tensor, weight_t: torch.Tensor) -> int:
    if x.device.type != "cpu" or x.dim() != 2 or not MIN_ROWS <= x.shape[0] <= MAX_ROWS:
        return 1
    return column_slabs(weight_t.shape[1], torch.get_num_threads())


def slab_view(weight_t: torch.Tensor, slabs: int) -> torch.Tensor:
    """[in, out] (any row stride, unit column stride) viewed as [slabs, in, out / slabs]."""
    k, n = weight_t.shape
    w = n // slabs
    return weight_t.as_strided((slabs, k, w), (w, weight_t.stride(0), 1))


@dataclass
class Workspace:
    """Reused output memory for one large matmul per step (the LM head): fresh multi-MB
    tensors each step cost page faults once glibc trims its heap."""

    slabs: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    out: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @staticmethod
    def _take(buf: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        numel = math.prod(shape)
        if buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf, buf[:numel].view(shape)


def matmul_slabs(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    slabs: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[slabs, rows, out / slabs]: slab j holds output columns [j*w, (j+1)*w)."""
    w = slab_view(weight_t, slabs)
    xs = x.unsqueeze(0).expand(slabs, -1, -1)
    if bias is None:
        return torch.bmm(xs, w, out=out)
    return torch.baddbmm(bias.view(slabs, 1, -1), xs, w, out=out)


def matmul(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None, workspace: Workspace | None = None
) -> torch.Tensor:
    """x [rows, in] @ weight_t [in, out] (+ bias) -> [rows, out]. With a workspace the result
    is a view into it, valid until the next call with the same workspace."""
    slabs = slabs_for(x, weight_t)
    if slabs == 1:
        return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)
    rows, cols = x.shape[0], weight_t.shape[1]
    if workspace is None:
        parts = matmul_slabs(x, weight_t, slabs, bias)
        return torch.cat(parts.unbind(0), dim=1)
    workspace.slabs, part_buf = Workspace._take(workspace.slabs, (slabs, rows, cols // slabs), x)
    workspace.out, out = Workspace._take(workspace.out, (rows, cols), x)
    parts = matmul_slabs(x, weight_t, slabs, bias, out=part_buf)
    return torch.cat(parts.unbind(0), dim=1, out=out)
