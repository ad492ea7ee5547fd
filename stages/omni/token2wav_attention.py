"""Block-local attention for the token2wav DiT.

Each DiT layer lets a frame attend to its own 24-frame block and at most one block before or
after it (most layers: only its own). A dense [L, L] attention with a block mask computes
every masked pair anyway; here each query block is matched against just the key blocks it
may see, as one batched product over [windows, heads, blocks, 24, span * 24]. The softmax then
runs over exactly the allowed keys, which equals the dense masked softmax up to float
summation order.

Padding: the windows are scattered into a padded batch (the longest, in whole blocks). A real
query never sees a padded key or a key outside the sequence; a padded query sees every key of
its span (its row stays finite and is dropped), as with the dense mask.

This is the eager form (stages/omni/token2wav_dit.py uses it without the fused CPU kernels);
kernels/csrc/token2wav_fused.cpp computes the same per query block in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockLayout:
    """One layer reach over one padded batch: the additive mask [b, 1, nb, block, span * block]."""

    mask: torch.Tensor
    block: int
    num_blocks: int
    back: int
    ahead: int

    @property
    def span(self) -> int:
        return 1 + self.back + self.ahead


def block_layout(lengths: list[int], longest: int, block: int, back: int, ahead: int, device) -> BlockLayout:
    nb = -(-longest // block)
    span = 1 + back + ahead
    first_key_block = torch.arange(nb, device=device)[:, None] - back + torch.arange(span, device=device)[None]
    key_pos = (first_key_block[:, :, None] * block + torch.arange(block, device=device)).reshape(nb, span * block)
    query_pos = torch.arange(nb * block, device=device).view(nb, block)
    n = torch.tensor(lengths, device=device).view(-1, 1, 1, 1)
    key_real = (key_pos[None, :, None, :] >= 0) & (key_pos[None, :, None, :] < n)
    allowed = key_real | (query_pos[None, :, :, None] >= n)
    mask = torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))
    return BlockLayout(mask[:, None], block, nb, back, ahead)


def block_attention(module, query, key, value, attention_mask: BlockLayout, **kwargs):
    """query / key / value [b, heads, L, d] -> ([b, L, heads, d], None), transformers' contract."""
    layout = attention_mask
    b, h, length, d = query.shape
    bs, nb = layout.block, layout.num_blocks
    if pad := nb * bs - length:
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    q = query.reshape(b, h, nb, bs, d)
    if layout.span == 1:
        k, v = key.reshape(b, h, nb, bs, d), value.reshape(b, h, nb, bs, d)
    else:
        k, v = (_spans(x, layout) for x in (key, value))
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(d**-0.5).add_(layout.mask)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.reshape(b, h, nb * bs, d)[:, :, :length].transpose(1, 2), None


def _spans(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """[b, h, nb * block, d] -> [b, h, nb, span * block, d]: each block's reachable keys."""
    b, h, _, d = x.shape
    bs = layout.block
    padded = F.pad(x, (0, 0, layout.back * bs, layout.ahead * bs)).view(b, h, -1, bs, d)
    spans = padded.unfold(2, layout.span, 1)  # [b, h, nb, bs, d, span]
    return spans.permute(0, 1, 2, 5, 3, 4).reshape(b, h, layout.num_blocks, layout.span * bs, d)
