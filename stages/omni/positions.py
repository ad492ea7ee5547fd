"""Qwen2.5-Omni's 3-D M-RoPE positions (transformers' `get_rope_index` semantics).

Text and audio rows advance one position per row on all three axes (temporal, height,
width). An image's rows (after `<|vision_bos|>`) take the patch grid's positions: temporal
`t * position_id_per_seconds` (t = 0 for a still image), height and width the merged-patch row
and column, all offset by the next free position; the row after the image continues at the
image's largest position + 1.
"""

from __future__ import annotations

import torch


def mrope_positions(
    token_ids: list[int],
    image_token_id: int,
    image_grids: list[list[int]],
    spatial_merge_size: int,
    position_id_per_seconds: float,
) -> torch.Tensor:
    """(3, len(token_ids)) int64 positions; `image_grids` [t, h, w] per image, in order."""
    parts: list[torch.Tensor] = []
    grids = iter(image_grids)
    cursor = 0
    i = 0
    n = len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            j = i
            while j < n and token_ids[j] != image_token_id:
                j += 1
            parts.append(torch.arange(cursor, cursor + j - i).expand(3, -1))
            cursor += j - i
            i = j
            continue
        t, h, w = next(grids)
        block = _image_block(t, h // spatial_merge_size, w // spatial_merge_size, position_id_per_seconds) + cursor
        parts.append(block)
        cursor = int(block.max()) + 1
        i += block.shape[1]
    return torch.cat(parts, dim=1).long()


def _image_block(t: int, h: int, w: int, position_id_per_seconds: float) -> torch.Tensor:
    t_index = (torch.arange(t) * position_id_per_seconds).long().view(-1, 1, 1).expand(t, h, w)
    h_index = torch.arange(h).view(1, -1, 1).expand(t, h, w)
    w_index = torch.arange(w).view(1, 1, -1).expand(t, h, w)
    return torch.stack([t_index.flatten(), h_index.flatten(), w_index.flatten()])
