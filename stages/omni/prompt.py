"""The thinker's prompt: chat template, media placeholders expanded, encoder rows merged in.

Placeholders are expanded in the order they appear: an audio part takes the next entry of
`audio_embeds`, an image the next image, a video the next video, and with
`use_audio_in_video` a video also takes the next audio entry (its own sound track) and is laid
out as Qwen2.5-Omni's processor lays it out: `<|audio_bos|>` + video and audio rows
interleaved in 2-second chunks + `<|audio_eos|>`, inside the video's vision bos / eos.
Each prompt position gets a prefix-cache key: its token id, or for a media row a 64-bit digest
of that item's embeddings (and grid), so equal keys mean equal inputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.omni.inputs import OmniProcessor
from omnistage.stages.omni.positions import MediaTokens, VideoGrid, interleaved, mrope_positions


@dataclass
class OmniPrompt:
    token_ids: list[int]
    embeds: torch.Tensor | None  # None: text only (plain token prompt)
    media_mask: torch.Tensor | None  # [T] bool: rows that came from an encoder
    cache_keys: list[int] | None
    positions: torch.Tensor | None = None  # (3, T) M-RoPE positions; None: 1-D (no image or video)


@dataclass
class MediaInputs:
    """The encoders' outputs for one request, each list in placeholder order."""

    audios: list[torch.Tensor] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)  # {"embeds", "grid_thw"}
    videos: list[dict[str, Any]] = field(default_factory=list)  # {"embeds", "grid_thw", "second_per_grid"}
    audio_in_video: bool = False


def content_key(rows: torch.Tensor, grid: Any = None) -> int:
    """A negative 64-bit key for one multimodal item (negative: never a token id)."""
    h = hashlib.blake2b(rows.detach().contiguous().cpu().numpy().tobytes(), digest_size=8)
    if grid is not None:
        h.update(repr([int(x) for x in grid]).encode())
    digest = h.digest()
    return -1 - (int.from_bytes(digest, "little") >> 1)


def _check_items(items: list, name: str, keys: tuple[str, ...]) -> None:
    if any(not isinstance(i, dict) or any(k not in i for k in keys) for i in items):
        raise InvalidRequestError(f"{name} entries need {', '.join(repr(k) for k in keys)}", param=name)


class PromptBuilder:
    def __init__(self, processor: OmniProcessor, table: torch.nn.Embedding, thinker_config: dict[str, Any]):
        self.processor = processor
        self.table = table
        self.merge = int(thinker_config.get("vision_config", {}).get("spatial_merge_size", 2))
        self.per_second = float(thinker_config.get("position_id_per_seconds", 25))
        self.seconds_per_chunk = float(thinker_config.get("seconds_per_chunk", 2))
        p = processor
        end = p.tokenizer.convert_tokens_to_ids("<|vision_eos|>")
        audio_bos, audio_eos = (p.tokenizer.convert_tokens_to_ids(t) for t in (p.audio_bos_token, p.audio_eos_token))
        self.tokens = MediaTokens(p.image_token_id, p.video_token_id, p.audio_token_id, audio_bos, audio_eos, end)

    def build(self, messages: Any, media: MediaInputs, speech: bool) -> OmniPrompt:
        _check_items(media.images, "image_embeds", ("embeds", "grid_thw"))
        _check_items(media.videos, "video_embeds", ("embeds", "grid_thw", "second_per_grid"))
        text = self.processor.prompt_text(messages, speech=speech)
        replacements, video_audio = self._layout(self.processor.placeholders(text), media)
        ids = self.processor.expand_in_order(text, replacements)
        if not (media.audios or media.images or media.videos):
            return OmniPrompt(ids, None, None, None)
        embeds, mask, keys = self._merge(ids, media)
        positions = None
        if media.images or media.videos:
            grids = [[int(x) for x in i["grid_thw"]] for i in media.images]
            positions = mrope_positions(
                ids, self.tokens, grids, self._video_grids(media), video_audio, self.merge, self.per_second,
                self.seconds_per_chunk,
            )  # fmt: skip
        return OmniPrompt(ids, embeds, mask, keys, positions)

    def _video_grids(self, media: MediaInputs) -> list[VideoGrid]:
        return [VideoGrid(tuple(int(x) for x in v["grid_thw"]), float(v["second_per_grid"])) for v in media.videos]

    def _layout(self, order: list[str], media: MediaInputs) -> tuple[list[str], list[int | None]]:
        """Each placeholder's replacement text, and per video the audio rows interleaved with it."""
        p = self.processor
        counts = {"audio": len(media.audios), "image": len(media.images), "video": len(media.videos)}
        needed = {k: order.count(k) for k in counts}
        needed["audio"] += needed["video"] if media.audio_in_video else 0
        for kind, what in (("audio", "audio"), ("image", "images"), ("video", "videos")):
            if needed[kind] != counts[kind]:
                raise InvalidRequestError(
                    f"the prompt has {needed[kind]} {what} parts but {counts[kind]} {what} inputs", param=what
                )
        audios, images, videos = iter(media.audios), iter(media.images), iter(self._video_grids(media))
        replacements: list[str] = []
        video_audio: list[int | None] = []
        for kind in order:
            if kind == "audio":
                replacements.append(p.audio_token * int(next(audios).shape[0]))
            elif kind == "image":
                replacements.append(p.image_token * int(next(images)["embeds"].shape[0]))
            else:
                video = next(videos)
                t, h, w = video.grid_thw
                if not media.audio_in_video:
                    replacements.append(p.video_token * (t * h * w // self.merge**2))
                    video_audio.append(None)
                    continue
                n_audio = int(next(audios).shape[0])
                parts = interleaved(video, n_audio, self.merge, self.per_second, self.seconds_per_chunk)
                replacements.append(p.video_with_audio([(k, pos.shape[1]) for k, pos in parts]))
                video_audio.append(n_audio)
        return replacements, video_audio

    def _merge(self, ids: list[int], media: MediaInputs) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Token embeddings with the encoder rows at their placeholders; media mask; cache keys."""
        hidden = self.table.weight.shape[1]
        groups = [
            (self.tokens.audio, media.audios, [None] * len(media.audios), "audio_embeds"),
            (self.tokens.image, [i["embeds"] for i in media.images], [i["grid_thw"] for i in media.images], "image_embeds"),
            (self.tokens.video, [v["embeds"] for v in media.videos], [v["grid_thw"] for v in media.videos], "video_embeds"),
        ]  # fmt: skip
        ids_t = torch.tensor(ids, dtype=torch.long)
        with torch.no_grad():
            embeds = self.table(ids_t.to(self.table.weight.device)).float().cpu()
        keys = list(ids)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for token_id, rows, grids, name in groups:
            if any(r.dim() != 2 or r.shape[1] != hidden for r in rows):
                raise InvalidRequestError(f"encoder embeddings must be [tokens, {hidden}] tensors", param=name)
            at = (ids_t == token_id).nonzero().flatten()
            if sum(r.shape[0] for r in rows) != at.numel():
                raise InvalidRequestError(f"{name} rows do not match the prompt's placeholders", param=name)
            mask[at] = True
            if rows:
                embeds[at] = torch.cat([r.float().cpu() for r in rows])
            offset = 0
            for r, grid in zip(rows, grids):
                key = content_key(r, grid)
                for i in at[offset : offset + r.shape[0]].tolist():
                    keys[i] = key
                offset += r.shape[0]
        return embeds, mask, keys
