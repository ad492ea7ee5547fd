"""The `audio_encoder` stage: Qwen2.5-Omni's Whisper-style audio tower as a dynamic-batch stage.

A request carries one audio or a list of them (encoded bytes, a path, or {samples,
sampling_rate}); its output `audio_embeds` is a list with one [tokens, hidden] tensor per
audio, in order: the rows the thinker puts at that audio's `<|AUDIO|>` placeholders. A request
without audio gets an empty list.

Decoding and log-mel extraction run when a request is added (per request, CPU). The forward
packs every audio of every batched request into one call: the tower cuts each audio into
windows of 2 * n_window frames and attends within a window only (block-diagonal over the
packed sequence), so a packed batch of variable-length audios gives each audio exactly what
it gets alone, with no padding waste.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Port, StageContext, StageRequest
from omnistage.stages.dynamic import PreparedBatchEngine
from omnistage.stages.omni.checkpoint import load_submodule, read_config
from omnistage.stages.omni.inputs import AudioFeatures, OmniProcessor
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage

STAGE_PARAMS = ParamSet(
    "audio_encoder",
    (Param("weight_prefix", "string", "thinker.audio_tower.", "Where the audio tower's weights live."),),
)


def build_audio_tower(model_dir: str, prefix: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    raw = read_config(model_dir)["thinker_config"]["audio_config"]
    config = Qwen2_5OmniAudioEncoderConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    tower = Qwen2_5OmniAudioEncoder(config)
    return load_submodule(tower, model_dir, prefix).to(device=device, dtype=dtype)


def encode_audio(tower: torch.nn.Module, features: list[torch.Tensor]) -> list[torch.Tensor]:
    """One packed forward over several audios' log-mel [bins, frames_i]: one [tokens_i, hidden]
    tensor per audio."""
    lens = torch.tensor([f.shape[1] for f in features], dtype=torch.long)
    packed = torch.cat(features, dim=1).to(device=tower.conv1.weight.device, dtype=tower.conv1.weight.dtype)
    after_cnn, out_lens = tower._get_feat_extract_output_lengths(lens)
    with torch.inference_mode():
        hidden = tower(packed, feature_lens=lens, aftercnn_lens=after_cnn).last_hidden_state
    return list(torch.split(hidden, out_lens.tolist()))


@register_stage("audio_encoder")
class AudioEncoderStage(PreparedBatchEngine):
    inputs = {"audio": Port("audio")}
    outputs = {"audio_embeds": Port("embeddings")}
    needs_model = True
    stage_params = STAGE_PARAMS
    prepare_errors = (InvalidRequestError,)

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        if ctx.model_path is None:
            raise ValueError("audio_encoder needs a Qwen2.5-Omni model")
        params = STAGE_PARAMS.validate(ctx.params)
        self.processor = OmniProcessor(ctx.model_path)
        self.tower = build_audio_tower(str(ctx.model_path), params["weight_prefix"], ctx.device, ctx.dtype)

    def prepare(self, request: StageRequest) -> tuple[list[AudioFeatures], Hashable]:
        audio = request.inputs.get("audio")
        if audio is None:  # a request without audio (the pipeline input left out): nothing to encode
            return [], None
        items = audio if isinstance(audio, list) else [audio]
        if any(a is None for a in items):
            raise InvalidRequestError("an audio input is empty", param="audio")
        return [self.processor.audio_features(a) for a in items], None

    def forward_batch(self, requests: list[StageRequest]) -> list[Any]:
        return self.forward_items(
            requests,
            lambda items: encode_audio(self.tower, [f.features for f in items]),
            lambda _items, embeds: {"audio_embeds": embeds},
        )
