"""Qwen2.5-Omni's 3-D M-RoPE positions (transformers' `get_rope_index` semantics).

Text and audio rows advance one position per row on all three axes (temporal, height,
width). An image's or a video's rows take the patch grid's positions: temporal
`t * second_per_grid * position_id_per_seconds` (t = 0 for a still image), height and width
the merged-patch row and column, all offset by the next free position; the row after it
continues at the block's largest position + 1.

A video whose audio is used (`use_audio_in_video`) is laid out by the processor as
`<|vision_bos|><|audio_bos|>` + its video and audio rows interleaved in 2-second chunks +
`<|audio_eos|><|vision_eos|>`: the two bos tokens share one position, as do the two eos
tokens; video rows keep their grid positions and audio rows count up from the same start, so
rows of the same instant get close temporal positions. After the interleaved rows the next
position is the largest position of the last chunk + 1 (transformers' rule, kept exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MediaTokens:
    image: int
    video: int
    audio: int
    audio_bos: int
    audio_eos: int
    vision_eos: int


@dataclass(frozen=True)
class VideoGrid:
    grid_thw: tuple[int, int, int]
    second_per_grid: float


def vision_block(t: int, h: int, w: int, second_per_grid: float, per_second: float) -> torch.Tensor:
    """(3, t*h*w) positions of a merged grid from 0; temporal index t * seconds * per_second,
    computed in float32 and truncated as transformers does."""
    t_index = (torch.arange(t) * torch.tensor(second_per_grid, dtype=torch.float32) * per_second).long()
    t_index = t_index.view(-1, 1, 1).expand(t, h, w)
    h_index = torch.arange(h).view(1, -1, 1).expand(t, h, w)
    w_index = torch.arange(w).view(1, 1, -1).expand(t, h, w)
    return torch.stack([t_index.flatten(), h_index.flatten(), w_index.flatten()])


def chunk_bounds(values: torch.Tensor, per_chunk: int) -> list[tuple[int, int]]:
    """(start, end) slices of a non-decreasing sequence cut where it crosses each multiple of
    per_chunk (the processor's and get_rope_index's `get_chunked_index`)."""
    bounds, start, chunk = [], 0, 1
    for i, v in enumerate(values.tolist()):
        if v >= chunk * per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    bounds.append((start, len(values)))
    return bounds


def interleaved(
    video: VideoGrid, num_audio: int, merge: int, per_second: float, seconds_per_chunk: float
) -> list[tuple[str, torch.Tensor]]:
    """A video with its audio: [("video" | "audio", (3, n) positions from 0)] in token order."""
    t, h, w = video.grid_thw
    video_pos = vision_block(t, h // merge, w // merge, video.second_per_grid, per_second)
    audio_pos = torch.arange(num_audio).expand(3, -1)
    per_chunk = int(per_second * seconds_per_chunk)
    v_chunks = chunk_bounds(video_pos[0], per_chunk)
    a_chunks = chunk_bounds(audio_pos[0], per_chunk)
    parts = []
    for j in range(max(len(v_chunks), len(a_chunks))):
        if j < len(v_chunks):
            parts.append(("video", video_pos[:, v_chunks[j][0] : v_chunks[j][1]]))
        if j < len(a_chunks):
            parts.append(("audio", audio_pos[:, a_chunks[j][0] : a_chunks[j][1]]))
    return parts


def mrope_positions(
    token_ids: list[int],
    tokens: MediaTokens,
    image_grids: list[list[int]],
    videos: list[VideoGrid],
    video_audio: list[int | None],
    merge: int,
    per_second: float,
    seconds_per_chunk: float = 2.0,
) -> torch.Tensor:
    """(3, len(token_ids)) int64 positions. `image_grids` [t, h, w] per image and `videos` per
    video, in order; `video_audio[i]`: the audio rows interleaved with video i (None: none)."""
    cols: list[torch.Tensor] = []
    images = iter(image_grids)
    cursor, i, n, k = 0, 0, len(token_ids), 0  # k: the next video
    while i < n:
        tok = token_ids[i]
        if tok in (tokens.image, tokens.video):
            if tok == tokens.image:
                (t, h, w), seconds = next(images), 1.0
            else:
                (t, h, w), seconds = videos[k].grid_thw, videos[k].second_per_grid
                k += 1
            block = vision_block(t, h // merge, w // merge, seconds, per_second) + cursor
            cols.append(block)
            cursor = int(block.max()) + 1
            i += block.shape[1]
        elif tok == tokens.audio_bos and i + 1 < n and token_ids[i + 1] == tokens.video:
            parts = interleaved(videos[k], video_audio[k] or 0, merge, per_second, seconds_per_chunk)
            k += 1
            cols.append(torch.full((3, 1), cursor - 1))  # shares <|vision_bos|>'s position
            cols.extend(pos + cursor for _, pos in parts)
            cursor += int(parts[-1][1].max()) + 1
            i += 1 + sum(p.shape[1] for _, p in parts)
            cols.append(torch.full((3, 1), cursor))  # <|audio_eos|>
            i += 1
            if i < n and token_ids[i] == tokens.vision_eos:
                cols.append(torch.full((3, 1), cursor))  # shares <|audio_eos|>'s position
                i += 1
            cursor += 1
        else:
            j = i + 1
            while j < n and token_ids[j] not in (tokens.image, tokens.video, tokens.audio_bos):
                j += 1
            cols.append(torch.arange(cursor, cursor + j - i).expand(3, -1))
            cursor += j - i
            i = j
    return torch.cat(cols, dim=1).long()
